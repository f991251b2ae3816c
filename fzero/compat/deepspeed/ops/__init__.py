"""`deepspeed.ops`: the optimizers DeepSpeed scripts construct (`deepspeed.ops.adam`);
`ops.adagrad` and `ops.lion` refuse by name when called."""

from fzero.compat.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
