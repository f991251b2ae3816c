"""Averaging gradients over ranks, one bucket at a time, for both doors.

A bucket (`fzero.partition.reduction_buckets`: consecutive units from the last one back,
up to `reduce_bucket_size` elements) is reduced by one collective as soon as all its
units' gradients are in, overlapping the rest of backward; buckets are launched in bucket
order, the same on every rank. Stages 2-3 keep only this rank's part of each unit.
Gloo's reduce-scatter measured slower than its all-reduce at every size from 1 MB to
32 MB (2 ranks), so on gloo a bucket is all-reduced and each rank keeps its part; other
backends reduce-scatter each unit. Averages are elementwise, so a bucket gives each
element exactly what one collective per unit gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm
from fzero.core.quantize import quantized_reduce_scatter

__all__ = ["Pending", "finish", "reduce_bucket", "scatter_by_all_reduce"]

Pending = list[tuple[Any, Callable[[], None]]]  # (collective in flight or None, then run)


def scatter_by_all_reduce() -> bool:
    """Whether a reduce-scatter is done as an all-reduce here (gloo: see above)."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def reduce_bucket(
    buffer: Tensor,
    flats: Sequence[Tensor],
    owned: Sequence[slice],
    keep: Callable[[int, Tensor], None],
    *,
    world_size: int,
    quantized: bool = False,
) -> Pending:
    """Start averaging one bucket's full-size unit gradients (`flats`, views of `buffer`
    in order) over ranks; `keep(i, part)` then receives unit i's averaged part `owned[i]`
    on this rank. `quantized` (qgZ, stages 2-3: each rank owns a shard): one all-to-all
    of int8 blocks instead (`fzero.core.quantize`). Returns what is in flight, in order,
    for `finish`."""

    def keep_all() -> None:
        for i, flat in enumerate(flats):
            keep(i, flat[owned[i]])

    if world_size == 1:
        return [(None, keep_all)]
    if quantized:
        return _quantized(flats, owned, keep, world_size)
    if scatter_by_all_reduce():
        return [(comm.all_reduce(buffer, op="avg", async_op=True), keep_all)]
    pending: Pending = []
    for i, flat in enumerate(flats):
        part = owned[i]
        shard = torch.empty(part.stop - part.start, dtype=flat.dtype, device=flat.device)
        work = comm.reduce_scatter_into(shard, flat, async_op=True)
        pending.append((work, functools.partial(keep, i, shard)))
    return pending


def _quantized(
    flats: Sequence[Tensor],
    owned: Sequence[slice],
    keep: Callable[[int, Tensor], None],
    world_size: int,
) -> Pending:
    """qgZ over one bucket: rank r's part is every unit's `owned` shard of rank r, in
    unit order (the shards have one size on every rank)."""
    sizes = [part.stop - part.start for part in owned]
    parts = torch.cat([flat.view(world_size, size) for flat, size in zip(flats, sizes)], dim=1)

    def keep_parts(mine: Tensor) -> None:
        for i, piece in enumerate(mine.split(sizes)):
            keep(i, piece)

    return quantized_reduce_scatter(parts, keep_parts, world=world_size)


def finish(pending: Pending) -> None:
    """Wait for each collective in order and run what follows it; empties `pending`."""
    for work, then in pending:
        if work is not None:
            work.wait()
        then()
    pending.clear()
