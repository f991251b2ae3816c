"""fzero: ZeRO sharded data-parallel training for PyTorch, with plans as plain data.

`import fzero as deepspeed` gives a DeepSpeed script the names it calls at the top
level (`initialize`, `init_distributed`, `zero`, `comm`, `accelerator`, ...); for scripts
left unchanged, `fzero run --as-deepspeed` serves `import deepspeed` (`fzero.compat`).
"""

import sys

from fzero import _logs, checkpoint, comm, monitoring, optim, partition
from fzero._version import __version__
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
from fzero.core.step import train_step
from fzero.engine import Engine
from fzero.engine.entry import shard
from fzero.monitoring import monitor

_logs.install()  # INFO from rank 0 only, unless FZERO_LOG_ALL_RANKS=1

# DeepSpeed-named modules live in `fzero.compat`; `import fzero.checkpointing` (activation
# recomputation, DeepSpeed's `deepspeed.checkpointing`), `fzero.zero` and
# `fzero.accelerator` keep working as they did at the top level
for _name, _module in (
    ("accelerator", accelerator),
    ("checkpointing", checkpointing),
    ("zero", zero),
):
    sys.modules.setdefault(f"fzero.{_name}", _module)

DeepSpeedEngine = Engine  # DeepSpeed's name, for isinstance checks

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
