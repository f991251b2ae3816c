"""The process groups a plan runs on.

A plan without a mesh runs on every process: its rank is the process's, its collectives
use the default group. A plan on a mesh (`fzero.partition.OnMesh`, as
`fzero.partition.mesh_plan` makes it) runs its gathers and reductions within
the group along its `shard` axes, where the process's rank in the plan is its index;
the processes along the other axes hold the same shards, and each reduced gradient shard
is averaged over them by one all-reduce (MiCS/HSDP). With hpZ's `secondary` axes,
backward gathers parameters within that smaller group. With an optimizer split finer
than the gradients (`OnMesh.optimizer_extra`) the plan's ranks are the optimizer's
shards: gradients and parameters move within the `grads` group (the shard axes before
the extra ones), and the boundary's reduce-scatter and the first publishing gather run
within the `optimizer` group (the extra axes). Control collectives (the
overflow flag, join's flag, checkpoint agreement) stay on every process.

`gather_unit` is a unit's all-gather in the plan's group, also for uneven shards
(`Unit.bounds`: padded to the largest on the wire, never in memory). That every rank
gathers the same unit is checked where every collective is (`fzero._order_check`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.partition import Mesh, Plan, Unit

__all__ = [
    "Groups",
    "UnitComm",
    "check_even",
    "check_finer",
    "check_same_plan",
    "exchange_block",
    "gather_optimizer_shards",
    "gather_unit",
    "groups_of",
    "secondary_block",
    "unit_group",
]


class Groups(NamedTuple):
    """`shard`: the group the plan's ranks form (None: every process); `replicate`: the
    processes holding this one's shards (None: no replicas); `secondary`: hpZ's group
    (None: none); `rank`: this process's rank in the plan; `secondary_rank`: its index
    in `secondary`; `replica`: its index along the replicate axes (0 writes checkpoints);
    `hops`: where the gradients' group spans two or more mesh axes, each axis's group and
    size in mesh order (qgZ's hierarchical reduction runs one hop per axis); `grads`:
    the group gradients and stage 3's parameters are split over (`shard`'s, but with
    `OnMesh.optimizer_extra`); `optimizer`: the group along those extra axes (None:
    none); `exchange`: where the optimizer's shards are in another order than the
    gradients' blocks (`OnMesh.permuted`), the processes (global ranks) this one sends
    its reduced block to and receives its optimizer shard's from, within `shard` (None:
    no exchange; the publish runs it the other way); `own`: each set of axes some unit
    splits over on its own (`Unit.shard_axes`), with its `UnitComm` (`unit_group`)."""

    shard: Any = None
    replicate: Any = None
    secondary: Any = None
    rank: int = 0
    secondary_rank: int = 0
    replica: int = 0
    hops: tuple[tuple[Any, int], ...] = ()
    grads: Any = None
    optimizer: Any = None
    exchange: tuple[int, int] | None = None
    own: Mapping[tuple[str, ...], UnitComm] = MappingProxyType({})


class UnitComm(NamedTuple):
    """Where one unit's gradients are reduced and its parameters gathered: `group` (None:
    every process), its `world` size, this process's `rank` in it (the shard it holds),
    `replicate`, the processes holding the same shard (None: none), over which each
    reduced shard is averaged, and `hops`: where `group` spans two or more mesh axes,
    each axis's group and size in mesh order (qgZ reduces one axis at a time)."""

    group: Any
    world: int
    rank: int
    replicate: Any
    hops: tuple[tuple[Any, int], ...] = ()


def unit_group(plan: Plan, groups: Groups, unit: Unit, rank: int) -> UnitComm:
    """`unit`'s group (`UnitComm`) for plan rank `rank`: the plan's gradients' group, or
    for a unit on its own axes (`Unit.shard_axes`) the group along them, its replicas
    along the plan's other axes."""
    if unit.shard_axes is None:
        return UnitComm(
            groups.grads,
            plan.grads_world_size,
            plan.grads_rank(rank),
            groups.replicate,
            groups.hops,
        )
    return groups.own[unit.shard_axes]


def groups_of(plan: Plan) -> Groups:
    """This process's groups for `plan` (collective the first time a mesh is seen: every
    process must call it at the same point, as `init` and the engine do)."""
    on = plan.mesh
    process = comm.get_rank()
    if on is None:
        return Groups(rank=process)
    mesh = Mesh(on.axes)
    replicate = on.replicate
    axes = [axis for axis in on.grads_shard if mesh.axis_size(axis) > 1]
    hops = tuple((comm.mesh_group(on.axes, (a,)), mesh.axis_size(a)) for a in axes)
    shard = comm.mesh_group(on.axes, on.shard)
    extra = on.optimizer_extra
    return Groups(
        shard=shard,
        replicate=comm.mesh_group(on.axes, replicate) if plan.replicas > 1 else None,
        secondary=comm.mesh_group(on.axes, on.secondary) if on.secondary else None,
        rank=mesh.index_in_group(process, on.shard),
        secondary_rank=mesh.index_in_group(process, on.secondary),
        replica=mesh.index_in_group(process, replicate),
        hops=hops if len(hops) > 1 else (),
        grads=comm.mesh_group(on.axes, on.grads_shard) if extra else shard,
        optimizer=comm.mesh_group(on.axes, extra) if extra else None,
        exchange=_exchange(mesh, process, on) if on.permuted else None,
        own=_own_groups(plan, mesh, process),
    )


