"""`deepspeed.runtime`: the engine class and the schedule names, as Accelerate and
Transformers look them up."""

from fzero.compat.deepspeed.runtime import engine, lr_schedules

__all__ = ["engine", "lr_schedules"]
