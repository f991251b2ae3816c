"""`deepspeed.runtime.zero`: `Init` and `GatheredParameters` (fzero's `deepspeed.zero`),
and `partition_parameters`, whose construction hooks Transformers patches."""

from fzero.compat.deepspeed.runtime.zero import partition_parameters
from fzero.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
