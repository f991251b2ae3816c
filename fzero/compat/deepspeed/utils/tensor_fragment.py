"""DeepSpeed's `safe_get_full_*` / `safe_set_full_*` over an fzero engine's shards.

Each takes a module parameter an fzero engine trains and is collective (every rank
calls it, as DeepSpeed's are under ZeRO-3): the whole fp32 master, gradient or
optimizer-state tensor is gathered from the ranks' partitions, or a whole value is
written into them. A parameter no engine trains gives None (DeepSpeed's answer for a
parameter without a ZeRO mapping). `safe_get_full_grad` is the reduced fp32 gradient
the next step applies, unscaled, between the backward of an accumulation boundary and
`step()`. The `safe_*_local_*` variants (DeepSpeed's ZeRO-3 shard views) and
`safe_set_full_grad` are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from fzero.core.groups import gather_optimizer_shards
from fzero.core.layout import UnitRuntime, gather_pieces, scatter_pieces
from fzero.engine import Engine
from fzero.partition import Placement

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]


def _locate(param: torch.nn.Parameter) -> tuple[Any, Any, Any, tuple[int, ...]] | None:
    """(engine, unit runtime, placement, shape) of a trained parameter, else None."""
    ref = getattr(param, "_fzero_engine", None)
    engine = ref() if ref is not None else None
    if engine is None:
        return None
    for rt in engine.units:
        for p, placement, shape in rt.params:
            if p is param:
                return engine, rt, placement, shape
    return None


def _locate_for(param: torch.nn.Parameter, value: Tensor) -> Any:
    """`_locate(param)`, checking that `value` is a whole tensor of its shape."""
    found = _locate(param)
    if found is not None and tuple(value.shape) != tuple(found[3]):
        raise ValueError(
            f"value has shape {tuple(value.shape)}; the parameter is {tuple(found[3])}"
        )
    return found


@contextmanager
def _resident(engine: Engine, rt: UnitRuntime, write_back: bool) -> Iterator[None]:
    with engine.residency.resident(rt, write_back=write_back):
        yield


def _full(engine: Engine, rt: UnitRuntime, part: Tensor, what: str) -> Tensor:
    """The unit's whole buffer from each rank's partition `part`, gathered over the
    plan's ranks (a MiCS/HSDP plan's shard group, not every process; uneven shards at
    their sizes)."""
    plan = engine.plan
    if plan.stage_of(rt.unit) == 0 or plan.world_size == 1:
        return part.detach().to(torch.float32, copy=True)
    full = torch.empty(rt.unit.numel, dtype=torch.float32, device=engine.device)
    shard = part.detach().to(engine.device, torch.float32).contiguous()
    gather_optimizer_shards(full, shard, plan, rt.index, engine.groups, what=what, async_op=False)
    return full


def _write(
    engine: Engine, rt: UnitRuntime, part: Tensor, placement: Placement, value: Tensor
) -> None:
    """Write a whole tensor's `value` into its pieces of the partitions `part`."""
    full = _full(engine, rt, part, "deepspeed.utils.safe_set_full_*")
    scatter_pieces(full, value.detach().reshape(-1).to(full), placement)
    part.copy_(full[engine.partition(rt.unit)] if engine.plan.stage_of(rt.unit) else full)