def _own_groups(plan: Plan, mesh: Mesh, process: int) -> Mapping[tuple[str, ...], UnitComm]:
    """The `UnitComm` of each set of axes some unit splits over on its own, in unit
    order (collective on first use: every process makes them in that order)."""
    on = plan.mesh
    assert on is not None
    found: dict[tuple[str, ...], UnitComm] = {}
    for unit in plan.units:
        axes = unit.shard_axes
        if axes is None or axes in found:
            continue
        rest = tuple(a for a in on.shard if a not in axes) + on.replicate
        rest = tuple(a for a in mesh.names if a in rest)  # in mesh order
        moving = [a for a in axes if mesh.axis_size(a) > 1]
        hops = tuple((comm.mesh_group(on.axes, (a,)), mesh.axis_size(a)) for a in moving)
        found[axes] = UnitComm(
            comm.mesh_group(on.axes, axes),
            mesh.group_size(axes),
            mesh.index_in_group(process, axes),
            comm.mesh_group(on.axes, rest),
            hops if len(hops) > 1 else (),
        )
    return MappingProxyType(found)


def _exchange(mesh: Mesh, process: int, on: partition.OnMesh) -> tuple[int, int]:
    """Where process `process` sends the block the boundary leaves it (the process whose
    plan rank is its index in gradient order) and whence its optimizer shard's block
    comes (the process whose index in gradient order is its plan rank)."""
    by_plan, by_gradients = mesh.group(process, on.shard), mesh.group(process, on.gradient_order)
    plan_rank = mesh.index_in_group(process, on.shard)
    return by_plan[mesh.index_in_group(process, on.gradient_order)], by_gradients[plan_rank]


def exchange_block(block: Tensor, groups: Groups, back: bool = False, *, what: str = "") -> Tensor:
    """The block this process holds after the optimizer blocks' exchange
    (`Groups.exchange`; `block` itself when there is none): at the boundary the reduced
    gradient block goes to its optimizer shard's process, and with `back` an updated
    optimizer shard returns to the process whose block in gradient order it is.
    Collective over the `shard` group."""
    if groups.exchange is None:
        return block
    to, source = groups.exchange[::-1] if back else groups.exchange
    out = torch.empty_like(block)
    comm.exchange_into(out, block.contiguous(), to, source, what=what, group=groups.shard)
    return out


def secondary_block(groups: Groups, full: Tensor) -> Tensor | None:
    """ZeRO++ hpZ: a copy of this process's block of a unit forward gathered (`full`),
    split within its secondary group, which backward gathers from (Wang et al. 2023);
    None when there is no secondary group or no backward follows (no gradients)."""
    if groups.secondary is None or not torch.is_grad_enabled():
        return None
    size = full.numel() // comm.get_world_size(groups.secondary)
    start = groups.secondary_rank * size
    return full[start : start + size].clone()


def gather_unit(
    full: Tensor,
    shard: Tensor,
    unit: Unit,
    world_size: int,
    *,
    group: Any = None,
    what: str = "",
    async_op: bool = True,
) -> Any:
    """All-gather every rank's part of `unit` (`shard`, this rank's) into `full` over
    `group` (its `world_size` ranks); the work in flight (`wait()`), or None when not
    `async_op`. Uneven shards travel at their exact sizes: each rank's part broadcast
    from it (one broadcast per rank that owns elements: a unit whole on one rank is one
    broadcast of its bytes)."""
    if not unit.bounds:
        return comm.all_gather_into(full, shard, async_op=async_op, what=what, group=group)
    start, stop = unit.shard_range(comm.get_rank(group))
    full[start:stop].copy_(shard)
    works = []
    for owner in range(world_size):
        start, stop = unit.shard_range(owner)
        if stop > start:
            part = full[start:stop]
            works.append(comm.broadcast_from(part, owner, async_op=True, what=what, group=group))
    done = comm.Works(works)
    if async_op:
        return done
    done.wait()
    return None


def gather_optimizer_shards(
    full: Tensor,
    shard: Tensor,
    plan: Plan,
    index: int,
    groups: Groups,
    *,
    what: str = "",
    async_op: bool = True,
) -> Any:
    """All-gather unit `index`'s optimizer shards (`shard`, this rank's: its master, or
    what an update made of it) into the whole buffer `full` (`gather_unit` over the plan's
    group). With an optimizer split finer than the gradients
    (`Plan.optimizer_extra_size` > 1) the plan's ranks are not in process order, so in two
    hops: over the `optimizer` group into the gradient shard, then over the `grads` group
    into `full`. The work in flight, or None
    when not `async_op`."""
    unit = plan.units[index]
    if unit.shard_axes is not None:  # on its own axes: within their group
        own = unit_group(plan, groups, unit, groups.rank)
        return gather_unit(
            full, shard, unit, own.world, group=own.group, what=what, async_op=async_op
        )
    if plan.optimizer_extra_size == 1:
        return gather_unit(
            full, shard, unit, plan.world_size, group=groups.shard, what=what, async_op=async_op
        )
    held = gather_to_grads_shard(shard, plan, groups, what=what)
    work = comm.all_gather_into(full, held, async_op=async_op, what=what, group=groups.grads)
    return comm.Works([work], keep=held) if async_op else None


