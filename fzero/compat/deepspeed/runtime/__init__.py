"""`deepspeed.runtime`: the engine class, the schedule names and `zero`, as Accelerate
and Transformers look them up."""

from fzero.compat.deepspeed.runtime import base_optimizer, engine, lr_schedules, utils, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "utils", "zero"]
