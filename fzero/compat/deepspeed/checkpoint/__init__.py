"""`deepspeed.checkpoint`: the helpers Accelerate calls when it saves a model."""

from fzero.compat.deepspeed.checkpoint import utils

__all__ = ["utils"]
