"""`deepspeed.runtime`: the engine class, the schedule names and `zero`, as Accelerate
and Transformers look them up."""

from fzero.compat.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
