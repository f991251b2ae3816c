"""Sharded checkpoints: safetensors slices + one msgpack index per tag (never pickled).

`Engine.save_checkpoint` / `Engine.load_checkpoint` write and read them (any world
size, stage or strategy on load); `consolidated_state_dict` and `consolidate` turn one
into the model's own `state_dict` or `model.safetensors`; `inspect` verifies one.
"""

from fzero.checkpoint._consolidate import (
    consolidate,
    consolidated_state_dict,
    inspect,
    iter_consolidated,
    parse_size,
)
from fzero.checkpoint._files import CheckpointError

__all__ = [
    "CheckpointError",
    "consolidate",
    "consolidated_state_dict",
    "inspect",
    "iter_consolidated",
    "parse_size",
]
