"""`deepspeed.profiling.flops_profiler.profiler`: where DeepSpeed defines the profiler."""

from fzero.monitoring import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
