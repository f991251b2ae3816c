"""`deepspeed.runtime.engine.DeepSpeedEngine`: fzero's `Engine`, for isinstance checks."""

from fzero.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
