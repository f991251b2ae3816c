"""What `import deepspeed` gives under `fzero.compat.install()` / `fzero run --as-deepspeed`.

The names DeepSpeed training scripts and the clients built on it (Transformers,
Accelerate, Lightning, TRL, PEFT) use, served by fzero: `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine`, `zero`, `comm`,
`accelerator`, `checkpointing`, `utils` (logger, zero_to_fp32, safe_get_full_*), `ops.adam`,
`ops.adagrad`, `ops.lion`, `ops.lamb`, `runtime.engine`, `runtime.lr_schedules`,
`runtime.base_optimizer`, `runtime.utils` (`see_memory_usage`), the memory estimators of
`runtime.zero.stage3` and `runtime.zero.stage_1_and_2`,
`runtime.activation_checkpointing.checkpointing` (`checkpointing`), `moe.utils`,
`launcher.runner`, `comm.log_summary`/`configure` (the communication logger),
`profiling.flops_profiler` and `monitor.monitor.MonitorMaster`.
What fzero does not do is refused by name: `deepspeed.moe.layer`, `deepspeed.pipe` and
`runtime.sequence_parallel` on import, `tp_model_init` when called.
`tests/test_client_names.py` scans the installed clients for
every `deepspeed.*` name they reference and checks each is one or the other.
"""

from __future__ import annotations

from typing import Any

from fzero._version import __version__ as _fzero_version
from fzero.compat import checkpointing, zero
from fzero.compat.arguments import add_config_arguments
from fzero.compat.deepspeed import (
    accelerator,
    comm,
    launcher,
    moe,
    monitor,
    ops,
    profiling,
    runtime,
    utils,
)
from fzero.compat.deepspeed.comm import init_distributed
from fzero.compat.initialize import initialize
from fzero.engine import Engine as DeepSpeedEngine

# The DeepSpeed API level fzero follows, and what it really is.
__version__ = f"0.19.8+fzero.{_fzero_version}"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8


def tp_model_init(*_: Any, **__: Any) -> Any:
    """Refused by name: DeepSpeed's AutoTP tensor parallelism."""
    raise NotImplementedError(
        "deepspeed.tp_model_init (AutoTP tensor parallelism) is not supported by fzero; "
        "fzero shards data-parallel training only (ZeRO stages 0-3): leave "
        "tensor_parallel.autotp_size at 1"
    )


__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "launcher",
    "moe",
    "monitor",
    "ops",
    "profiling",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]
