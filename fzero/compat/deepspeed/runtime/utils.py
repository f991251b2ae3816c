"""`deepspeed.runtime.utils`: the helpers clients import from it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["move_to_device"]


def move_to_device(item: Any, device: torch.device | str) -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) with every tensor on
    `device`; anything else as it is."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), item)
