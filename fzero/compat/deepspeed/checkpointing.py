"""`deepspeed.checkpointing`: activation checkpointing (`fzero.checkpointing`)."""

from fzero.checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
