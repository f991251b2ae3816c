"""One bucket's reduction: the collectives that average a bucket of unit gradients over
ranks and hand each rank its part (`reduce_bucket`), for `fzero.core.reduce.Reduction`.

Gloo's reduce-scatter measured slower than its all-reduce at every size from 1 MB to 32
MB (2 ranks), so on gloo a bucket is all-reduced and each rank keeps its part; other
backends reduce-scatter each unit. Uneven units travel to their owners at their exact
sizes, qgZ's quantized buckets as int8/int4 blocks (`fzero.core.quantize`), and a plan
on a mesh averages each reduced part over its replicas after its group.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm
from fzero.core.quantize import quantized_reduce_scatter

__all__ = ["Pending", "finish", "nothing", "reduce_bucket", "scatter_by_all_reduce"]

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
    what: str = "",
    bits: int = 8,
    group: Any = None,
    replicas: Any = None,
    hops: Sequence[tuple[Any, int]] = (),
    bounds: Sequence[tuple[int, ...]] = (),
    wire_dtype: torch.dtype = torch.float32,
) -> Pending:
    """Start averaging one bucket's full-size unit gradients (`flats`, views of `buffer`
    in order) over ranks; `keep(i, part)` then receives unit i's averaged part `owned[i]`
    on this rank. `quantized` (qgZ, stages 2-3: each rank owns a shard): one all-to-all
    of int8 (`bits` 8) or int4 (`bits` 4) blocks instead (`fzero.core.quantize`). `what`
    names the bucket in errors. `group`: the ranks of the plan (None: every process);
    `replicas`: the processes holding the same shards, over which each part is then
    averaged (None: none); `hops`: with `quantized`, the shard group's axes (group, size),
    reduced one axis at a time; `bounds`: each unit's uneven shard bounds (`Unit.bounds`,
    () for an even unit), whose parts are each reduced to their owner at their exact
    size; `wire_dtype` (DeepSpeed's `communication_data_type`): the dtype the gradients
    travel in, cast from fp32 before each collective and back after (the sum rounded to
    it). Returns what is in flight, in order, for `finish`."""
    if wire_dtype != buffer.dtype and not quantized and world_size > 1:
        return _on_the_wire(
            buffer, flats, owned, keep, wire_dtype, world_size, what, group, replicas, bounds
        )
    if replicas is not None:
        keep = functools.partial(_keep_replicated, keep, replicas, what)

    def keep_all() -> None:
        for i, flat in enumerate(flats):
            keep(i, flat[owned[i]])

    if world_size == 1:
        return [(None, keep_all)]
    if quantized:
        return _quantized(flats, owned, keep, world_size, bits, group, hops)
    if any(bounds):
        return _by_unit(flats, owned, keep, bounds, world_size, what, group)
    if scatter_by_all_reduce():
        work = comm.all_reduce(buffer, op="avg", async_op=True, what=what, group=group)
        return [(work, keep_all)]
    pending: Pending = []
    for i, flat in enumerate(flats):
        part = owned[i]
        uneven = flat.numel() != world_size * (part.stop - part.start)
        pending.append(_one_unit(keep, i, flat, part, what, group, by_all_reduce=uneven))
    return pending


def _one_unit(
    keep: Callable[[int, Tensor], None],
    i: int,
    flat: Tensor,
    part: slice,
    what: str,
    group: Any,
    by_all_reduce: bool,
) -> tuple[Any, Callable[[], None]]:
    """Unit i's gradient `flat` averaged, its `part` then kept: all-reduced (gloo, or
    shards of unequal sizes) or reduce-scattered."""
    if by_all_reduce:
        work = comm.all_reduce(flat, op="avg", async_op=True, what=what, group=group)
        return work, functools.partial(keep, i, flat[part])
    shard = torch.empty(part.stop - part.start, dtype=flat.dtype, device=flat.device)
    work = comm.reduce_scatter_into(shard, flat, async_op=True, what=what, group=group)
    return work, functools.partial(keep, i, shard)


def _on_the_wire(
    buffer: Tensor,
    flats: Sequence[Tensor],
    owned: Sequence[slice],
    keep: Callable[[int, Tensor], None],
    wire_dtype: torch.dtype,
    world_size: int,
    what: str,
    group: Any,
    replicas: Any,
    bounds: Sequence[tuple[int, ...]],
) -> Pending:
    """`reduce_bucket` in `wire_dtype`: the bucket cast once, reduced as an fp32 bucket
    is, and each kept part cast back to fp32 (the collectives in the wire dtype)."""
    wire = buffer.to(wire_dtype)
    views, offset = [], 0
    for flat in flats:
        views.append(wire[offset : offset + flat.numel()])
        offset += flat.numel()

    def keep_fp32(i: int, part: Tensor) -> None:
        keep(i, part.to(buffer.dtype))

    return reduce_bucket(
        wire,
        views,
        owned,
        keep_fp32,
        world_size=world_size,
        what=what,
        group=group,
        replicas=replicas,
        bounds=bounds,
        wire_dtype=wire_dtype,
    )


def _by_unit(
    flats: Sequence[Tensor],
    owned: Sequence[slice],
    keep: Callable[[int, Tensor], None],
    bounds: Sequence[tuple[int, ...]],
    world_size: int,
    what: str,
    group: Any,
) -> Pending:
    """A bucket with uneven units, unit by unit: each owned part of an uneven unit summed
    to its owner (a reduce of its exact size: one rank's whole tensors cost their bytes
    once, not an all-reduce of the unit) and averaged there; an even unit as a bucket's
    (all-reduced on gloo, else reduce-scattered)."""
    pending: Pending = []
    for i, (flat, part) in enumerate(zip(flats, owned)):
        if not bounds[i]:
            gloo = scatter_by_all_reduce()
            pending.append(_one_unit(keep, i, flat, part, what, group, by_all_reduce=gloo))
            continue
        for owner, (start, stop) in enumerate(itertools.pairwise(bounds[i])):
            if stop > start:
                work = comm.reduce_to(
                    flat[start:stop], owner, async_op=True, what=what, group=group
                )
                pending.append((work, nothing))
        mine = flat[part]
        pending.append((None, functools.partial(_keep_averaged, keep, i, mine, world_size)))
    return pending


def _keep_averaged(
    keep: Callable[[int, Tensor], None], i: int, part: Tensor, world_size: int
) -> None:
    keep(i, part.div_(world_size))


def _keep_replicated(
    keep: Callable[[int, Tensor], None], replicas: Any, what: str, i: int, part: Tensor
) -> None:
    """Average a reduced part over the replicas holding it, then keep it."""
    comm.all_reduce(part, op="avg", group=replicas, what=f"{what} across replicas")
    keep(i, part)


def _quantized(
    flats: Sequence[Tensor],
    owned: Sequence[slice],
    keep: Callable[[int, Tensor], None],
    world_size: int,
    bits: int,
    group: Any,
    hops: Sequence[tuple[Any, int]] = (),
) -> Pending:
    """qgZ over one bucket: rank r's part is every unit's `owned` shard of rank r, in
    unit order (the shards have one size on every rank). With `hops`, hierarchically."""
    sizes = [part.stop - part.start for part in owned]
    parts = torch.cat([flat.view(world_size, size) for flat, size in zip(flats, sizes)], dim=1)

    def keep_parts(mine: Tensor) -> None:
        for i, piece in enumerate(mine.split(sizes)):
            keep(i, piece)

    if hops:
        return _hierarchical(parts, list(hops), bits, keep_parts)
    return quantized_reduce_scatter(parts, keep_parts, world=world_size, bits=bits, group=group)


def _hierarchical(
    parts: Tensor, hops: list[tuple[Any, int]], bits: int, keep: Callable[[Tensor], None]
) -> Pending:
    """ZeRO++'s hierarchical qgZ (Wang et al. 2023, section 4.2): the quantized
    reduce-scatter one mesh axis at a time, the innermost (in the node) first, so what
    crosses the outer axis is already summed over the inner one. `parts` is the world's
    rows (row b for the rank whose index along the shard axes is b); each hop sends each
    peer along its axis the rows of the ranks sharing that peer's coordinate, then
    averages what it receives (fp32 sums at the owner, as the one-hop reduction)."""
    sizes = [size for _, size in hops]

    def hop(current: Tensor, level: int) -> Pending:
        group, size = hops[level]
        rows = current.view(*sizes[:level], size, -1).movedim(level, 0).reshape(size, -1)

        def after(mine: Tensor) -> None:
            if level == 0:
                keep(mine)
            else:
                finish(hop(mine, level - 1))

        return quantized_reduce_scatter(rows, after, world=size, bits=bits, group=group)

    return hop(parts, len(hops) - 1)


def finish(pending: Pending) -> None:
    """Wait for each collective in order and run what follows it; empties `pending`."""
    for work, then in pending:
        if work is not None:
            work.wait()
        then()
    pending.clear()


def nothing() -> None:
    """What follows a collective whose result is used in place."""
    return None
