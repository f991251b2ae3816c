"""Pure questions asked of a plan: who owns what, what it costs, what to read."""

from __future__ import annotations

from dataclasses import dataclass

from fzero.partition._manifest import dtype_of
from fzero.partition._mesh import KINDS
from fzero.partition._mesh_plan import KindPlan
from fzero.partition._plan import MEMORY_KINDS, Plan, PlanError, Unit

__all__ = [
    "LocalSlice",
    "MemoryEstimate",
    "Read",
    "grads_split",
    "kind_slices",
    "local_slices",
    "memory_per_rank",
    "optimizer_state_slots",
    "owned_numel",
    "owner_of",
    "reduction_buckets",
    "reshard_reads",
    "spans_parts",
    "written_slices",
]


@dataclass(frozen=True)
class LocalSlice:
    """Elements `[start, stop)` of flattened tensor `fqn` live in rank's shard of
    unit `unit`, from element `shard_offset` of that shard."""

    fqn: str
    unit: int
    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def local_slices(plan: Plan, rank: int) -> tuple[LocalSlice, ...]:
    """The part of every tensor that `rank` owns, in unit then buffer order.

    Ownership is the plan's partition (a plan rank's optimizer shard); whether a state is
    actually held sharded depends on the stage (`Plan.stage_of`). On a mesh each kind is
    split its own way, per process: ask `kind_slices`.
    """
    _check_rank(plan, rank)
    found = []
    for index, unit in enumerate(plan.units):
        found += _slices_in(index, unit, *plan.shard_range(unit, rank))
    return tuple(sorted(found, key=lambda s: (s.unit, s.shard_offset)))


def written_slices(plan: Plan, rank: int) -> tuple[LocalSlice, ...]:
    """`local_slices(plan, rank)` that plan rank `rank` writes to a checkpoint: each of a
    unit's shards is written once, by its replica 0 (`Plan.unit_replica`: a unit on its
    own `shard_axes` has replicas among the plan's ranks; other units none)."""
    return tuple(
        s for s in local_slices(plan, rank) if not plan.unit_replica(plan.units[s.unit], rank)
    )


def kind_slices(plan: Plan, rank: int, kind: str) -> tuple[LocalSlice, ...]:
    """The part of every tensor that process `rank` (a rank of `plan.process_mesh`) holds
    of `kind` (one of `KINDS`), in unit then buffer order; `shard_offset` counts from the
    start of the process's block of that kind (`Plan.kind_range`). Units without a
    `params_secondary` have no slices of it."""
    _check_process(plan, rank)
    found = []
    for index, unit in enumerate(plan.units):
        if plan.sharding_of(unit).of(kind) is not None:
            found += _slices_in(index, unit, *plan.kind_range(unit, kind, rank))
    return tuple(sorted(found, key=lambda s: (s.unit, s.shard_offset)))


def _slices_in(index: int, unit: Unit, lo: int, hi: int) -> list[LocalSlice]:
    """The tensor elements in `[lo, hi)` of `unit`'s buffer, offsets counted from `lo`."""
    found = []
    for placement in unit.placements:
        for piece in placement.pieces:
            begin = max(lo, piece.offset)
            end = min(hi, piece.offset + piece.numel)
            if end > begin:
                start = piece.start + begin - piece.offset
                found.append(
                    LocalSlice(placement.fqn, index, start, start + end - begin, begin - lo)
                )
    return found


def reduction_buckets(plan: Plan | KindPlan, bucket_numel: int) -> tuple[tuple[int, ...], ...]:
    """Unit indices grouped into gradient-reduction buckets, in launch order.

    Backward produces gradients roughly in reverse unit order, so buckets take
    consecutive units from the last one back, each holding at most
    `bucket_numel` elements (DeepSpeed's `reduce_bucket_size`); a unit larger
    than that is a bucket of its own. One collective reduces a whole bucket, so a
    bucket never mixes units whose gradients are all-reduced whole (stages 0-1, at the
    accumulation boundary) with units whose gradients are split (stages 2-3, every
    micro-step): a plan whose units differ in stage starts a bucket where that changes,
    and one whose units' gradient accumulators differ in dtype (`Unit.grads_dtype`: the
    accumulators of units at stages 0-1 are views of one buffer per bucket) likewise.
    """
    if bucket_numel < 1:
        raise PlanError(f"reduce_bucket_size is {bucket_numel}; it must be >= 1")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(plan.units))):
        numel = plan.units[index].numel
        other = bool(current) and (
            grads_split(plan, index) != grads_split(plan, current[-1])
            or _grads_dtype(plan, index) != _grads_dtype(plan, current[-1])
            or _grads_group(plan, index) != _grads_group(plan, current[-1])
        )
        if current and (filled + numel > bucket_numel or other):
            buckets.append(tuple(current))
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def _grads_group(plan: Plan | KindPlan, index: int) -> tuple[str, ...] | None:
    """The axes unit `index`'s gradients are reduced over, where units differ in them."""
    if isinstance(plan, KindPlan):
        return plan.shardings[index].grads.shard
    return plan.units[index].shard_axes


