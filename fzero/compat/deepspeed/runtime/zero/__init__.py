"""`deepspeed.runtime.zero`: `Init` and `GatheredParameters` (fzero's `deepspeed.zero`),
and `partition_parameters`, whose construction hooks Transformers patches."""

from fzero.compat.deepspeed.runtime.zero import partition_parameters
from fzero.compat.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "partition_parameters",
    "register_external_parameter",
]
