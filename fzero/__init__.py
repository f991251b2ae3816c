"""fzero: ZeRO sharded data-parallel training for PyTorch, with plans as plain data."""

from fzero import checkpoint, checkpointing, optim, partition
from fzero._meta_init import init_context
from fzero._version import __version__
from fzero.api import gathered_parameters, initialize, shard
from fzero.config import Config, add_config_arguments, load_config, resolve_auto
from fzero.engine import Engine

__all__ = [
    "Config",
    "Engine",
    "__version__",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "gathered_parameters",
    "init_context",
    "initialize",
    "load_config",
    "optim",
    "partition",
    "resolve_auto",
    "shard",
]
