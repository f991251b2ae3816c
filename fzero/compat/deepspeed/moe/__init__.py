"""`deepspeed.moe`: the pure helpers scripts call on models without MoE layers are served
(`deepspeed.moe.utils`); the MoE layers themselves (`deepspeed.moe.layer`) are not
supported by fzero and say so when imported."""

from fzero.compat.deepspeed.moe import utils

__all__ = ["utils"]
