"""DeepSpeed's `deepspeed.zero` names over fzero's own: `Init` and `GatheredParameters`.

`Init` builds the model inside `fzero.init_context()`: on the meta device, so it never
exists whole; the engine then materialises it one module at a time, each from its
`reset_parameters()` (or `param_init_fn`), sharded as the plan says. Unlike DeepSpeed's
`zero.Init`, initialisation that a parent module runs on its children's tensors inside
`__init__` (e.g. `self.apply(self._init_weights)`) acts on meta tensors and is lost;
give such models a `param_init_fn`, or build them outside `Init`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fzero._meta_init import init_context
from fzero.api import gathered_parameters

__all__ = ["GatheredParameters", "Init"]


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `deepspeed.zero.Init(...)`: the model built inside takes no memory
    until `fzero.initialize` / `fzero.shard` shards it (stage 3 or any other).

    DeepSpeed's arguments are accepted; `enabled=False` builds normally. A
    `remote_device` other than None/"cpu"/"nvme" is an error: where shards live is the
    config's `offload_param`, read when the engine is built.
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
        self._context: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._context = init_context()
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(*exc)


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
