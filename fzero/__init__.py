"""fzero: ZeRO sharded data-parallel training for PyTorch, with plans as plain data.

`import fzero as deepspeed` gives a DeepSpeed script the names it calls at the top
level (`initialize`, `init_distributed`, `zero`, `comm`, `accelerator`, ...); for scripts
left unchanged, `fzero run --as-deepspeed` serves `import deepspeed` (`fzero.compat`).
"""

from fzero import accelerator, checkpoint, checkpointing, comm, optim, partition, zero
from fzero._arguments import add_config_arguments
from fzero._auto import resolve_auto
from fzero._functional import init, state_dict
from fzero._meta_init import init_context
from fzero._train_state import Counters, TrainState, UnitState
from fzero._train_step import eval_step, train_step
from fzero._version import __version__
from fzero.api import gathered_parameters, initialize, shard
from fzero.compat.deepspeed.comm import init_distributed
from fzero.config import Config, load_config
from fzero.engine import Engine

DeepSpeedEngine = Engine  # DeepSpeed's name, for isinstance checks

__all__ = [
    "Config",
    "Counters",
    "DeepSpeedEngine",
    "Engine",
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
    "optim",
    "partition",
    "resolve_auto",
    "shard",
    "state_dict",
    "train_step",
    "zero",
]
