"""`deepspeed.accelerator`: `get_accelerator()` (CUDA when PyTorch sees a GPU, else CPU)."""

from fzero.compat.accelerator import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator"]
