"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: a copy of a (nested) state
dict whose tensors own their memory on `device`, so saving one stores no views of the
engine's flat buffers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: str | torch.device = "cpu") -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) with every tensor copied to
    `device`; anything else is kept as it is."""
    target = torch.device(device)
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().to(target, copy=True).contiguous(), item
    )
