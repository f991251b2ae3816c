"""DeepSpeed's `deepspeed.zero` names over fzero's own: `Init` and `GatheredParameters`.

`Init` has DeepSpeed's results without its mechanism: the model built inside is built
whole on the host, as if there were no context, and sharded when the engine is built.
DeepSpeed partitions each module at the end of its constructor, so what a parent's
constructor does to its children's tensors acts on placeholders, and Transformers
initialises and loads such models afterwards through `GatheredParameters(...,
modifier_rank=0)`; fzero runs those blocks on real tensors, and `GatheredParameters`
broadcasts rank `modifier_rank`'s edits of parameters no engine holds yet, so every
rank ends with rank 0's weights as under DeepSpeed. The model is whole in host memory
until the engine shards it; to never build it whole, use `fzero.init_context()` (the
meta device, each module initialised by its `reset_parameters()` when sharded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fzero.api import gathered_parameters

__all__ = ["GatheredParameters", "Init"]


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `deepspeed.zero.Init(...)`: the model built inside is the one built
    without it (whole, on the host); `fzero.initialize` / `fzero.shard` shards it.

    DeepSpeed's arguments are accepted and change nothing: where shards live is the
    config's `offload_param`, read when the engine is built; `dtype` (DeepSpeed builds
    the partitions in it) is not applied, since fzero's fp32 masters start from the
    values built. `module=` (partition a built model) and `mpu=` are errors.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **_: Any,
    ) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...) partitions an already built model; fzero shards it "
                "when the engine is built: pass the model to fzero.initialize instead"
            )
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(
                f"zero.Init remote_device is {remote_device!r}; allowed: None, 'cpu', 'nvme'"
            )
        self.enabled = enabled

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def GatheredParameters(  # DeepSpeed's name
    params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: torch.nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """DeepSpeed's `zero.GatheredParameters`: `fzero.gathered_parameters` under its name."""
    with gathered_parameters(params, modifier_rank=modifier_rank, enabled=enabled):
        yield
