"""Checkpoints of a swap file's units in sub-group pieces ([Note: checkpoints in
pieces]): reading one kind of a unit a piece at a time (a save, publishing a loaded
master) and writing a loaded unit to its next slot a piece at a time (a load), for
`fzero.core.swap_units`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fzero.core import nvme as _nvme
from fzero.core.layout import UnitRuntime
from fzero.core.residency import Piece, Residency
from fzero.core.state import PieceSource
from fzero.core.swap_buffers import narrow_in_place

__all__ = ["GRAD", "PieceReader", "master_copy", "store_in_pieces"]

GRAD = "grad"  # the gradient accumulator's kind name (the others: `Residency.kinds`)

# [Note: checkpoints in pieces]
#
# With sub-groups ([Note: sub-groups] in `fzero.core.residency`) a checkpoint moves a
# unit in the swap file as the step does: `Residency.sub_group` elements at a time, at
# their offsets in the unit's regions (4 KiB-aligned: O_DIRECT), through buffers of the
# step's pool, so no process holds a whole unit's partition of any kind.
#
# A save reads one kind at a time (`PieceReader`: one buffer, the piece last read
# kept) and cuts each of the rank file's entries of that kind (a slice of the unit's
# partition: `partition.local_slices`) from the pieces it overlaps; the writer takes
# an entry as consecutive parts, hashing and writing each as it comes, so the file is
# the whole-unit save's byte for byte. A bf16 moment is copied as the file stores it
# (the whole-unit read widens it to fp32 and the save narrows it back: exact), the
# gradient accumulator read at its offsets, or zeros when not written this window.
#
# A load fills each piece of the master and the moments (or initialises the moments
# over the master's piece) from the checkpoint's slices, read by byte range once their
# checksums have passed, and writes it to the next slot with `Residency.write_kind` at
# the piece's offset: a bf16 moment's piece is rounded from the seed the whole unit's
# write gives its first element (`seed += start * ROUNDING_STRIDE`), so the file holds the
# whole-unit load's bits. The loaded master reaches the parameters through a copy in
# the compute dtype filled piece by piece (`master_copy`), as the step's does.


class PieceReader:
    """One swapped unit's kinds ("master", the moments' names, `GRAD`) read piece by
    piece into one buffer of the step's pool, as stored (each kind in the file's dtype
    for it, fp32 or bf16; a gradient accumulator kept in memory is sliced as is);
    `close` gives it back."""

    def __init__(self, residency: Residency, rt: UnitRuntime) -> None:
        self.residency, self.rt = residency, rt
        self.buffer = residency.step_pool.take()
        self.held: tuple[str, int] | None = None  # (kind, start) of the piece in `buffer`
        self.piece = torch.empty(0)

    def numel(self, kind: str) -> int:
        """Elements of `kind` in the unit's regions: its partition, or its gradient."""
        residency, unit = self.residency, self.rt.unit
        if kind == GRAD:
            return residency.plan.grads_size(unit, residency.rank)
        return residency.partition_numel(unit)

    def span(self, kind: str, begin: int, end: int) -> Iterator[Tensor]:
        """Elements [begin, end) of `kind`, as consecutive views of the pieces they
        overlap (each valid until the next is asked for)."""
        if kind == GRAD and not self.residency.grad_on_disk(self.rt.index):
            yield self.rt.grad[begin:end]  # the accumulator in memory
            return
        if end <= begin:  # an empty slice (an empty partition): one empty part
            yield torch.empty(0, dtype=self._dtype(kind))
            return
        size = self.residency.sub_group
        for start in range(begin // size * size, end, size):
            piece = self._read(kind, start)
            yield piece[max(begin, start) - start : min(end, start + size) - start]

    def _read(self, kind: str, start: int) -> Tensor:
        if self.held == (kind, start):
            return self.piece
        residency, rt = self.residency, self.rt
        self.held = None
        numel = min(self.numel(kind), start + residency.sub_group) - start
        if kind == GRAD:
            target = self.buffer.view(residency.grad_dtype)[:numel]
            if not rt.grad_on_disk:  # nothing written this window: zeros
                self.piece, self.held = target.zero_(), (kind, start)
                return self.piece
            region, offset = residency.grad_region(rt), residency.grad_dtype.itemsize * start
        else:
            k = residency.kinds.index(kind)
            target = self.buffer.view(self._dtype(kind))[:numel]
            region, offset = residency.region(rt, k, rt.slot), start * residency.kind_bytes(k)
        residency.wait_swap(
            [(residency.nvme.submit(region, target, False, offset), target)], "reading"
        )
        self.piece, self.held = target, (kind, start)
        return target

    def _dtype(self, kind: str) -> torch.dtype:
        """The dtype `kind` is stored in, in the file."""
        if kind == GRAD:
            return self.residency.grad_dtype
        return self.residency.kind_dtype(self.residency.kinds.index(kind))

    def close(self) -> None:
        if self.buffer.numel():
            self.residency.step_pool.give(self.buffer)
            self.residency.step_pool.trim(0)
        self.buffer, self.piece, self.held = torch.empty(0), torch.empty(0), None


def master_copy(residency: Residency, rt: UnitRuntime, dtype: torch.dtype) -> Tensor:
    """The unit's current master in `dtype` (an aligned host buffer: written to NVMe
    parameters as is), filled piece by piece."""
    numel = residency.partition_numel(rt.unit)
    copy = _nvme.aligned_empty(numel, dtype)
    reader = PieceReader(residency, rt)
    try:
        at = 0
        for part in reader.span("master", 0, numel):
            copy[at : at + part.numel()].copy_(part)
            at += part.numel()
    finally:
        reader.close()
    return copy


def store_in_pieces(
    residency: Residency, rt: UnitRuntime, source: PieceSource, with_grad: bool
) -> None:
    """Write a loaded unit to the next slot of its regions piece by piece, from
    `source` (`fzero.core.state.PieceSource`); with `with_grad` the gradient
    accumulator too (when the file holds it). The unit is evicted after, failed or
    not."""
    buffers = residency.swap_buffers(0, residency.step_pool)
    slot, kinds = residency.next_slot(rt), residency.kinds
    try:
        residency.stored += 1
        numel = residency.partition_numel(rt.unit)
        for start in range(0, max(numel, 1), residency.sub_group):
            piece = Piece(rt, start, min(numel, start + residency.sub_group))
            master = buffers[0][: piece.stop - start]
            source.fill(kinds[0], start, master)
            fresh = source.init(master) if source.init is not None else None
            fields = {}
            for k, name in enumerate(kinds[1:], start=1):
                out = buffers[k][: master.numel()]
                if fresh is None:
                    source.fill(name, start, out)
                else:
                    out.copy_(getattr(fresh, name))
                fields[name] = out
            rt.master, rt.state = master, source.optim._replace(**fields)
            residency.wait_swap(residency.swap_out_piece(piece, slot, buffers), "writing")
        if with_grad and residency.grads_on_disk:
            _store_grad(residency, rt, source.fill, buffers[len(kinds)])
    finally:
        residency.evict(rt)
        residency.give_back(buffers, residency.step_pool)
        residency.step_pool.trim(0)


def _store_grad(
    residency: Residency, rt: UnitRuntime, fill: Callable[[str, int, Tensor], None], buffer: Tensor
) -> None:
    """The loaded gradient accumulator to its region, piece by piece: this window's
    accumulator from now on."""
    numel = residency.plan.grads_size(rt.unit, residency.rank)
    region = residency.grad_region(rt)
    for start in range(0, numel, residency.sub_group):
        out = buffer[: min(numel, start + residency.sub_group) - start]
        fill(GRAD, start, out)
        if residency.narrow_grads:  # to nearest, as an in-memory accumulator's load
            out = narrow_in_place(buffer, out.numel(), None)
        ticket = residency.nvme.submit(region, out, True, residency.grad_dtype.itemsize * start)
        residency.wait_swap([(ticket, out)], "writing")
    rt.grad_on_disk = True
