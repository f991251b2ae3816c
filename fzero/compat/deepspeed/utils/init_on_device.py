"""`deepspeed.OnDevice` (`deepspeed.utils.init_on_device.OnDevice`): build modules with
their tensors on a device, floating ones in a dtype, e.g. a model on `"meta"` whose
weights a checkpoint fills later:

    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = MyModel()

DeepSpeed's replaces `torch.empty`, `zeros`, `ones`, `full` and `Tensor.__new__` for the
block; fzero's is a torch function mode over the same four constructors, active on this
thread inside the block only (nothing process-wide is replaced): a constructor given no
device builds on `device`, and a floating result is cast to `dtype`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnDevice"]

_CONSTRUCTORS = (torch.empty, torch.zeros, torch.ones, torch.full)


class OnDevice(TorchFunctionMode):
    """Inside the block, `torch.empty`/`zeros`/`ones`/`full` without a `device` build
    on `device`, and their floating results are cast to `dtype` (None: kept), as
    DeepSpeed's `OnDevice`; with `enabled=False` the block changes nothing."""

    def __init__(
        self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True
    ) -> None:
        super().__init__()
        self.dtype, self.device, self.enabled = dtype, device, enabled

    def __enter__(self) -> OnDevice:
        if self.enabled:
            super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _CONSTRUCTORS:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        tensor = func(*args, **kwargs)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor
