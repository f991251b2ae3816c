"""`deepspeed.runtime.activation_checkpointing`: its `checkpointing` is the module served
as `deepspeed.checkpointing` (`fzero.compat.checkpointing`), the same object, as in
DeepSpeed; Megatron-style code imports it by this path."""

from fzero.compat import checkpointing

__all__ = ["checkpointing"]
