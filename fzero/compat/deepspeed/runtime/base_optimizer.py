"""`deepspeed.runtime.base_optimizer`: DeepSpeed's marker base classes of its optimizer
wrappers (not `torch.optim.Optimizer`s). Lightning tests `isinstance(x,
DeepSpeedOptimizer)` to find optimizer state in a checkpoint dict: the optimizer an
fzero engine returns (`fzero.engine.optimizer.EngineOptimizer`) is one."""

from fzero.engine.optimizer import DeepSpeedOptimizer, ZeROOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
