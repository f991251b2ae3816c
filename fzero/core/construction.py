"""Partitioning a model while it is constructed: `fzero.init_context()` (and
`deepspeed.zero.Init`, `fzero.compat.zero`).

Inside the context every module's parameters are created and initialised by its own
constructor as without the context — whole, from the generator state an unsharded
construction has, so the weights equal a plain construction from the same seed — and
reduced to this rank's partition (`fzero.core.partitioned`) as soon as the constructor
returns, as DeepSpeed's `zero.Init` does at the end of each `__init__`. Nothing
model-sized exists in any process: at most the modules under construction are whole.

How the end of a constructor is seen, without patching `torch.nn.Module`: torch's global
registration hooks (`register_module_{parameter,buffer,module}_registration_hook`,
installed for the context and removed on exit) report every parameter, buffer and child
a module registers. A module that registered parameters is pending until no
`__init__` running on the call stack is its own (its constructor, or a base class's
that it calls, has returned); at the next registration, and at the context's exit, the
pending modules whose constructors have returned are partitioned, in the order they
were first seen (the same on every rank). So a parent's constructor sees its children's
parameters partitioned, as under DeepSpeed: it edits them through
`GatheredParameters`. A parameter created outside any module stays whole until a module
registers it.

`module.apply(fn)` inside the context (a parent's constructor re-initialising its
children, as many models do) sees each module's parameters whole: `fn` runs on a module
inside `GatheredParameters` of its own partitioned parameters, and rank 0's values
become the partitions (DeepSpeed's `override_module_apply`, its default). That is the
one torch attribute the context sets: `torch.nn.Module.apply`, for the context's
duration, restored on exit.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from fzero import comm
from fzero.core import nvme as _nvme
from fzero.core.partitioned import (
    PartitionStore,
    gathered_partitions,
    is_partitioned,
    partition_parameters,
)

__all__ = ["Construction", "init_context"]


class Construction:
    """The context that partitions modules as they are constructed (see the module
    docstring). `dtype`: floating parameters are kept in it (DeepSpeed's `dtype`; None:
    as built); `remote_device`: where partitions live — None (the compute device),
    "cpu" (host memory, pinned with `pin_memory` where CUDA runs) or "nvme" (a file
    under `nvme_path`); `persistence_threshold`: parameters this small are marked
    `ds_persist`, as DeepSpeed's `stage3_param_persistence_threshold` marks them.
    Starts the default process group if none runs. Disabled (`enabled=False`), a plain
    construction."""

    def __init__(
        self,
        *,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        pin_memory: bool = False,
        nvme_path: str | None = None,
        persistence_threshold: int = 0,
        enabled: bool = True,
        override_module_apply: bool = True,
    ) -> None:
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"remote_device is {remote_device!r}; allowed: None, 'cpu', 'nvme'")
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype is {dtype}; allowed: None, torch.float32, torch.bfloat16, torch.float16"
            )
        self.dtype, self.enabled = dtype, enabled
        self.where = {None: "device", "none": "device"}.get(remote_device, remote_device)
        self.pin_memory, self.nvme_path = pin_memory, nvme_path
        self.persistence_threshold = persistence_threshold
        self.override_module_apply = override_module_apply
        self._apply: Any = None  # `nn.Module.apply` as found on entry, while overridden
        if self.where == "nvme" and not nvme_path:
            raise ValueError(
                "remote_device 'nvme' needs a directory for the partitions: nvme_path "
                "(DeepSpeed's zero_optimization.offload_param.nvme_path)"
            )
        self.store: PartitionStore | None = None
        self._pending: dict[int, nn.Module] = {}  # modules with whole parameters, in order
        self._handles: list[Any] = []

    def __enter__(self) -> Construction:
        if not self.enabled:
            return self
        comm.init_distributed()
        if self.store is None:
            self.store = PartitionStore(
                self.where,
                device=comm.backend_device(),
                pin_memory=self.pin_memory,
                nvme_path=self.nvme_path,
            )
        # a freed module-sized block goes back to the OS (else glibc's heap keeps it)
        _nvme.map_large_buffers()
        self._handles = [
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
            torch_module.register_module_buffer_registration_hook(self._on_registration),
            torch_module.register_module_module_registration_hook(self._on_registration),
        ]
        if self.override_module_apply:
            self._apply = nn.Module.apply
            nn.Module.apply = _gathering_apply(self._apply)  # type: ignore[method-assign]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._apply is not None:
            nn.Module.apply = self._apply  # type: ignore[method-assign]
            self._apply = None
        if kind is None:  # every constructor has returned: the rest is partitioned
            self._partition(list(self._pending.values()))
        self._pending.clear()
        _nvme.return_free_memory()  # the whole tensors freed among partitions: to the OS

    # ---- hooks --------------------------------------------------------------------------

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        fresh = param is not None and not is_partitioned(param)
        # (an engine's parameter is never partitioned here)
        if fresh and "_fzero_engine" not in param.__dict__ and id(module) not in self._pending:
            self._pending[id(module)] = module
        self._partition_built(module, sys._getframe(1))

    def _on_registration(self, module: nn.Module, name: str, value: Any) -> None:
        self._partition_built(module, sys._getframe(1))

    def _partition_built(self, registering: nn.Module, frame: FrameType | None) -> None:
        """Partition the pending modules whose constructors have all returned (but
        `registering`, whose new tensor torch stores after the hooks)."""
        if not self._pending:
            return
        building = _under_construction(frame) | {id(registering)}
        done = [m for key, m in self._pending.items() if key not in building]
        for module in done:
            del self._pending[id(module)]
        self._partition(done)

    def _partition(self, modules: list[nn.Module]) -> None:
        assert self.store is not None
        for module in modules:
            params = [p for p in module._parameters.values() if p is not None]
            params = [p for p in params if "_fzero_engine" not in p.__dict__]
            partition_parameters(
                params,
                self.store,
                dtype=self.dtype,
                persistence_threshold=self.persistence_threshold,
                what=f"the parameters of a {type(module).__name__}",
            )


def _gathering_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """`nn.Module.apply` that runs each `fn` on whole parameters (`_gathering`)."""

    def apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
        return original(module, _gathering(fn))

    return functools.wraps(original)(apply)


def _gathering(fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """`fn` run on a module inside `GatheredParameters` of its own partitioned
    parameters with `modifier_rank=0` (collective: every rank applies `fn` to the same
    modules in the same order), as DeepSpeed's `apply_with_gather`; once (a child's
    `apply` gets the wrapped `fn` again)."""
    if getattr(fn, "_fzero_gathers", False):
        return fn

    def each(module: nn.Module) -> None:
        params = [p for p in module._parameters.values() if p is not None]
        if not any(is_partitioned(p) for p in params):
            fn(module)
            return
        with gathered_partitions(params, modifier_rank=0):
            fn(module)

    each._fzero_gathers = True  # type: ignore[attr-defined]
    return each


def _under_construction(frame: FrameType | None) -> set[int]:
    """The ids of the modules whose `__init__` (any class's in their hierarchy) is on
    the call stack from `frame` outwards."""
    building: set[int] = set()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount:
            first = frame.f_locals.get(code.co_varnames[0])
            if isinstance(first, nn.Module):
                building.add(id(first))
        frame = frame.f_back
    return building


def init_context(
    *,
    dtype: torch.dtype | None = None,
    remote_device: str | None = None,
    pin_memory: bool = False,
    nvme_path: str | None = None,
    enabled: bool = True,
    override_module_apply: bool = True,
) -> Construction:
    """Modules constructed inside are partitioned as their constructors return: each
    rank keeps only its part of every parameter (the weights those of a plain
    construction from the same seed), so nothing model-sized exists in any process.
    `fzero.shard`, `fzero.initialize` and `fzero.init` adopt the partitions unit by unit;
    `fzero.gathered_parameters` shows them whole (and takes a rank's edits, loads read
    by byte range). `dtype`: keep floating parameters in it; `remote_device` None (the
    compute device), "cpu" or "nvme" (a file under `nvme_path`). `module.apply(fn)`
    inside sees whole parameters (`override_module_apply`, DeepSpeed's default; false:
    the partitioned placeholders). Starts the default process group if none runs."""
    return Construction(
        dtype=dtype,
        remote_device=remote_device,
        pin_memory=pin_memory,
        nvme_path=nvme_path,
        enabled=enabled,
        override_module_apply=override_module_apply,
    )
