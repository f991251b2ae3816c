"""Communication volume of a plan: which collectives one optimizer step issues, how many,
and how many bytes they move — a pure function of the plan and the run's settings, for
comparing plans before running them (and checked against what a run sends:
`fzero.comm.traffic`, `tests/test_comm_volume.py`).

A collective's `bytes` is its whole buffer (an all-gather's output, a reduce-scatter's
input, an all-reduce's tensor). What one rank puts on the wire with ring algorithms is
`wire_bytes`: (W-1)/W of that for an all-gather or reduce-scatter, twice it for an
all-reduce.

On a mesh (a plan `mesh_plan` made, said per kind: `KindPlan`) every row also names the
`axes` it runs over, and its `world_size` is the size of that group: HSDP/MiCS
reduce-scatters gradients over the shard axes and all-reduces the shard over the replica
axes every micro-step (as FSDP2's HSDP; DeepSpeed's MiCS waits for the accumulation
boundary); hpZ gathers parameters over the world for forward and over the node for
backward. `volume_by_axes` sums them per axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fzero.partition._manifest import dtype_of
from fzero.partition._mesh_comm import _gradients_group, optimizer_exchange, publish_hops
from fzero.partition._mesh_groups import _finer
from fzero.partition._mesh_plan import KindPlan, as_kind_plan, without_unit_axes
from fzero.partition._plan import Plan, PlanError, Unit
from fzero.partition._queries import grads_split, reduction_buckets, spans_parts

__all__ = ["Collective", "comm_volume", "format_comm_volume", "volume_by_axes"]

_GRAD_BYTES = 4  # gradients are reduced in fp32 unless a wire dtype is given


@dataclass(frozen=True)
class Collective:
    """One kind of collective a step issues over all ranks of the plan: `operation`
    (`all_reduce`, `reduce_scatter`, `all_gather`), `what` it moves, its `calls` and
    `bytes` per optimizer step."""

    operation: str
    what: str
    calls: int
    bytes: int
    world_size: int
    axes: tuple[str, ...] = ()
    """The mesh axes the collective runs over (plans on a mesh); () for a stage plan's
    world."""
    exchange: bool = False
    """An all-to-all that is a permutation: each rank's whole buffer goes to one rank
    (the optimizer blocks' exchange, `optimizer_exchange`)."""

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends per step with ring algorithms (a broadcast or a reduce:
        every rank but one passes the bytes on once, on average (W-1)/W of them); an
        `exchange` sends its whole buffer (a rank that keeps its own block, none)."""
        if self.exchange:
            return self.bytes
        share = self.bytes * (self.world_size - 1) // self.world_size
        return 2 * share if self.operation == "all_reduce" else share


_QUANT_BLOCK = 256  # elements per fp32 scale of a quantized collective (fzero.core.quantize)


def comm_volume(
    plan: Plan,
    *,
    accumulation_steps: int = 1,
    param_dtype: str = "float32",
    bucket_numel: int = 500_000_000,
    scatter_as_all_reduce: bool = False,
    regathered: Iterable[int] = (),
    loss_scaling: bool = False,
    optimizer: str = "adam",
    tensor_norms: bool | None = None,
    quantized_weights: bool = False,
    quantized_gradients: bool = False,
    quantized_gradient_bits: int = 8,
    grad_wire_dtype: str = "float32",
    whole_tensors: Iterable[str] = (),
) -> list[Collective]:
    """The collectives one optimizer step of the engine issues under `plan`.

    - gradients: stage 0 all-reduces each bucket (`bucket_numel`, the config's
      `reduce_bucket_size`) once per step; stage 1 reduces each bucket into the ranks'
      shards once per step, stages 2-3 every micro-step: each even unit
      reduce-scattered, or each bucket all-reduced with `scatter_as_all_reduce` (what
      fzero does on gloo, where it measured faster), each uneven unit's owned parts
      reduced to their owners (ZeRO-1 sends the ZeRO paper's reduce-scatter and
      all-gather, as DeepSpeed's does, not an all-reduce and an all-gather);
    - parameters: stages 1-2 (and stage 3's persistent units) all-gather each unit
      after the update; stage 3 gathers each other unit once per micro-step in forward,
      and again in backward for the units in `regathered` (those released between, by
      `stage3_max_reuse_distance` or `stage3_max_live_parameters`; the engine's
      `comm_volume()` fills it from its recorded use order);
    - control: the global gradient norm (8 bytes), the fp16 overflow flag with dynamic
      `loss_scaling`, per-tensor norms (`tensor_norms`: an optimizer whose update needs
      them, `fzero.optim.TensorNorms`; by default `optimizer="lamb"`), and the engine's check
      for gradients left by other passes (4 bytes, per micro-step at stages 2-3, per step
      at 0-1).

    `quantized_weights` (qwZ, `zero_quantized_weights`): stage 3's forward and backward
    gathers travel as int8 codes in blocks of 256 plus one fp32 scale per block: two
    all-gathers per unit, 1.016 bytes per element. `quantized_gradients` (qgZ,
    stages 2-3): each bucket's reduction is two all-to-alls (codes and scales) of the
    bucket's blocks, every micro-step: int8 codes, or with `quantized_gradient_bits` 4
    (`zero_quantized_gradients_bits`) int4 codes two to a byte (0.516 bytes per element).

    `grad_wire_dtype` (DeepSpeed's `communication_data_type`): the dtype gradients travel
    in when reduced (fp32 by default; "bfloat16"/"float16": half the bytes).

    `whole_tensors`: the tensors (fqns) whose update is a function of the whole tensor
    (an optimizer declaring `fzero.optim.WholeTensors`, e.g. Muon's hidden matrices). A
    unit holding one, with its optimizer state split so that such a tensor spans two
    ranks' parts, gathers its fp32 directions whole once per step ("whole-tensor
    directions"), as its updated parameters are published (an all-gather, or a
    broadcast per owned part of an uneven unit; with an optimizer split finer than the
    gradients, in two hops after the exchange back where the orders differ); one whose
    every such tensor lies within one rank's part (`partition.whole_tensors`) gathers
    nothing.

    Each unit counts as its own stage (`Plan.stage_of`): a plan of ZeRO-1 embeddings and
    ZeRO-3 blocks reduces the embeddings' buckets into their shards once per step and
    the blocks' every micro-step.

    A world of 1 issues nothing. A step an fp16 overflow skips sends neither the norm
    nor new parameters.

    On a mesh, per unit and per axes (see `_mesh_volume`;
    qgZ over a shard group of several axes is hierarchical: one all-to-all pair per axis).
    """
    if accumulation_steps < 1:
        raise PlanError(f"accumulation_steps is {accumulation_steps}; it must be >= 1")
    if (quantized_weights or quantized_gradients) and any(u.bounds for u in plan.units):
        raise PlanError("quantized collectives need equal shards; the plan's are uneven")
    if quantized_gradient_bits not in (4, 8):
        raise PlanError(f"quantized_gradient_bits is {quantized_gradient_bits!r}; allowed: [4, 8]")
    grad_bytes = dtype_of(grad_wire_dtype).itemsize
    norms = optimizer == "lamb" if tensor_norms is None else tensor_norms
    taken = frozenset(whole_tensors)
    unknown = sorted(taken - {t.fqn for t in plan.manifest.tensors})
    if unknown:
        raise PlanError(
            f"whole_tensors names {unknown[0]!r}, which is not a tensor of the plan's manifest"
        )
    if plan.mesh is not None:
        said = as_kind_plan(plan)
        return _mesh_volume(
            without_unit_axes(said),
            steps=accumulation_steps,
            param_bytes=dtype_of(param_dtype).itemsize,
            bucket_numel=bucket_numel,
            regathered=sorted(set(regathered)),
            control=_control(said, loss_scaling, norms),
            scatter_as_all_reduce=scatter_as_all_reduce,
            quantized=(quantized_weights, quantized_gradients, quantized_gradient_bits),
            grad_bytes=grad_bytes,
            whole_tensors=taken,
        )
    world, stage, steps = plan.world_size, plan.stage, accumulation_steps
    if world == 1:
        return []
    param_bytes = dtype_of(param_dtype).itemsize
    units = plan.units
    rows: list[Collective] = []

    def add(operation: str, what: str, calls: int, size: int) -> None:
        if not calls:
            return
        for at, row in enumerate(rows):  # one row per operation and purpose
            if (row.operation, row.what) == (operation, what):
                rows[at] = dataclasses.replace(row, calls=row.calls + calls, bytes=row.bytes + size)
                return
        rows.append(Collective(operation, what, calls, size, world))

    every_bucket = reduction_buckets(plan, bucket_numel)
    whole_buckets = [b for b in every_bucket if not grads_split(plan, b[0])]
    buckets = [b for b in every_bucket if grads_split(plan, b[0])]
    zero1 = [b for b in whole_buckets if all(plan.stage_of(i) == 1 for i in b)]
    total = sum(units[i].numel for b in whole_buckets if b not in zero1 for i in b)
    add("all_reduce", "gradients", len(whole_buckets) - len(zero1), total * grad_bytes)
    # ZeRO-1 at the boundary: each whole gradient reduced into the shards, as stage 2's
    _add_split_reductions(plan, zero1, 1, scatter_as_all_reduce, add, grad_bytes)
    if buckets and quantized_gradients:
        # one row of blocks per rank: every unit's shard of that rank, concatenated
        per_rank = [sum(units[i].shard_numel for i in bucket) for bucket in buckets]
        block_bytes = _QUANT_BLOCK * quantized_gradient_bits // 8 + 4  # codes and a scale
        size = sum(-(-n // _QUANT_BLOCK) * world * block_bytes for n in per_rank)
        what = f"gradients (int{quantized_gradient_bits})"
        add("all_to_all", what, 2 * len(buckets) * steps, size * steps)
    elif buckets:
        _add_split_reductions(plan, buckets, steps, scatter_as_all_reduce, add, grad_bytes)
    sharded = [u for u in units if plan.stage_of(u) == 3]
    whole = [u for u in units if plan.stage_of(u) in (1, 2)]
    _add_gathers_of(whole, world, param_bytes, 1, "parameters after the update", add)
    directions = [
        u for u in units if plan.stage_of(u) >= 1 and spans_parts(u, taken, u.shard_numel)
    ]
    _add_gathers_of(directions, world, _DIRECTION_BYTES, 1, _DIRECTIONS, add)
    again = [units[i] for i in sorted(set(regathered))]
    if any(plan.stage_of(u) != 3 for u in again):
        raise PlanError("regathered names units stage 3 does not gather (persistent, or stage < 3)")
    for what, gathered in (("parameters for forward", sharded), ("parameters for backward", again)):
        if quantized_weights:
            blocks = [-(-u.shard_numel // _QUANT_BLOCK) * world for u in gathered]
            size = sum(b * (_QUANT_BLOCK + 4) for b in blocks) * steps
            add("all_gather", what + " (int8)", 2 * len(gathered) * steps, size)
        else:
            _add_gathers_of(gathered, world, param_bytes, steps, what, add)
    add("all_reduce", "gradient norm", 1, 8)
    if loss_scaling:
        add("all_reduce", "fp16 overflow flag", 1, 4)
    if norms and stage > 0:  # at stage 0 every rank's sums are whole already
        add("all_reduce", "LAMB tensor norms", 1, 2 * len(plan.manifest.tensors) * 8)
    checks = steps if stage >= 2 else 1  # per micro-step once any unit's are split
    add("all_reduce", "left-over gradients check", checks, 4 * checks)
    return rows


_DIRECTIONS = "whole-tensor directions"
_DIRECTION_BYTES = 4  # an update's directions are fp32


def _owners(unit: Unit) -> int:
    """Ranks holding elements of an uneven unit (one collective each)."""
    return sum(1 for start, stop in zip(unit.bounds, unit.bounds[1:]) if stop > start)


def _add_gathers_of(
    units: list[Unit],
    world: int,
    param_bytes: int,
    steps: int,
    what: str,
    add: Callable[[str, str, int, int], None],
) -> None:
    """Gathering `units` whole, `steps` times: an even unit by one all-gather of its
    padded buffer, an uneven one by a broadcast of each owned part (its exact bytes)."""
    even = [u for u in units if not u.bounds]
    uneven = [u for u in units if u.bounds]
    size = sum(world * u.shard_numel for u in even) * param_bytes * steps
    add("all_gather", what, len(even) * steps, size)
    size = sum(u.numel for u in uneven) * param_bytes * steps
    add("broadcast", what, sum(_owners(u) for u in uneven) * steps, size)


def _add_split_reductions(
    plan: Plan,
    buckets: list[tuple[int, ...]],
    steps: int,
    scatter_as_all_reduce: bool,
    add: Callable[[str, str, int, int], None],
    grad_bytes: int = _GRAD_BYTES,
) -> None:
    """Stages 2-3, every micro-step: a bucket of even units all-reduced as one (gloo) or
    each unit reduce-scattered; in a bucket with uneven units, each unit alone: an
    uneven unit's owned parts each reduced to their owner (its exact bytes)."""
    units = plan.units
    for bucket in buckets:
        members = [units[i] for i in bucket]
        uneven = [u for u in members if u.bounds]
        even = [u for u in members if not u.bounds]
        size = sum(u.numel for u in even) * grad_bytes * steps
        if scatter_as_all_reduce:
            add("all_reduce", "gradients", steps * (1 if not uneven else len(even)), size)
        else:
            add("reduce_scatter", "gradients", len(even) * steps, size)
        size = sum(u.numel for u in uneven) * grad_bytes * steps
        add("reduce", "gradients", sum(_owners(u) for u in uneven) * steps, size)


def _control(plan: KindPlan, loss_scaling: bool, norms: bool) -> list[tuple[str, int, bool]]:
    """The control all-reduces of one step: (what, bytes, over the world) once each; the
    norms sum each shard once, over the axes the state is split over."""
    rows = [("gradient norm", 8, False)]
    if loss_scaling:
        rows.append(("fp16 overflow flag", 4, True))
    split = any(s.optimizer is not None and s.optimizer.shard for s in plan.shardings)
    if norms and split:  # optimizer state whole everywhere: every rank's sums are whole
        rows.append(("LAMB tensor norms", 2 * len(plan.manifest.tensors) * 8, False))
    return rows


def _mesh_volume(
    plan: KindPlan,
    *,
    steps: int,
    param_bytes: int,
    bucket_numel: int,
    regathered: list[int],
    control: list[tuple[str, int, bool]],
    scatter_as_all_reduce: bool = False,
    quantized: tuple[bool, bool, int] = (False, False, 8),
    grad_bytes: int = _GRAD_BYTES,
    whole_tensors: frozenset[str] = frozenset(),
) -> list[Collective]:
    """`comm_volume` of a plan on a mesh (said per kind: `as_kind_plan`): the engine's
    rules with each kind's axes.

    - gradients whole on every rank (`grads.shard` empty): all-reduced over the world once
      per step, in buckets (stage 0); where the optimizer is split (ZeRO-1), once per step
      reduce-scattered over its axes (a bucket all-reduced there with
      `scatter_as_all_reduce`) and each shard all-reduced over the rest;
    - split gradients: reduce-scattered over `grads.shard` every micro-step (each bucket
      all-reduced there with `scatter_as_all_reduce`) and each unit's shard all-reduced
      over `grads.replicate` every micro-step too (FSDP2's HSDP; DeepSpeed's MiCS
      all-reduces once, at the accumulation boundary), or where the optimizer is split
      over more axes, the shard reduce-scattered over those once, at the accumulation
      boundary (the gradients accumulate at their split; where the optimizer's axes are
      in another order than the gradients' then the rest, each block then moves to its
      optimizer shard's rank by one all-to-all over the optimizer's axes, and each
      updated shard back before the publishing gathers); with qgZ each bucket's
      quantized all-to-alls, one pair per axis of `grads.shard`, innermost first
      (ZeRO++'s hierarchical reduction);
    - after the update, the parameter shard gathered from optimizer shards over the
      optimizer's axes after the parameters' (ZeRO-1/2: the world; ZeRO-3: none), in the
      hops `publish_hops` says (a finer optimizer split: its extra axes, then the
      gradients' beyond the parameters'); a unit's `whole_tensors` directions
      gathered whole the same way, from the optimizer's axes (all of them);
    - forward gathers every unit with split parameters over `params.shard` per
      micro-step (one gather per axis, outermost first, when hierarchical: MiCS's
      hierarchical all-gather); backward re-gathers the units in `regathered`, from hpZ's
      secondary copy over its axes where there is one;
    - control: the norms over the axes any state is split over (each shard once), the
      flags and the left-over check over the world.
    """
    mesh, units = plan.mesh, plan.units
    every = mesh.names
    found: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}

    def add(operation: str, what: str, axes: tuple[str, ...], calls: int, size: int) -> None:
        if calls and mesh.group_size(axes) > 1:
            row = found.setdefault((operation, what, axes), [0, 0])
            row[0] += calls
            row[1] += size

    whole = [i for i, s in enumerate(plan.shardings) if not s.grads.shard]
    every_bucket = reduction_buckets(plan, bucket_numel)  # a bucket is whole or split
    split_buckets = [b for b in every_bucket if grads_split(plan, b[0])]
    whole_buckets = [b for b in every_bucket if not grads_split(plan, b[0])]
    zero1 = [b for b in whole_buckets if all(_zero1(plan, i) for i in b)]
    if whole:
        size = sum(units[i].numel for b in whole_buckets if b not in zero1 for i in b)
        add("all_reduce", "gradients", every, len(whole_buckets) - len(zero1), size * grad_bytes)
    grads_group = _gradients_group(plan)
    for bucket in zero1:  # at the boundary, into the optimizer's shards (as stage 2's)
        axes = plan.shardings[bucket[0]].optimizer.shard
        # where the optimizer is split finer than other units' gradients: within their
        # group first, then over the extra axes, as their accumulated shards are
        finer = 0 < len(grads_group) < len(axes) and _finer(axes, grads_group)
        inner = grads_group if finer else axes
        size = sum(units[i].numel for i in bucket) * grad_bytes
        if scatter_as_all_reduce:
            add("all_reduce", "gradients", inner, 1, size)
        for i in bucket:
            optimizer = plan.shardings[i].optimizer
            if not scatter_as_all_reduce:
                add("reduce_scatter", "gradients", inner, 1, units[i].numel * grad_bytes)
            shard_bytes = units[i].numel // mesh.group_size(inner) * grad_bytes
            across = "gradients across replicas"
            if finer:
                beyond = tuple(a for a in every if a in axes and a not in inner)
                add("reduce_scatter", across, beyond, 1, shard_bytes)
                _add_exchange(plan, i, grads_group, grad_bytes, "gradients", add)
            add("all_reduce", across, optimizer.replicate, 1, shard_bytes)
    split = [i for i, s in enumerate(plan.shardings) if s.grads.shard]
    weights, gradients, bits = quantized
    if split and gradients:
        for bucket in split_buckets:
            _add_quantized_reduction(plan, bucket, steps, bits, add)
    elif split and scatter_as_all_reduce:  # buckets of the units a pass reduces together
        for bucket in split_buckets:
            axes = plan.shardings[bucket[0]].grads.shard
            size = sum(units[i].numel for i in bucket) * grad_bytes * steps
            add("all_reduce", "gradients", axes, steps, size)
    for i in split:
        unit, grads = units[i], plan.shardings[i].grads
        if not scatter_as_all_reduce and not gradients:
            add("reduce_scatter", "gradients", grads.shard, steps, unit.numel * grad_bytes * steps)
        shard_bytes = unit.numel // mesh.group_size(grads.shard) * grad_bytes
        optimizer = plan.shardings[i].optimizer.shard
        finer = tuple(a for a in every if a in optimizer and a not in grads.shard)
        across = "gradients across replicas"
        if finer:  # once, at the boundary: the accumulated shard into the optimizer's
            add("reduce_scatter", across, finer, 1, shard_bytes)
            _add_exchange(plan, i, grads_group, grad_bytes, "gradients", add)
        replicas = tuple(a for a in grads.replicate if a not in finer)  # pure replicas
        add("all_reduce", across, replicas, steps, shard_bytes * steps)
    for index, (unit, sharding) in enumerate(zip(units, plan.shardings)):
        gathered = unit.numel // mesh.group_size(sharding.optimizer.shard)
        _add_exchange(plan, index, grads_group, param_bytes, "parameters", add)
        for hop in publish_hops(sharding, grads_group, mesh):  # each multiplies what it holds
            gathered *= mesh.group_size(hop)
            add("all_gather", "parameters after the update", hop, 1, gathered * param_bytes)
        _add_directions(plan, index, grads_group, whole_tensors, add)
    for what, indices in (
        ("parameters for forward", range(len(units))),
        ("parameters for backward", regathered),
    ):
        for index in indices:
            _add_gathers(plan, index, what, steps, param_bytes, add, weights)
    split_over = (
        tuple(axis for axis in every if any(axis in s.optimizer.shard for s in plan.shardings))
        or every
    )  # stage 0: the whole world's (each rank's norm is of its 1/W slice)
    for what, size, world in control:
        add("all_reduce", what, every if world else split_over, 1, size)
    checks = steps if len(whole) < len(units) else 1  # per micro-step once any are split
    add("all_reduce", "left-over gradients check", every, checks, 4 * checks)
    exchanges = set(_EXCHANGES.values())
    return [
        Collective(op, what, calls, size, mesh.group_size(axes), axes, what in exchanges)
        for (op, what, axes), (calls, size) in found.items()
    ]


_EXCHANGES = {
    "gradients": "gradients to optimizer shards",
    "parameters": "updated params to grad blocks",
    "directions": "directions to grad blocks",
}


def _add_directions(
    plan: KindPlan,
    index: int,
    gradients: tuple[str, ...],
    taken: frozenset[str],
    add: Callable[[str, str, tuple[str, ...], int, int], None],
) -> None:
    """Unit `index`'s fp32 directions gathered whole once per step where one of its
    `taken` tensors spans two optimizer shards: the publishing gathers' hops from none of
    the parameters' axes (after the exchange back where the orders differ)."""
    unit, sharding = plan.units[index], plan.shardings[index]
    size = plan.mesh.group_size(sharding.optimizer.shard)
    if size == 1 or not spans_parts(unit, taken, unit.numel // size):
        return
    _add_exchange(plan, index, gradients, _DIRECTION_BYTES, "directions", add)
    whole = dataclasses.replace(
        sharding,
        params=plan.mesh.replicated,
        params_secondary=None,
        hierarchical_params_gather=False,
    )
    gathered = unit.numel // size
    for hop in publish_hops(whole, gradients, plan.mesh):  # each multiplies what it holds
        gathered *= plan.mesh.group_size(hop)
        add("all_gather", _DIRECTIONS, hop, 1, gathered * _DIRECTION_BYTES)


def _add_exchange(
    plan: KindPlan,
    index: int,
    gradients: tuple[str, ...],
    size: int,
    what: str,
    add: Callable[[str, str, tuple[str, ...], int, int], None],
) -> None:
    """Where unit `index`'s optimizer shards are in another order than its gradients'
    blocks (`optimizer_exchange`): one all-to-all of an optimizer shard (`size` bytes per
    element) over the optimizer's axes: "gradients" at the boundary (the reduced blocks
    to their shards' ranks) or "parameters" before the publish (the updated shards back
    to the ranks whose gradient blocks they are)."""
    axes = optimizer_exchange(plan.shardings[index], gradients, plan.mesh)
    if axes:
        numel = plan.units[index].numel // plan.mesh.group_size(axes)
        add("all_to_all", _EXCHANGES[what], axes, 1, numel * size)


def _zero1(plan: KindPlan, index: int) -> bool:
    """Whether unit `index` is ZeRO-1: its gradients whole, its optimizer state split."""
    sharding = plan.shardings[index]
    return not sharding.grads.shard and plan.mesh.group_size(sharding.optimizer.shard) > 1


def _add_quantized_reduction(
    plan: KindPlan,
    bucket: tuple[int, ...],
    steps: int,
    bits: int,
    add: Callable[[str, str, tuple[str, ...], int, int], None],
) -> None:
    """qgZ of one bucket, every micro-step: a pair of all-to-alls (codes, scales) per axis
    of the gradients' shard group, innermost first, each over the rows still to reduce."""
    mesh = plan.mesh
    axes = tuple(a for a in plan.shardings[bucket[0]].grads.shard if mesh.axis_size(a) > 1)
    rows = sum(plan.units[i].numel // mesh.group_size(axes) for i in bucket)
    block_bytes = _QUANT_BLOCK * bits // 8 + 4
    hops = [(axis,) for axis in axes] if len(axes) > 1 else [axes]
    for level in reversed(range(len(hops))):
        length = rows * mesh.group_size(tuple(a for hop in hops[:level] for a in hop))
        size = -(-length // _QUANT_BLOCK) * mesh.group_size(hops[level]) * block_bytes
        add("all_to_all", f"gradients (int{bits})", hops[level], 2 * steps, size * steps)


def _add_gathers(
    plan: KindPlan,
    index: int,
    what: str,
    steps: int,
    param_bytes: int,
    add: Callable[[str, str, tuple[str, ...], int, int], None],
    quantized: bool = False,
) -> None:
    """One unit's parameter gathers for forward or backward, every micro-step (`quantized`:
    qwZ's int8 blocks, but for hpZ's backward gather from its exact secondary copy)."""
    unit, sharding = plan.units[index], plan.shardings[index]
    params = sharding.params.shard
    backward = what.endswith("backward")
    if backward and not params:
        raise PlanError(
            f"regathered names unit {index} ({unit.name!r}), whose parameters are whole: "
            "nothing to gather"
        )
    secondary = sharding.params_secondary
    if not params:
        return
    if backward and secondary is not None:
        add("all_gather", what, secondary.shard, steps, unit.numel * param_bytes * steps)
    elif quantized:
        group = plan.mesh.group_size(params)
        size = -(-unit.numel // group // _QUANT_BLOCK) * group * (_QUANT_BLOCK + 4)
        add("all_gather", what + " (int8)", params, 2 * steps, size * steps)
    elif sharding.hierarchical_params_gather:
        gathered = unit.numel // plan.mesh.group_size(params)
        for axis in params:  # outermost first: each gather multiplies what a rank holds
            gathered *= plan.mesh.axis_size(axis)
            add("all_gather", what, (axis,), steps, gathered * param_bytes * steps)
    else:
        add("all_gather", what, params, steps, unit.numel * param_bytes * steps)


def volume_by_axes(rows: list[Collective]) -> dict[tuple[str, ...], int]:
    """Ring wire bytes one rank sends per step, summed by the axes each collective runs
    over (a stage plan's rows: under `()`, the world)."""
    totals: dict[tuple[str, ...], int] = {}
    for row in rows:
        totals[row.axes] = totals.get(row.axes, 0) + row.wire_bytes
    return totals


def format_comm_volume(rows: list[Collective]) -> str:
    """A table of `comm_volume`'s rows, with totals by operation; rows of a plan on a mesh
    also show their axes, and the totals per axes follow."""
    on_mesh = any(r.axes for r in rows)
    axes_head = f"{'axes':<20}" if on_mesh else ""
    lines = [f"{'operation':<15}{'what':<32}{axes_head}{'calls':>7}{'bytes':>15}{'wire bytes':>15}"]
    for r in rows:
        axes = f"{'+'.join(r.axes) or 'world':<20}" if on_mesh else ""
        lines.append(
            f"{r.operation:<15}{r.what:<32}{axes}{r.calls:>7}{r.bytes:>15,}{r.wire_bytes:>15,}"
        )
    total = sum(r.bytes for r in rows)
    wire = sum(r.wire_bytes for r in rows)
    width = 47 + len(axes_head)
    lines.append(f"{'total':<{width}}{sum(r.calls for r in rows):>7}{total:>15,}{wire:>15,}")
    if on_mesh:
        for axes, sent in volume_by_axes(rows).items():
            label = f"  wire bytes over {'+'.join(axes)}"
            lines.append(f"{label:<{width + 22}}{sent:>15,}")
    return "\n".join(lines)
