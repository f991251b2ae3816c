"""`deepspeed.runtime.zero`: `Init` and `GatheredParameters` (fzero's `deepspeed.zero`),
`partition_parameters`, whose construction hooks Transformers patches, `config`
(`ZeroStageEnum`), and DeepSpeed's memory estimators in `stage3` and `stage_1_and_2`."""

from fzero.compat.deepspeed.runtime.zero import (
    config,
    offload_config,
    partition_parameters,
    stage3,
    stage_1_and_2,
)
from fzero.compat.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "config",
    "offload_config",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
]