def gather_to_grads_shard(shard: Tensor, plan: Plan, groups: Groups, *, what: str = "") -> Tensor:
    """This rank's gradient shard (`Plan.grads_range`: stage 3's parameter shard) of a
    unit from the optimizer shards within it (`shard`, this rank's: exchanged first for
    the one in this rank's gradient shard where their orders differ), gathered over the
    `optimizer` group (`Plan.optimizer_extra_size` > 1; collective)."""
    shard = exchange_block(shard, groups, back=True, what=what)
    numel = shard.numel() * plan.optimizer_extra_size
    held = torch.empty(numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into(held, shard, what=what, group=groups.optimizer)
    return held


def check_even(plan: Plan, quantized: bool, key: str) -> None:
    """Quantized collectives send equal blocks per rank: refuse a plan with uneven
    shards (`Unit.bounds`), naming the unit and the key."""
    uneven = next((u.name for u in plan.units if u.bounds), None)
    if quantized and uneven is not None and plan.world_size > 1:
        raise ValueError(
            f"zero_optimization.{key.split()[0]} is true but unit {uneven!r} of the plan "
            f"({plan.strategy}) has uneven shards; quantized collectives need equal shards: "
            "turn it off or use an even strategy (flat_even, per_tensor_dim0)"
        )


def check_finer(plan: Plan, quantized: bool, key: str) -> None:
    """Quantized collectives are not run where the optimizer is split finer than the
    gradients (`Plan.optimizer_extra_size`): refuse naming the key and the plan's axes."""
    if quantized and plan.optimizer_extra_size > 1:
        assert plan.mesh is not None
        raise ValueError(
            f"zero_optimization.{key.split()[0]} is true but the plan's optimizer state is "
            f"split over {plan.mesh.shard}, finer than its gradients "
            f"({plan.mesh.grads_shard}); quantized collectives are not run with such a "
            "split yet: turn it off, or split the optimizer as the gradients"
        )


def check_same_plan(plan: Plan, where: str) -> None:
    """Raise `comm.RankDisagreement` on every rank unless every process holds a plan equal
    to `plan` (collective, through the process group's store: no collective a rank with
    another plan could pair wrongly). Whoever builds a plan for a run calls it before
    building any state: a strategy whose result depends on the rank (a timing, a profile,
    a random draw) would otherwise train silently wrong, its padded collectives having
    equal sizes. The error names the first part that differs (the header, the manifest or
    a unit), its first differing field and each rank's value of it."""
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return
    ranks = list(range(comm.get_world_size()))
    digests = comm.agree(f"the plan of {where}", partition.plan_digest(plan), ranks)
    if len(set(digests.values())) == 1:
        return
    parts = partition.plan_parts(plan)
    every = comm.agree(f"the plan's parts in {where}", json.dumps([list(p) for p in parts]), ranks)
    by_rank = {r: [tuple(p) for p in json.loads(text)] for r, text in every.items()}
    index = _first_difference(list(by_rank.values()))
    fields = comm.agree(
        f"part {index} of the plan in {where}",
        json.dumps(partition.part_fields(plan, index)),
        ranks,
    )
    values = {r: json.loads(text) for r, text in fields.items()}
    names = {r: by_rank[r][index][0] if index < len(by_rank[r]) else "(none)" for r in ranks}
    keys = list(dict.fromkeys(k for v in values.values() for k in v))
    field = next((k for k in keys if len({v.get(k, "(absent)") for v in values.values()}) > 1), "")
    shown = "; ".join(
        f"rank {r}: {values[r].get(field, '(absent)') if field else names[r]}" for r in ranks
    )
    groups: dict[str, list[int]] = {}
    for r, digest in digests.items():
        groups.setdefault(digest, []).append(r)
    raise comm.RankDisagreement(
        f"fzero {where}: the ranks hold different plans (plan digests: "
        + ", ".join(f"ranks {rs} {d[:12]}" for d, rs in groups.items())
        + f"); the first difference is in {names[ranks[0]]}"
        + (f", field {field!r}" if field else "")
        + f": {shown}. Every rank must run the same plan: a strategy must return the same "
        "value on every rank (decide from what every rank sees, or compute the decision on "
        "one rank and broadcast it, e.g. torch.distributed.broadcast_object_list, before "
        "building the plan)"
    )


def _first_difference(parts: list[list[tuple[str, str]]]) -> int:
    """The index of the first part whose digest differs between the ranks' lists."""
    longest = max(len(p) for p in parts)
    for index in range(longest):
        if len({p[index][1] if index < len(p) else "" for p in parts}) > 1:
            return index
    return longest
