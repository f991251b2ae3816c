"""Sharded checkpoints: safetensors slices + one msgpack index per tag (never pickled).

`save(directory, state, optimizer=...)` writes a `TrainState`, `restore(directory,
like)` reads one back (any world size, stage or strategy on load);
`Engine.save_checkpoint` / `Engine.load_checkpoint` are these with the engine's extras.
`consolidated_state_dict` and `consolidate` turn one into the model's own `state_dict`
or `model.safetensors` (`write_model_files`: Transformers' file layout, written one
tensor at a time); `inspect` verifies one. A damaged checkpoint raises
`CheckpointError` and changes nothing; `PartlyRestoredError` (a read failing after every
checksum passed) leaves the state to be restored again.
"""

from fzero.checkpoint._consolidate import (
    consolidate,
    consolidated_state_dict,
    inspect,
    iter_consolidated,
    parse_size,
    write_model_files,
)
from fzero.checkpoint._files import CheckpointError
from fzero.checkpoint._restore import PartlyRestoredError, Restored, restore
from fzero.checkpoint._save import Extras, save, wait_for_save

__all__ = [
    "CheckpointError",
    "Extras",
    "PartlyRestoredError",
    "Restored",
    "consolidate",
    "consolidated_state_dict",
    "inspect",
    "iter_consolidated",
    "parse_size",
    "restore",
    "save",
    "wait_for_save",
    "write_model_files",
]
