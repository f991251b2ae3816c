"""`deepspeed.profiling`: the FLOPs profiler (`flops_profiler`), served by
`fzero.monitoring` on `torch.utils.flop_counter.FlopCounterMode`."""

from fzero.compat.deepspeed.profiling import flops_profiler

__all__ = ["flops_profiler"]
