"""`deepspeed.utils.groups`: DeepSpeed's model/expert/sequence-parallel process groups.

fzero trains data-parallel only, over the whole world: the data-parallel queries answer
for it; every other group (tensor, expert, sequence parallel) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size"]


def get_data_parallel_group() -> Any:
    """The data-parallel group: the whole world."""
    return dist.group.WORLD


def get_data_parallel_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_data_parallel_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(
        f"deepspeed.utils.groups.{name}: model, expert and sequence parallel groups are not "
        "supported by fzero (data parallel only: get_data_parallel_group/_rank/_world_size)"
    )
