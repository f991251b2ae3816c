"""What `import deepspeed` gives under `fzero.compat.install()` / `fzero run --as-deepspeed`.

The names DeepSpeed training scripts and the clients built on it (Transformers,
Accelerate, Lightning, TRL, PEFT) use, served by fzero: `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine`, `zero`, `comm`,
`accelerator`, `checkpointing`, `utils` (logger, zero_to_fp32, safe_get_full_*), `ops.adam`,
`ops.adagrad`, `ops.lion`, `ops.lamb`, `runtime.engine`, `runtime.lr_schedules`,
`runtime.base_optimizer`, `runtime.config` (`DeepSpeedConfig`, also at the top),
`runtime.utils` (`see_memory_usage`), the memory estimators of
`runtime.zero.stage3` and `runtime.zero.stage_1_and_2`,
`runtime.activation_checkpointing.checkpointing` (`checkpointing`), `moe.utils`,
`launcher.runner`, `comm.log_summary`/`configure` (the communication logger),
`profiling.flops_profiler` and `monitor.monitor.MonitorMaster`.
`OnDevice`, `get_accelerator`, `logger` and `log_dist` are served at the top as in
DeepSpeed. What fzero does not do is refused by name: `deepspeed.moe.layer`,
`deepspeed.pipe` and `runtime.sequence_parallel` on import, `tp_model_init` and
`init_inference` when called, DeepSpeed's other top-level names (`PipelineModule`,
`InferenceEngine`, ...) as an AttributeError saying what each is.
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
from fzero.compat.deepspeed.accelerator import get_accelerator
from fzero.compat.deepspeed.comm import init_distributed
from fzero.compat.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from fzero.compat.deepspeed.utils import OnDevice, log_dist, logger
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


def init_inference(*_: Any, **__: Any) -> Any:
    """Refused by name: DeepSpeed-Inference (kernel injection, tensor-parallel serving)."""
    raise NotImplementedError(
        "deepspeed.init_inference (DeepSpeed-Inference: kernel injection, tensor-parallel "
        "serving) is not supported by fzero; fzero shards training (ZeRO stages 0-3). "
        "Generate with the model itself, or with engine.module under a stage-3 engine "
        "(its parameters gathered as each module runs)"
    )


# DeepSpeed 0.19.8's other top-level names: not served, each refused with what it is
# (an AttributeError, so `hasattr(deepspeed, name)` stays False for feature checks)
_NOT_SERVED = {
    "PipelineModule": "pipeline parallelism",
    "PipelineEngine": "pipeline parallelism",
    "pipe": "pipeline parallelism",
    "DualPipeVEngine": "DualPipeV pipeline parallelism",
    "DualPipeVModule": "DualPipeV pipeline parallelism",
    "InferenceEngine": "DeepSpeed-Inference",
    "DeepSpeedInferenceConfig": "DeepSpeed-Inference",
    "default_inference_config": "DeepSpeed-Inference",
    "inference": "DeepSpeed-Inference",
    "module_inject": "DeepSpeed-Inference's kernel injection",
    "replace_transformer_layer": "DeepSpeed-Inference's kernel injection",
    "model_implementations": "DeepSpeed-Inference's model implementations",
    "DeepSpeedHybridEngine": "the RLHF hybrid engine",
    "DeepSpeedTransformerLayer": "the fused transformer kernel",
    "DeepSpeedTransformerConfig": "the fused transformer kernel",
    "DeepSpeedDataLoader": "DeepSpeed's loader (initialize(training_data=...) builds one)",
    "set_autotp_mode": "AutoTP tensor parallelism",
    "autotuning": "the autotuner",
    "compile": "DeepCompile",
}


def __getattr__(name: str) -> Any:
    what = _NOT_SERVED.get(name)
    if what is None:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
    raise AttributeError(
        f"deepspeed.{name} is {what}, which fzero does not serve: fzero shards data-parallel "
        "training only (ZeRO stages 0-3)"
    )


__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "OnDevice",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "launcher",
    "log_dist",
    "logger",
    "moe",
    "monitor",
    "ops",
    "profiling",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]
