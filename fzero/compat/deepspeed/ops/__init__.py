"""`deepspeed.ops`: the optimizers DeepSpeed scripts construct (`deepspeed.ops.adam`,
`ops.adagrad`, `ops.lion`), run by fzero's engine with its own kernels."""

from fzero.compat.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
