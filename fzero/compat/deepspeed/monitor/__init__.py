"""`deepspeed.monitor`: DeepSpeed's monitor classes over fzero's writers
(`fzero.monitoring`), for scripts that write their own events."""

from fzero.compat.deepspeed.monitor import monitor

__all__ = ["monitor"]
