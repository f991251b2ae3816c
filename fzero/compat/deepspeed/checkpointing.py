"""`deepspeed.checkpointing`: activation checkpointing (`fzero.compat.checkpointing`)."""

from fzero.compat.checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
