"""Backward's gradient sums kept in the NVMe swap file (ZeRO-Infinity, Rajbhandari et al.
2021: stages 2-3 with `offload_optimizer.device: nvme`, `grads_on_disk` in
`fzero.core.residency`): each micro-step's reduced shard added to its unit's sum (read
from the file, added to, written back asynchronously), the writes in flight, and the end
of backward, where every rank learns whether any rank's gradient I/O failed.

The file, its buffer pools and its regions are the `Residency`'s; these functions take
what they need of it as a `GradFile`, and keep this backward's writes in its
`GradWrites`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from fzero.core import nvme as _nvme
from fzero.core.layout import UnitRuntime
from fzero.core.swap_buffers import narrow_in_place, packed, swap_buffer_numel, widen_packed
from fzero.partition import Plan

__all__ = ["GradFile", "GradWrites", "accumulate_grad", "finish_grad_writes", "write_grad"]


@dataclass
class GradWrites:
    """Backward's gradient writes to the swap file: those in flight, the first I/O error
    of this backward, and the units whose sum this window starts now."""

    pending: list[tuple[Any, Tensor, Any]] = field(default_factory=list)  # (ticket, buffer, pool)
    failure: str = ""  # the first gradient I/O error of this backward
    fresh: set[int] = field(default_factory=set)  # units whose accumulator this window starts now


class GradFile(Protocol):
    """What the gradient sums need of the swap file's owner (`fzero.core.residency.
    Residency`): the file, its pools and gradient regions, and the writes in flight."""

    nvme: Any
    plan: Plan
    rank: int
    pool: _nvme.BufferPool
    grad_pool: _nvme.BufferPool
    grad_dtype: torch.dtype
    write_buffers: int
    grad_writes: GradWrites

    @property
    def narrow_grads(self) -> bool: ...

    def grad_on_disk(self, index: int) -> bool: ...

    def grad_region(self, rt: UnitRuntime) -> int: ...

    def drain(self, batches: list[list[Any]]) -> None: ...

    def failures(self, failure: str, world_size: int) -> list[str]: ...


def accumulate_grad(
    file: GradFile,
    rt: UnitRuntime,
    value: Tensor,
    at_boundary: bool,
    stats: Callable[..., Any],
    at: int = 0,
) -> None:
    """Stages 2-3: add this micro-step's reduced gradient shard, or its piece from
    element `at` (pieces come in order: [Note: gradients reduced in pieces]), to the
    unit's accumulator. With NVMe offload the accumulator is in the swap file: read
    (after the window's first micro-step), added to, and written back
    asynchronously, at most `pipeline_depth` writes in flight. At the window's last
    micro-step its norm and finiteness are taken before it leaves memory, carried
    from piece to piece (`stats(buffer, into)`)."""
    numel = value.numel()
    if not file.grad_on_disk(rt.index):
        rt.grad[at : at + numel].add_(value)
        return
    writes = file.grad_writes
    if writes.failure:
        return  # this window is dropped at the end of backward
    if at == 0 and not rt.grad_on_disk:
        writes.fresh.add(rt.index)  # the window's first micro-step: nothing to read
    fits = swap_buffer_numel(numel) <= file.grad_pool.numel  # a bf16 read: packed
    pool = file.grad_pool if fits else file.pool
    pooled = pool.take()
    buffer, offset = pooled[:numel], file.grad_dtype.itemsize * at
    region = file.grad_region(rt)
    try:
        if rt.index not in writes.fresh:
            narrow = file.narrow_grads
            target = packed(pooled, numel) if narrow else buffer
            ticket = file.nvme.submit(region, target, write=False, offset=offset)
            file.nvme.wait(ticket, "reading")
            if narrow:
                widen_packed(pooled, numel)
            buffer.add_(value.to(buffer.device))
        else:  # value + 0: the same arithmetic as a zeroed in-memory accumulator
            torch.add(value.to(buffer.device), 0.0, out=buffer)
        if file.narrow_grads:  # to nearest, as a bf16 accumulator's `add_` rounds
            buffer = narrow_in_place(pooled, numel, None)
        if at_boundary:
            rt.grad_stats = stats(buffer, rt.grad_stats if at else None)
        ticket = file.nvme.submit(region, buffer, write=True, offset=offset)
        writes.pending.append((ticket, pooled, pool))
        if at + numel == file.plan.grads_size(rt.unit, file.rank):  # the last piece
            writes.fresh.discard(rt.index)
            rt.grad_on_disk = True
        while len(writes.pending) > file.write_buffers:
            _wait_grad_write(file)
    except OSError as error:
        writes.failure = str(error)
        file.drain([writes.pending])


def _wait_grad_write(file: GradFile) -> None:
    """Wait for the oldest gradient write; its buffer goes back to the pool."""
    ticket, pooled, pool = file.grad_writes.pending.pop(0)
    file.nvme.wait(ticket, "writing")
    pool.give(pooled)


def finish_grad_writes(file: GradFile, units: Sequence[UnitRuntime], world_size: int) -> list[str]:
    """End of backward with gradients on NVMe: wait for the writes, then every rank
    learns whether any rank's gradient I/O failed. If one did, all drop the window
    (its gradients are partly written): the caller raises, its micro-steps are to be
    run again, and training goes on as if they had not happened."""
    writes = file.grad_writes
    try:
        while writes.pending:
            _wait_grad_write(file)
    except OSError as error:
        writes.failure = writes.failure or str(error)
        file.drain([writes.pending])
    if file.grad_pool is not file.pool:
        file.grad_pool.trim(0)  # piece-sized: taken afresh by the next backward
    messages = file.failures(writes.failure, world_size)
    writes.failure = ""
    writes.fresh.clear()
    if messages:
        for rt in units:
            rt.grad_on_disk, rt.grad_stats = False, None
    return messages


def write_grad(file: GradFile, rt: UnitRuntime) -> None:
    """Write the gradient bound to `rt` to its region (from an aligned copy when it
    is not in a swap buffer); it is this window's accumulator from now on."""
    grad = rt.grad
    if grad.data_ptr() % _nvme.ALIGN or grad.dtype != file.grad_dtype:
        grad = _nvme.aligned_empty(grad.numel(), file.grad_dtype).copy_(grad)
    file.nvme.wait(file.nvme.submit(file.grad_region(rt), grad, write=True), "writing")
    rt.grad_on_disk = True
