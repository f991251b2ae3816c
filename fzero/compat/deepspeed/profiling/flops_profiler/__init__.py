"""`deepspeed.profiling.flops_profiler`: `FlopsProfiler` and `get_model_profile`, counted
by `torch.utils.flop_counter.FlopCounterMode` (`fzero.monitoring`; matrix products,
convolutions and attention — element-wise work is not counted, unlike DeepSpeed's own
estimates)."""

from fzero.compat.deepspeed.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    get_model_profile,
)

__all__ = ["FlopsProfiler", "get_model_profile"]