def _grads_dtype(plan: Plan | KindPlan, index: int) -> str:
    unit = plan.units[index]
    return plan.memory.grads if unit.grads_dtype is None else unit.grads_dtype


def grads_split(plan: Plan | KindPlan, index: int) -> bool:
    """Whether unit `index`'s gradients are split over ranks (reduce-scattered every
    micro-step: stages 2-3), not whole (all-reduced at the accumulation boundary)."""
    if isinstance(plan, KindPlan):
        return bool(plan.shardings[index].grads.shard)
    return plan.stage_of(index) >= 2


def owner_of(plan: Plan, fqn: str, flat_index: int) -> int:
    """The rank that owns element `flat_index` of flattened tensor `fqn` (of a shard
    several plan ranks hold, a unit on its own `shard_axes`, its replica 0)."""
    name = fqn if fqn in plan.manifest.fqns else _canonical(plan, fqn)
    unit = plan.units[plan.unit_of(name)]
    for placement in unit.placements:
        if placement.fqn != name:
            continue
        for piece in placement.pieces:
            if piece.start <= flat_index < piece.start + piece.numel:
                shard = unit.owner(piece.offset + flat_index - piece.start)
                return plan.shard_writer(unit, shard)
    numel = plan.manifest[name].numel
    raise IndexError(f"index {flat_index} is out of range for tensor {fqn!r} of {numel} elements")


def spans_parts(unit: Unit, fqns: frozenset[str] | set[str], block: int | None = None) -> bool:
    """Whether one of `unit`'s tensors named in `fqns` spans two ranks' parts: of its
    uneven bounds, or of even blocks of `block` elements (default `Unit.shard_numel`).
    An optimizer that updates such tensors whole (`fzero.optim.WholeTensors`) gathers
    the unit's directions then; where none does (`whole_tensors`), nothing moves."""
    size = unit.shard_numel if block is None else block

    def owner(offset: int) -> int:
        return unit.owner(offset) if unit.bounds else offset // size

    for placement in unit.placements:
        if placement.fqn in fqns:
            pieces = [p for p in placement.pieces if p.numel]
            ends = [e for p in pieces for e in (p.offset, p.offset + p.numel - 1)]
            if len({owner(e) for e in ends}) > 1:
                return True
    return False


def _canonical(plan: Plan, alias: str) -> str:
    for spec in plan.manifest.tensors:
        if alias in spec.aliases:
            return spec.fqn
    raise KeyError(f"tensor {alias!r} is not in the plan")


def owned_numel(plan: Plan) -> list[int]:
    """Real (non-padding) elements each rank owns, summed over all units."""
    owned = [0] * plan.world_size
    for rank in range(plan.world_size):
        owned[rank] = sum(s.numel for s in local_slices(plan, rank))
    return owned


# fp32 state tensors per element of each built-in optimizer (Adam: m and v).
_STATE_SLOTS = {
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
    "muon": 2,
    "sgd": 1,
    "sgd_nomomentum": 0,
    "adagrad": 1,
    "lion": 1,
}


