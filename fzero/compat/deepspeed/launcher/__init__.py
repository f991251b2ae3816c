"""`deepspeed.launcher`: the names Accelerate's launcher reads (`runner`)."""

from fzero.compat.deepspeed.launcher import runner

__all__ = ["runner"]
