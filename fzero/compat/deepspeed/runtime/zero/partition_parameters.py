"""`deepspeed.runtime.zero.partition_parameters`, as far as Transformers and TRL reach
into it (`ZeroParamStatus`, which fzero's stage-3 parameters carry as `ds_status`).

DeepSpeed's `zero.Init` replaces torch's tensor constructors with
`zero_wrapper_for_fp_tensor_constructor(fn, dtype)` (casting new float tensors to the
config's dtype); Transformers swaps that wrapper to exempt `torch.arange`
(`_orig_torch_arange`) while it builds a model. fzero's `Init` wraps no constructor
(the model is built as without it), so the wrapper here returns `fn` itself and the
swap changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fzero.compat.accelerator import get_accelerator
from fzero.compat.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange  # what Transformers compares the wrapped function with


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """DeepSpeed's constructor wrapper; fzero's `Init` casts nothing: `fn` itself."""
    return fn
