"""fzero: ZeRO sharded data-parallel training for PyTorch, with plans as plain data.

`import fzero as deepspeed` gives a DeepSpeed script the names it calls at the top
level (`initialize`, `init_distributed`, `zero`, `comm`, `accelerator`, ...); for scripts
left unchanged, `fzero run --as-deepspeed` serves `import deepspeed` (`fzero.compat`).

Each public name is imported on first use (PEP 562), so `import fzero` and the
`fzero run` launcher do not import torch: the launcher starts processes and needs none
of it (2 s and 220 MB of every launch). `import fzero.zero`, `fzero.checkpointing` and
`fzero.accelerator` are DeepSpeed's module names for `fzero.compat`'s (small modules
beside this one hand over the real ones).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from fzero import _logs
from fzero._version import __version__

_logs.install()  # INFO from rank 0 only, unless FZERO_LOG_ALL_RANKS=1

# public name -> (module, attribute in it; None: the module itself)
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "Config": ("fzero.config", "Config"),
    "Counters": ("fzero.core.state", "Counters"),
    "DeepSpeedEngine": ("fzero.engine", "Engine"),  # DeepSpeed's name, for isinstance
    "Engine": ("fzero.engine", "Engine"),
    "Precision": ("fzero.core.precision", "Precision"),
    "TrainState": ("fzero.core.state", "TrainState"),
    "UnitState": ("fzero.core.state", "UnitState"),
    "accelerator": ("fzero.compat.accelerator", None),
    "add_config_arguments": ("fzero.compat.arguments", "add_config_arguments"),
    "checkpoint": ("fzero.checkpoint", None),
    "checkpointing": ("fzero.compat.checkpointing", None),
    "comm": ("fzero.comm", None),
    "eval_step": ("fzero.core.evaluate", "eval_step"),
    "gathered_parameters": ("fzero.compat.zero", "gathered_parameters"),
    "init": ("fzero.core.init", "init"),
    "init_context": ("fzero.core.construction", "init_context"),
    "init_distributed": ("fzero.compat.deepspeed.comm", "init_distributed"),
    "initialize": ("fzero.compat.initialize", "initialize"),
    "load_config": ("fzero.config", "load_config"),
    "load_safetensors": ("fzero.core.load_weights", "load_safetensors"),
    "monitor": ("fzero.monitoring", "monitor"),
    "monitoring": ("fzero.monitoring", None),
    "optim": ("fzero.optim", None),
    "partition": ("fzero.partition", None),
    "resolve_auto": ("fzero.config.auto", "resolve_auto"),
    "shard": ("fzero.engine.entry", "shard"),
    "state_dict": ("fzero.core.init", "state_dict"),
    "train_step": ("fzero.core.step", "train_step"),
    "zero": ("fzero.compat.zero", None),
}

__all__ = [
    "Config",
    "Counters",
    "DeepSpeedEngine",
    "Engine",
    "Precision",
    "TrainState",
    "UnitState",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "eval_step",
    "gathered_parameters",
    "init",
    "init_context",
    "init_distributed",
    "initialize",
    "load_config",
    "load_safetensors",
    "monitor",
    "monitoring",
    "optim",
    "partition",
    "resolve_auto",
    "shard",
    "state_dict",
    "train_step",
    "zero",
]


def __getattr__(name: str) -> Any:
    """The public name `name`, or the subpackage or module `fzero.<name>` (`fzero.native`,
    `fzero.compat`, ... as an eager package had them), imported on first use and kept."""
    if name in _PUBLIC:
        module_name, attribute = _PUBLIC[name]
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        module_name, attribute = f"{__name__}.{name}", None
    else:
        raise AttributeError(f"module 'fzero' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:  # what the names are, for type checkers and readers
    from fzero import checkpoint, comm, monitoring, optim, partition
    from fzero.compat import accelerator, checkpointing, zero
    from fzero.compat.arguments import add_config_arguments
    from fzero.compat.deepspeed.comm import init_distributed
    from fzero.compat.initialize import initialize
    from fzero.compat.zero import gathered_parameters
    from fzero.config import Config, load_config
    from fzero.config.auto import resolve_auto
    from fzero.core.construction import init_context
    from fzero.core.evaluate import eval_step
    from fzero.core.init import init, state_dict
    from fzero.core.load_weights import load_safetensors
    from fzero.core.precision import Precision
    from fzero.core.state import Counters, TrainState, UnitState
    from fzero.engine import Engine
    from fzero.engine import Engine as DeepSpeedEngine
    from fzero.engine.entry import shard
    from fzero.monitoring import monitor