def optimizer_state_slots(optimizer: str | int | object) -> int:
    """fp32 optimizer-state tensors per parameter element: an int, a name or an optimizer."""
    if isinstance(optimizer, int):
        if optimizer < 0:
            raise ValueError(f"optimizer state slots is {optimizer}; it must be >= 0")
        return optimizer
    slots = getattr(optimizer, "state_slots", None)
    if isinstance(slots, int):
        return slots
    key = str(optimizer).lower()
    if key not in _STATE_SLOTS:
        raise ValueError(f"optimizer {optimizer!r} is unknown; allowed: {sorted(_STATE_SLOTS)}")
    return _STATE_SLOTS[key]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds for model states (no activations, no buffers), by kind,
    wherever they live, and how many of them live off the compute device.

    `params`: the compute-dtype parameters; `master`: the master copy (none where the
    parameters in the master's dtype are it); `grads`: the gradient accumulators;
    `optimizer_state`: the optimizer's moments. `host`: those bytes in host memory
    (offloaded: `offload_optimizer` / `offload_param` "cpu"); `nvme`: those in swap
    files (one copy each; "nvme"); `device`: the rest.
    """

    params: int
    master: int
    grads: int
    optimizer_state: int
    offload_optimizer: bool = False
    params_secondary: int = 0
    """ZeRO++ hpZ's secondary parameter copy (plans on a mesh; 0 otherwise)."""
    params_kept: int = 0
    """Stage 3: whole units kept gathered between forwards without gradients
    (generation, evaluation) up to `stage3_eval_live_parameters` elements."""
    offloaded: int | None = None
    """Bytes in host memory off the device: masters and optimizer state of units whose
    optimizer lives on the host (`Plan.optimizer_memory`), stage-3 parameter shards kept
    there (`Plan.params_memory`); None: the masters and optimizer state with
    `offload_optimizer`, else none."""
    nvme: int = 0
    """Bytes in swap files (ZeRO-Infinity): masters, optimizer state and (stages 2-3,
    `offload_optimizer.swap_gradients`) gradient accumulators of units whose optimizer
    lives on NVMe, stage-3 parameter shards kept there; one copy of each (a file keeps
    two slots of the optimizer's with `commit: two_slots`)."""

    @property
    def total(self) -> int:
        kept = self.params_secondary + self.params_kept
        return self.params + kept + self.master + self.grads + self.optimizer_state

    @property
    def host(self) -> int:
        if self.offloaded is not None:
            return self.offloaded
        return self.master + self.optimizer_state if self.offload_optimizer else 0

    @property
    def device(self) -> int:
        return self.total - self.host - self.nvme


def memory_per_rank(
    plan: Plan,
    rank: int,
    *,
    param_dtype: str = "float32",
    grad_dtype: str | None = "plan",
    optimizer: str | int | object = "adam",
    offload_optimizer: bool | None = None,
    master_dtype: str | None = None,
    state_dtype: str | None = None,
    eval_live_parameters: int = 0,
    swap_gradients: bool = True,
) -> MemoryEstimate:
    """Model-state bytes on `rank`, the ZeRO paper's formula made exact for this plan.

    Per element, with Ψ elements, N ranks, K = master bytes (4 for fp32, when params
    are not fp32) + optimizer slots x state bytes: stage 0 holds params + grads + K·Ψ;
    stage 1 shards the K part; stage 2 also the grads; stage 3 also the params
    (except persistent units), each unit as its own stage (`Plan.stage_of`). Buffers are
    counted padded, as allocated.
    The defaults are what the plan says fzero keeps (`Plan.memory`): gradient
    accumulators in `memory.grads` (fp32 unless it says bf16 or fp16; `grad_dtype`
    names another, None: the parameters' dtype, the paper's mixed-precision figures),
    fp32 masters and states. A master in the parameters' dtype is the parameters
    (`master_dtype="bfloat16"` with bf16 params: no master bytes), unless either is off
    the device. `offload_optimizer` (True: the host for units on the device; False:
    every unit on the device), `master_dtype` and `state_dtype` default to what the plan
    says (`Plan.memory`, unit by unit: the optimizer off the device, bf16 masters or
    states). Where each unit's states live is counted in `host` and `nvme`: with the
    optimizer on NVMe its masters and state, and at stages 2-3 its gradient accumulators
    unless `swap_gradients` is False (the config's `offload_optimizer.swap_gradients`),
    are in the swap file; stage 3's parameter shards where `Plan.params_memory` says.

    On a mesh `rank` is a process (of `plan.processes`) and each kind holds its unit's
    buffer over the group size of its shard axes (`Plan.kind_range`), plus hpZ's
    secondary copy in `params_secondary`. MiCS (Zhang
    et al. 2022, arXiv:2205.00119): every model state over the shard-group size, not the world
    size; ZeRO++ hpZ (Wang et al. 2023, arXiv:2306.10209): ZeRO-3's states plus a parameter copy
    over the ranks of a node.

    `eval_live_parameters` (the config's `stage3_eval_live_parameters`): at stage 3 the
    whole units kept gathered across forwards without gradients, up to that many
    elements and at most the gathered units' size, in `params_kept` (the bound that
    makes ZeRO-3 generation fast, counted where it is paid).
    """
    _check_process(plan, rank)
    if eval_live_parameters < 0:
        raise PlanError(f"eval_live_parameters is {eval_live_parameters}; it must be >= 0")
    param_size = dtype_of(param_dtype).itemsize
    slots = optimizer_state_slots(optimizer)
    split_grads = _splits_grads(plan)
    field_bytes = dict.fromkeys(("params", "secondary", "master", "grads", "state"), 0)
    where_bytes = dict.fromkeys(MEMORY_KINDS, 0)
    off_device = False
    for held in _unit_holdings(plan, rank):
        where = held.optimizer_where
        if offload_optimizer is not None:  # said for every unit
            where = ("host" if where == "device" else where) if offload_optimizer else "device"
        off_device |= where != "device"
        master_name = master_dtype or _DTYPES[held.master]
        state_size = dtype_of(state_dtype or _DTYPES[held.states]).itemsize
        if grad_dtype == "plan":
            grad_size = dtype_of(_DTYPES[held.grads_dtype]).itemsize
        else:
            grad_size = dtype_of(grad_dtype or param_dtype).itemsize
        # a master in the parameters' dtype, both on the device, is the parameter shard
        # itself, but where parameters are split coarser than the optimizer (`apart`)
        once = (
            dtype_of(master_name) == dtype_of(param_dtype)
            and where == "device"
            and held.params_where == "device"
        )
        master_numel = held.apart if once else held.optimizer
        grads_where = "nvme" if where == "nvme" and swap_gradients and split_grads else "device"
        for name, size, kind in (
            ("params", held.params * param_size, held.params_where),
            ("secondary", held.secondary * param_size, "device"),
            ("master", master_numel * dtype_of(master_name).itemsize, where),
            ("grads", held.grads * grad_size, grads_where),
            ("state", held.optimizer * state_size * slots, where),
        ):
            field_bytes[name] += size
            where_bytes[kind] += size
    return MemoryEstimate(
        params=field_bytes["params"],
        master=field_bytes["master"],
        grads=field_bytes["grads"],
        optimizer_state=field_bytes["state"],
        offload_optimizer=off_device,
        params_secondary=field_bytes["secondary"],
        params_kept=min(eval_live_parameters, _gathered_numel(plan)) * param_size,
        offloaded=where_bytes["host"],
        nvme=where_bytes["nvme"],
    )


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class _Holding:
    """Elements one rank holds of one unit, by kind, where they live and their dtypes
    (the plan's names: "fp32", "bf16", "fp16"). `apart`: optimizer elements whose master
    cannot be the parameter shard (parameters split coarser than the optimizer state)."""

    params: int
    secondary: int
    grads: int
    optimizer: int
    apart: int
    params_where: str
    optimizer_where: str
    master: str
    states: str
    grads_dtype: str


def _splits_grads(plan: Plan) -> bool:
    """Whether every unit's gradients are split (stages 2-3): then a swap file holds the
    gradient accumulators of the units whose optimizer state it holds (a unit at stage
    0-1 keeps every accumulator in memory: whole gradients are all-reduced at the
    boundary)."""
    return plan.stage >= 2 and not plan.runs_stage(lambda s: s < 2)


def _gathered_numel(plan: Plan) -> int:
    """Elements of the units stage 3 gathers whole for a forward (not persistent)."""
    return sum(u.numel for u in plan.units if plan.stage_of(u) == 3)


def _unit_holdings(plan: Plan, rank: int) -> list[_Holding]:
    """What `rank` holds of each unit: each unit as its own stage (`Plan.stage_of`); on a
    mesh (`rank` a process) each kind its block along its shard axes
    (`Plan.kind_range`), with masters apart from the parameters where those are split
    coarser than the optimizer state (`Plan.optimizer_finer`)."""
    if plan.mesh is not None:
        return [_mesh_holding(plan, unit, rank) for unit in plan.units]
    out = []
    for unit in plan.units:
        full, stage = unit.numel, plan.stage_of(unit)
        shard = unit.shard_size(plan.shard_index(unit, rank))
        start, stop = plan.grads_range(unit, rank)
        out.append(
            _Holding(
                params=stop - start if stage == 3 else full,
                secondary=0,
                grads=stop - start if stage >= 2 else full,
                optimizer=shard if stage >= 1 else full,
                apart=0,
                params_where=plan.params_memory(unit),
                optimizer_where=plan.optimizer_memory(unit),
                master=plan.master_dtype(unit),
                states=plan.states_dtype(unit),
                grads_dtype=plan.grads_dtype(unit),
            )
        )
    return out


def _mesh_holding(plan: Plan, unit: Unit, process: int) -> _Holding:
    """What `process` holds of `unit` on a mesh: each kind's `Plan.kind_range`."""
    sharding = plan.sharding_of(unit)
    numel = {}
    for kind in KINDS:
        split = sharding.of(kind)
        start, stop = (0, 0) if split is None else plan.kind_range(unit, kind, process)
        numel[kind] = stop - start
    params = sharding.params.shard
    return _Holding(
        params=numel["params"],
        secondary=numel["params_secondary"],
        grads=numel["grads"],
        optimizer=numel["optimizer"],
        # a stage-3 master apart from the parameter shard it is a part of
        apart=numel["optimizer"] if params and plan.optimizer_finer(unit) else 0,
        params_where=plan.params_memory(unit),
        optimizer_where=plan.optimizer_memory(unit),
        master=plan.master_dtype(unit),
        states=plan.states_dtype(unit),
        grads_dtype=plan.grads_dtype(unit),
    )


@dataclass(frozen=True)
class Read:
    """Copy `numel` elements of `fqn` from `old_rank`'s shard of old unit
    `old_unit` (at `old_offset`) to this rank's shard of new unit `new_unit`
    (at `new_offset`)."""

    fqn: str
    old_rank: int
    old_unit: int
    old_offset: int
    new_unit: int
    new_offset: int
    numel: int


def reshard_reads(old_plan: Plan, new_plan: Plan, rank: int) -> tuple[Read, ...]:
    """The reads that fill `rank`'s shards under `new_plan` from shards saved under `old_plan`.

    Both plans must describe the same tensors (names and shapes); world size,
    stage, strategy and units may all differ. The reads cover each of the new
    rank's slices exactly once.
    """
    _check_same_tensors(old_plan, new_plan)
    old_by_fqn: dict[str, list[tuple[int, LocalSlice]]] = {}
    for old_rank in range(old_plan.world_size):
        for piece in written_slices(old_plan, old_rank):
            old_by_fqn.setdefault(piece.fqn, []).append((old_rank, piece))
    reads = []
    for new in local_slices(new_plan, rank):
        for old_rank, old in old_by_fqn.get(new.fqn, ()):
            begin, end = max(new.start, old.start), min(new.stop, old.stop)
            if end > begin:
                reads.append(
                    Read(
                        fqn=new.fqn,
                        old_rank=old_rank,
                        old_unit=old.unit,
                        old_offset=old.shard_offset + begin - old.start,
                        new_unit=new.unit,
                        new_offset=new.shard_offset + begin - new.start,
                        numel=end - begin,
                    )
                )
    return tuple(reads)


def _check_same_tensors(old_plan: Plan, new_plan: Plan) -> None:
    old = {s.fqn: s.shape for s in old_plan.manifest.tensors}
    new = {s.fqn: s.shape for s in new_plan.manifest.tensors}
    missing = sorted(set(new) - set(old))
    unexpected = sorted(set(old) - set(new))
    changed = sorted(f"{k}: {old[k]} -> {new[k]}" for k in set(old) & set(new) if old[k] != new[k])
    differences = [
        f"{what} {names}"
        for what, names in (
            ("missing from the old plan", missing),
            ("not in the new plan", unexpected),
            ("shape changed", changed),
        )
        if names
    ]
    if differences:
        raise PlanError("plans describe different tensors: " + "; ".join(differences))


def _check_rank(plan: Plan, rank: int) -> None:
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {plan.world_size}")


def _check_process(plan: Plan, rank: int) -> None:
    if not 0 <= rank < plan.processes:
        raise ValueError(
            f"rank {rank} is out of range for the plan's {plan.processes} processes"
            + (f" (mesh {plan.mesh})" if plan.mesh is not None else "")
        )
