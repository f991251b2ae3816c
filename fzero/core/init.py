"""Training as functions, part one: `init` builds this rank's `TrainState` from a model
and a plan, `state_dict` consolidates the trained weights from one. The step is
`fzero.train_step` (`fzero.core.step`); checkpoints are `fzero.checkpoint.save` and
`restore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm
from fzero.config import Config, load_config
from fzero.core.layout import gather_pieces, scatter_pieces
from fzero.core.precision import DTYPES, loss_scaler
from fzero.core.state import Counters, TrainState, UnitState, optimizer_partition
from fzero.optim import Optimizer, optimizer_from_name, schedule_from_name
from fzero.optim._schedules import Schedule
from fzero.partition import Plan

__all__ = [
    "check_optimizer",
    "config_for_plan",
    "full_master",
    "init",
    "optimizer_of",
    "schedule_of",
    "state_dict",
]

# ---- init ----------------------------------------------------------------------------------


def init(
    model: torch.nn.Module,
    plan: Plan,
    optimizer: Optimizer,
    *,
    precision: str = "fp32",
    config: Config | Mapping[str, Any] | str | None = None,
    seed: int | None = None,
) -> TrainState:
    """This rank's `TrainState` for `model` under `plan` (collective: every rank starts
    from rank 0's weights). `precision` is the compute dtype (`fp32`, `bf16`, `fp16`;
    masters are fp32). `config`'s `offload_optimizer.device: cpu` keeps masters and
    optimizer state in host memory. `seed` seeds the generator the steps draw from (default:
    the process generator's state now)."""
    if precision not in DTYPES:
        raise ValueError(f"precision is {precision!r}; allowed: {sorted(DTYPES)}")
    check_optimizer(optimizer)
    cfg = config_for_plan(config, plan)
    comm.init_distributed()
    _check_world(plan)
    rank, device, dtype = dist.get_rank(), comm.backend_device(), DTYPES[precision]
    host = _optimizer_device(cfg, device, plan.stage)
    named = dict(model.named_parameters())
    _check_model(plan, named)
    meta = [fqn for fqn, p in named.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"fzero.init needs the model's weights, but {len(meta)} parameter(s) are on the "
            f"meta device (first: {meta[0]!r}); build the model eagerly, or give the "
            "meta-device model to fzero.shard, which materialises it unit by unit"
        )
    units = []
    for unit in plan.units:
        flat = torch.zeros(unit.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for placement in unit.placements:
                value = named[placement.fqn].detach().reshape(-1).float().to(device)
                scatter_pieces(flat, value, placement)
        if plan.world_size > 1:
            dist.broadcast(flat, src=0)
        part = optimizer_partition(plan, unit, rank)
        if plan.stage < 3 or unit.persistent:
            params = flat if dtype == torch.float32 else flat.to(dtype)
            shares = dtype == torch.float32 and host == device
            master = params[part] if shares else flat[part].to(host, copy=True)
        else:
            master = flat[part].to(host, copy=True)
            params = None if dtype == torch.float32 and host == device else flat[part].to(dtype)
        numel = unit.numel if plan.stage < 2 else unit.shard_numel
        grad = torch.zeros(numel, dtype=torch.float32, device=device)
        units.append(UnitState(master, optimizer.init(master), params, grad))
    rng = torch.get_rng_state() if seed is None else _seeded(seed)
    scale = loss_scaler(cfg).init() if precision == "fp16" else None
    return TrainState(plan, rank, tuple(units), Counters(), scale, rng)


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
    """The config, which may leave the stage out (the plan has one) but not contradict it."""
    cfg = load_config(config if config is not None else {})
    stage = cfg.zero_optimization.stage
    if stage not in (0, plan.stage):
        raise ValueError(
            f"the config's zero_optimization.stage is {stage}; the plan's {plan.stage}: leave "
            "it out or make them agree"
        )
    return cfg


def _seeded(seed: int) -> Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def check_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; expected an fzero.optim optimizer "
            "(fzero.optim.adam, adamw, lamb, sgd)"
        )


def _check_world(plan: Plan) -> None:
    world = dist.get_world_size()
    if plan.world_size != world:
        raise ValueError(
            f"plan.world_size is {plan.world_size} but torch.distributed runs {world} ranks; "
            "plan for the world you run (fzero.partition.plan(..., world_size=W))"
        )


def _check_model(plan: Plan, named: Mapping[str, Tensor]) -> None:
    missing = [spec.fqn for spec in plan.manifest.tensors if spec.fqn not in named]
    changed = [
        f"{spec.fqn}: plan {spec.shape}, model {tuple(named[spec.fqn].shape)}"
        for spec in plan.manifest.tensors
        if spec.fqn in named and tuple(named[spec.fqn].shape) != spec.shape
    ]
    if missing or changed:
        raise ValueError(
            f"the model does not fit the plan: missing parameters {missing}, shapes differ "
            f"{changed}"
        )


def _optimizer_device(config: Config, device: torch.device, stage: int) -> torch.device:
    where = config.zero_optimization.offload_optimizer.device
    if where != "none" and stage == 0:
        raise ValueError(
            f"zero_optimization.offload_optimizer.device is {where!r} but the plan is stage 0; "
            "offload needs stage 1, 2 or 3"
        )
    if where == "nvme":
        raise ValueError(
            "zero_optimization.offload_optimizer.device is 'nvme'; train_step keeps the state "
            "in memory: allowed 'none' or 'cpu' (NVMe offload runs in the engine)"
        )
    return torch.device("cpu") if where == "cpu" else device


# ---- views of a state ------------------------------------------------------------------------


def state_dict(
    state: TrainState, *, module: torch.nn.Module | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """The consolidated weights from the fp32 masters, on rank 0 ({} elsewhere);
    collective. Every name of a tied tensor is a key. With `module`, its frozen
    parameters and buffers are added, in its own `state_dict` order."""
    result: dict[str, Tensor] = {}
    plan = state.plan
    for index, unit in enumerate(plan.units):
        full = full_master(state, index)
        if state.rank != 0:
            continue
        for pl in unit.placements:
            spec = plan.manifest[pl.fqn]
            tensor = gather_pieces(full, pl, spec.shape).to(dtype).clone()
            for name in (spec.fqn, *spec.aliases):
                result[name] = tensor
    if state.rank != 0:
        return {}
    if module is None:
        return result
    own = module.state_dict(keep_vars=True)
    return {k: result[k] if k in result else v.detach().clone() for k, v in own.items()}


def full_master(state: TrainState, index: int) -> Tensor:
    """Unit `index`'s whole fp32 master buffer, gathered on every rank (collective; a unit
    outside memory is read back first)."""
    device = comm.backend_device()
    with state.resident(index) as unit:
        if state.plan.stage == 0:
            return unit.master.to(device, copy=True)
        full = torch.empty(state.plan.units[index].numel, dtype=torch.float32, device=device)
        if state.plan.world_size > 1:
            comm.all_gather_into(full, unit.master.to(device).contiguous())
        else:
            full.copy_(unit.master)
    return full