def _state_tensor(rt: Any, key: str) -> Tensor:
    state = rt.state
    fields = [f for f in getattr(state, "_fields", ()) if isinstance(getattr(state, f), Tensor)]
    if key not in fields:
        raise KeyError(
            f"optimizer state key {key!r} is not held for this parameter; "
            f"allowed: {fields} (fzero's names are DeepSpeed's and torch's)"
        )
    return getattr(state, key)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Tensor | None:
    """The whole fp32 master of `param` (collective), or None if no engine trains it."""
    found = _locate(param)
    if found is None:
        return None
    engine, rt, placement, shape = found
    with _resident(engine, rt, write_back=False):
        full = _full(engine, rt, rt.master, "deepspeed.utils.safe_get_full_fp32_param")
        return gather_pieces(full, placement, shape).clone()


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: Tensor) -> None:
    """Make `value` (the whole tensor) `param`'s fp32 master and its compute copy;
    collective. Nothing happens for a parameter no engine trains (as DeepSpeed)."""
    found = _locate_for(param, value)
    if found is None:
        return
    engine, rt, placement, _ = found
    with torch.no_grad(), _resident(engine, rt, write_back=True):
        _write(engine, rt, rt.master, placement, value)
        engine.publish_master(rt)
    engine.finish_publish()


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Tensor | None:
    """The whole optimizer state `optim_state_key` (e.g. "exp_avg") of `param`;
    collective. None if no engine trains it."""
    found = _locate(param)
    if found is None:
        return None
    engine, rt, placement, shape = found
    with _resident(engine, rt, write_back=False):
        part = _state_tensor(rt, optim_state_key)
        full = _full(engine, rt, part, "deepspeed.utils.safe_get_full_optimizer_state")
        return gather_pieces(full, placement, shape).clone()


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: Tensor, optim_state_key: str
) -> None:
    """Set `param`'s whole optimizer state `optim_state_key` to `value`; collective."""
    found = _locate_for(param, value)
    if found is None:
        return
    engine, rt, placement, _ = found
    with torch.no_grad(), _resident(engine, rt, write_back=True):
        _write(engine, rt, _state_tensor(rt, optim_state_key), placement, value)


def _refused(name: str) -> Any:
    def refuse(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(
            f"deepspeed.utils.{name} is not supported by fzero; the safe_get_full_* / "
            "safe_set_full_*_param/_optimizer_state functions are"
        )

    refuse.__name__ = name
    return refuse


def safe_get_full_grad(param: torch.nn.Parameter) -> Tensor | None:
    """`param.grad` when it holds one; else the reduced, unscaled fp32 gradient the next
    step applies (collective), between the backward of an accumulation boundary and
    `step()`; None for a parameter no engine trains."""
    if param.grad is not None:
        return param.grad
    found = _locate(param)
    if found is None:
        return None
    engine, rt, placement, shape = found
    if engine.residency.grad_on_disk(rt.index):
        raise NotImplementedError(
            "deepspeed.utils.safe_get_full_grad with gradients swapped to NVMe "
            "(offload_optimizer nvme at stage 2/3) is not supported by fzero"
        )
    if engine.plan.optimizer_extra_size > 1:
        raise NotImplementedError(
            "deepspeed.utils.safe_get_full_grad with the optimizer state split over more axes "
            f"than the gradients ({engine.plan.mesh.shard}) is not supported by fzero: the "
            "gradients are reduced across the extra axes only at the step"
        )
    stage, what = engine.plan.stage_of(rt.unit), "deepspeed.utils.safe_get_full_grad"
    if stage == 0:
        full = rt.grad.detach().to(torch.float32, copy=True)
    else:  # ZeRO-1's whole accumulator is reduced into each rank's shard only
        owned = rt.grad[engine.partition(rt.unit)] if stage == 1 else rt.grad
        full = _full(engine, rt, owned, what)
    scale = engine.loss_scale_state.scale if engine.loss_scale_state is not None else 1.0
    return gather_pieces(full, placement, shape).clone() / scale


safe_set_full_grad = _refused("safe_set_full_grad")
safe_update_full_grad_vectorized = _refused("safe_update_full_grad_vectorized")
safe_get_local_fp32_param = _refused("safe_get_local_fp32_param")
safe_get_local_grad = _refused("safe_get_local_grad")
safe_get_local_optimizer_state = _refused("safe_get_local_optimizer_state")
safe_set_local_fp32_param = _refused("safe_set_local_fp32_param")
safe_set_local_grad = _refused("safe_set_local_grad")
safe_set_local_optimizer_state = _refused("safe_set_local_optimizer_state")
