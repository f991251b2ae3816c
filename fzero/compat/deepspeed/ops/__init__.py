"""`deepspeed.ops`: the optimizers DeepSpeed scripts construct (`deepspeed.ops.adam`,
`ops.adagrad`, `ops.lion`, `ops.lamb`), run by fzero's engine with its own kernels."""

from fzero.compat.deepspeed.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
