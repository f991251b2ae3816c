"""Training as functions, part one: `init` builds this rank's `TrainState` from a model
and a plan, `state_dict` consolidates the trained weights from one. The step is
`fzero.train_step` (`fzero.core.step`); checkpoints are `fzero.checkpoint.save` and
`restore`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm, partition
from fzero.config import Config, load_config, read_config
from fzero.core.build import Holding, build_unit_state, values_on_rank
from fzero.core.groups import check_same_plan, gather_optimizer_shards, groups_of, unit_group
from fzero.core.layout import UnitRuntime, gather_pieces
from fzero.core.partitioned import gather_whole, is_partitioned, release_partition, shape_of
from fzero.core.precision import (
    DTYPES,
    STATE_DTYPES,
    Precision,
    loss_scaler,
    precision_of,
    run_plan,
)
from fzero.core.reduce import bucket_accumulators
from fzero.core.residency import Residency
from fzero.core.state import (
    Counters,
    TrainState,
    UnitState,
    partition_numel,
)
from fzero.core.swap_units import SwapFileUnits
from fzero.optim import Optimizer, optimizer_from_name, schedule_from_name
from fzero.optim._schedules import Schedule
from fzero.partition import Plan

__all__ = [
    "ModelStream",
    "check_optimizer",
    "config_for_plan",
    "full_master",
    "init",
    "optimizer_of",
    "schedule_of",
    "state_dict",
    "stream_state_dict",
]

# ---- init ----------------------------------------------------------------------------------


def init(
    model: torch.nn.Module,
    plan: Plan,
    optimizer: Optimizer,
    *,
    precision: str | Precision = "fp32",
    config: Config | Mapping[str, Any] | str | None = None,
    seed: int | None = None,
) -> TrainState:
    """This rank's `TrainState` for `model` under `plan` (collective: every rank starts
    from rank 0's weights).
    `precision` is the compute dtype's name (`fp32`, `bf16`, `fp16`; masters and
    optimizer states as the config's `bf16` block says, else fp32) or a
    `fzero.Precision` (e.g. `Precision("bf16", master="bf16", states="bf16")`:
    bf16 masters, held once as the parameters, and bf16 moments). Where masters and
    optimizer state live is the plan's `memory.optimizer` (else the config's
    `offload_optimizer.device`): "host" (`cpu`) keeps them in host memory, "nvme" in a
    swap file under `offload_optimizer.nvme_path` (`TrainState.residence`; gradients
    stay in memory); the plan's `memory.master` and `memory.states` are the dtypes
    `precision` leaves unsaid, and the state's plan (`TrainState.plan`) says all of it.
    `seed` seeds the generator the
    steps draw from (default: the process generator's state now). A model built inside
    `fzero.init_context()` is adopted from its partitions one unit at a time (they are
    dropped from the model as they are: read its weights from the state after)."""
    check_optimizer(optimizer)
    plan = partition.validate(plan)
    cfg = config_for_plan(config, plan)
    plan, dtypes = run_plan(plan, cfg, precision_of(cfg, precision), door="fzero.init")
    comm.init_distributed(report_s=cfg.collective_report_s)
    _check_world(plan)
    check_same_plan(plan, "fzero.init")
    rank, device = groups_of(plan).rank, comm.backend_device()
    where = [plan.optimizer_memory(u) for u in plan.units]
    holding = Holding(
        compute_dtype=dtypes.compute_dtype,
        master_dtype=dtypes.master_dtype,
        state_dtype=dtypes.state_dtype,
        device=device,
        grad_dtype=dtypes.grad_dtype,
    )
    named = dict(model.named_parameters())
    _check_model(plan, named)
    meta = [fqn for fqn, p in named.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"fzero.init needs the model's weights, but {len(meta)} parameter(s) are on the "
            f"meta device (first: {meta[0]!r}); build the model eagerly or inside "
            "fzero.init_context() (partitioned as it is built), or give the meta-device "
            "model to fzero.shard, which materialises it unit by unit"
        )
    accumulators = None  # units at stages 0-1: views of one buffer per reduction bucket
    if plan.runs_stage(lambda s: s < 2):
        buckets = partition.reduction_buckets(plan, int(cfg.zero_optimization.reduce_bucket_size))
        accumulators = bucket_accumulators(plan, buckets, device)
    # NVMe: each unit goes to the swap file as it is built (in pieces with
    # `sub_group_size`), so the rank's share of masters and moments is never in memory
    residency = _residency(cfg, plan, rank, optimizer) if "nvme" in where else None
    units: list[UnitState] = []
    runtimes: list[UnitRuntime] = []
    for index, unit in enumerate(plan.units):
        tensors = [named[pl.fqn] for pl in unit.placements]
        to_file = residency is not None and residency.holds(index)
        values, start = values_on_rank(plan, index, tensors, rank=rank, device=device)
        grad = accumulators[index] if accumulators is not None else None
        held = holding._replace(  # NVMe: fp32 master and moments in memory, bf16 in the file
            offload=where[index] != "device",
            state_dtype=(
                torch.float32
                if where[index] == "nvme"
                else STATE_DTYPES[plan.states_dtype(index)]  # `Unit.states_dtype`
            ),
            grad_dtype=DTYPES[plan.grads_dtype(index)],  # `Unit.grads_dtype`
            master_dtype=(
                torch.float32
                if where[index] == "nvme"
                else STATE_DTYPES[plan.master_dtype(index)]  # `Unit.master_dtype`
            ),
            to_file=to_file,
            in_pieces=to_file and residency is not None and residency.sub_group > 0,
        )
        built = build_unit_state(
            plan, index, values, rank=rank, holding=held, optimizer=optimizer,
            grad=grad, values_from=start,
        )  # fmt: skip
        del values
        rt = UnitRuntime(index, unit, [], built.master, built.optim, built.grad)
        if residency is not None and held.in_pieces:  # the state made as it is written
            residency.write_in_pieces(rt, optimizer)
        elif residency is not None and to_file:  # the host keeps nothing of it
            residency.swap_out(rt, rt.slot, wait=True)
            residency.evict(rt)
        units.append(built._replace(master=rt.master, optim=rt.state))
        runtimes.append(rt)
        for tensor in tensors:  # adopted: the state holds them now
            if is_partitioned(tensor):
                release_partition(tensor)
    rng = torch.get_rng_state() if seed is None else _seeded(seed)
    scale = loss_scaler(cfg).init() if dtypes.compute == "fp16" else None
    residence = None
    if residency is not None:
        residency.step_pool.trim(0)  # the pieces' buffers (`write_in_pieces`): none kept
        residence = SwapFileUnits(residency, runtimes)
    return TrainState(plan, rank, tuple(units), Counters(), scale, rng, residence)


def _residency(config: Config, plan: Plan, rank: int, optimizer: Optimizer) -> Residency:
    """NVMe offload: a new swap file for the units the plan keeps there (their
    gradients stay in memory: `train_step` reduces into the state's buffers)."""
    return Residency(
        config,
        plan,
        rank=rank,
        optimizer=optimizer,
        partition_numel=functools.partial(partition_numel, plan, rank=rank),
        swap_gradients=False,
    )


def optimizer_of(
    config: Config, given: Optimizer | None, *, default: Optimizer | None
) -> Optimizer | None:
    """The optimizer a door runs: `given`, else the config's `optimizer` block, else
    `default` — AdamW's defaults for fzero's own doors (`shard`, `train_step`), none
    for DeepSpeed's `initialize` (an engine that runs forward only, as DeepSpeed's)."""
    if given is not None:
        return given
    if config.optimizer is not None:
        return optimizer_from_name(config.optimizer.type, config.optimizer.params)
    return default


def schedule_of(config: Config, given: Schedule | None = None) -> Schedule | None:
    """The lr schedule a door runs: `given`, else the config's `scheduler` block, else
    None (the optimizer's lr throughout)."""
    if given is not None or config.scheduler is None:
        return given
    return schedule_from_name(config.scheduler.type, config.scheduler.params)


def config_for_plan(config: Config | Mapping[str, Any] | str | None, plan: Plan) -> Config:
    """The config, which may leave the stage out (the plan's is taken) but not contradict
    it."""
    if not isinstance(config, Config):
        raw = dict(read_config(config if config is not None else {}))
        zero = raw.get("zero_optimization")
        if isinstance(zero, Mapping) and "stage" not in zero:
            raw["zero_optimization"] = {**zero, "stage": plan.stage}
        config = raw
    cfg = load_config(config)
    stage = cfg.zero_optimization.stage
    if stage not in (0, plan.stage):
        raise ValueError(
            f"the config's zero_optimization.stage is {stage}; the plan's {plan.stage}: leave "
            "it out or make them agree"
        )
    if plan.mesh is None:  # a plan on a mesh says its groups itself
        check_group_keys(cfg, plan.world_size)
    if cfg.unit_stages and partition.set_unit_stages(plan, cfg.unit_stages) != plan:
        said = {u.name: s for u, s in zip(plan.units, plan.stages)}
        raise ValueError(
            f"the config's unit_stages is {cfg.unit_stages}, but the plan's units are split "
            f"as {said}: fzero.init and train_step run the plan they are given; build it "
            "with partition.plan(..., unit_stages=...) or leave the key out"
        )
    return cfg


def check_group_keys(config: Config, world_size: int) -> None:
    """A config's hpZ and MiCS group sizes beside a plan of the whole world (not on a
    mesh): they agree where they mean one group of every rank (ZeRO-3 exactly); a smaller
    group asks for a plan on a mesh, which the engine makes from them and `fzero.init` /
    `train_step` take as a plan: refused, naming the key, the value and the plan to
    give. Below stage 3 they have no effect, as in DeepSpeed."""
    zero = config.zero_optimization
    if zero.stage < 3:
        return
    for key, value, off in (
        ("zero_hpz_partition_size", zero.zero_hpz_partition_size, 1),
        ("mics_shard_size", zero.mics_shard_size, -1),
    ):
        if value in (off, world_size) or (off < 0 and value <= 0):
            continue
        raise ValueError(
            f"zero_optimization.{key} is {value} on {world_size} ranks, but the plan is of "
            f"the whole world (one group: {off} (off) or {world_size} agree with it). Give "
            "the plan on a mesh the key asks for: partition.mesh_plan(manifest, "
            "*partition.from_zero_config(config['zero_optimization'], world_size))"
        )


def _seeded(seed: int) -> Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def check_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; expected an fzero.optim optimizer "
            "(fzero.optim.adam, adamw, lamb, sgd, muon, adagrad, lion, or your own)"
        )


def _check_world(plan: Plan) -> None:
    world = dist.get_world_size()
    if plan.processes != world:
        what = f"plan.world_size is {plan.world_size}"
        if plan.mesh is not None:
            what = f"the plan's mesh {plan.mesh.axes} has {plan.processes} processes"
        raise ValueError(
            f"{what} but torch.distributed runs {world} ranks; plan for the world you run "
            "(fzero.partition.plan(..., world_size=W), or a mesh of W processes)"
        )


def _check_model(plan: Plan, named: Mapping[str, Tensor]) -> None:
    missing = [spec.fqn for spec in plan.manifest.tensors if spec.fqn not in named]
    changed = [
        f"{spec.fqn}: plan {spec.shape}, model {shape_of(named[spec.fqn])}"
        for spec in plan.manifest.tensors
        if spec.fqn in named and shape_of(named[spec.fqn]) != spec.shape
    ]
    if missing or changed:
        raise ValueError(
            f"the model does not fit the plan: missing parameters {missing}, shapes differ "
            f"{changed}"
        )


# ---- views of a state ------------------------------------------------------------------------


def state_dict(
    state: TrainState, *, module: torch.nn.Module | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """The consolidated weights from the masters (in `dtype`), on rank 0 ({} elsewhere);
    collective. Every name of a tied tensor is a key. With `module`, its frozen
    parameters and buffers are added, in its own `state_dict` order. A rank that never
    arrives is named (`fzero.comm.named_operation`). (`stream_state_dict` gives the same
    one tensor at a time.)"""
    where = f"fzero.state_dict (micro-step {state.counters.micro_steps})"
    with comm.named_operation(where, entry="always"):
        stream = stream_state_dict(state, module=module, dtype=dtype)
        result = {key: t for (key, _, _), t in zip(stream.specs, stream.tensors, strict=False)}
        for _ in stream.tensors:  # (other ranks: the collectives only)
            pass
    if comm.get_rank() != 0 or module is None:
        return result
    return {k: result[k] for k in module.state_dict(keep_vars=True) if k in result}


class ModelStream(NamedTuple):
    """A consolidated model one tensor at a time: `specs` (key, dtype, shape) in the
    order `tensors` yields them. `tensors` yields on rank 0 only, but must be run to its
    end on every rank (it gathers one unit at a time: collective)."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    tensors: Iterator[Tensor]


def stream_state_dict(
    state: TrainState,
    *,
    module: torch.nn.Module | None = None,
    dtype: torch.dtype = torch.float32,
    exclude_frozen: bool = False,
) -> ModelStream:
    """`state_dict`'s entries one at a time (see `ModelStream`): the trained tensors unit
    by unit (every name of a tied one), then `module`'s frozen parameters (unless
    `exclude_frozen`) and buffers, as they are. No process holds more than one unit
    gathered, so a model larger than any process's memory can be written out."""
    plan, first = state.plan, comm.get_rank() == 0
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for unit in plan.units:
        for pl in unit.placements:
            spec = plan.manifest[pl.fqn]
            specs += [(name, dtype, spec.shape) for name in (spec.fqn, *spec.aliases)]
    trained = {key for key, _, _ in specs}
    rest: list[tuple[str, Tensor]] = []
    if module is not None:
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        for key, value in module.state_dict(keep_vars=True).items():
            if key in trained or (exclude_frozen and key in frozen):
                continue
            rest.append((key, value))
            specs.append((key, value.dtype, shape_of(value)))

    def tensors() -> Iterator[Tensor]:
        for index, unit in enumerate(plan.units):
            full = full_master(state, index, dtype)
            for pl in unit.placements:
                spec = plan.manifest[pl.fqn]
                if first:
                    tensor = gather_pieces(full, pl, spec.shape).to(dtype).contiguous()
                    for _ in (spec.fqn, *spec.aliases):
                        yield tensor
            del full
        for _, value in rest:
            whole = gather_whole(value) if is_partitioned(value) else value.detach().clone()
            if first:
                yield whole

    return ModelStream(specs, tensors())


def full_master(state: TrainState, index: int, pieces_dtype: torch.dtype | None = None) -> Tensor:
    """Unit `index`'s whole master buffer (fp32, or bf16 with bf16 masters), gathered on
    every rank (collective; a unit outside memory is read back first). A unit the swap
    file moves in pieces (`sub_group_size`) is gathered piece by piece and assembled in
    `pieces_dtype` if given (a save's compute dtype: `_full_master_in_pieces`); the
    caller converts the rest."""
    device = comm.backend_device()
    residence, plan = state.residence, state.plan
    pieces = residence is not None and residence.holds(index) and residence.sub_group > 0
    even = not plan.units[index].bounds and plan.optimizer_extra_size == 1
    if pieces and even and plan.stage_of(index) >= 1:
        dtype = pieces_dtype or torch.float32
        return _full_master_in_pieces(state, index, dtype, device)
    with _master_of(state, index) as master:
        if state.plan.stage_of(index) == 0:
            return master.to(device, copy=True)
        numel, dtype = state.plan.units[index].numel, master.dtype
        full = torch.empty(numel, dtype=dtype, device=device)
        if state.plan.world_size > 1:
            shard, plan = master.to(device).contiguous(), state.plan
            gather_optimizer_shards(full, shard, plan, index, groups_of(plan), async_op=False)
        else:
            full.copy_(master)
    return full


def _full_master_in_pieces(
    state: TrainState, index: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """`full_master` of a unit the swap file moves in pieces ([Note: checkpoints in
    pieces]): the whole buffer in `dtype` (the compute dtype for a save: half the fp32
    bytes with bf16), filled piece by piece: each rank reads elements [a, a + piece) of
    its master alone (no moments, no gradient) and the plan's ranks gather them, so a
    rank holds the unit once in `dtype` and two pieces beside it, not its master's
    partition and the whole unit in fp32."""
    residence, plan = state.residence, state.plan
    assert residence is not None
    unit, piece = plan.units[index], residence.sub_group
    groups = groups_of(plan)
    own = unit_group(plan, groups, unit, groups.rank)  # even, no finer split: the plan's
    world, part, group = own.world, unit.shard_numel, own.group  # or the unit's own axes'
    full = torch.empty(unit.numel, dtype=dtype, device=device)
    with residence.pieces(index) as reader:
        for start in range(0, part, piece):
            stop = min(part, start + piece)
            (mine,) = reader.span("master", start, stop)
            parts = mine.to(device)
            if world > 1:
                parts = torch.empty(world * (stop - start), dtype=mine.dtype, device=device)
                what = f"unit {unit.name}'s master, elements {start}-{stop} of each part"
                comm.all_gather_into(parts, mine.to(device), what=what, group=group)
            for r, values in enumerate(parts.split(stop - start)):
                full[r * part + start : r * part + stop].copy_(values)
            del mine, parts
    return full


@contextlib.contextmanager
def _master_of(state: TrainState, index: int) -> Iterator[Tensor]:
    """Unit `index`'s master partition, readable inside the block: a unit the swap file
    moves in pieces gives a copy read piece by piece, not the unit resident whole
    (master, moments and gradient)."""
    residence = state.residence
    if residence is not None and residence.holds(index) and residence.sub_group > 0:
        yield residence.master_copy(index, torch.float32)  # as `resident` gives them
        return
    with state.resident(index) as unit:
        yield unit.master
