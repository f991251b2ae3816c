"""What each kind of state is held in, casting a forward's inputs to the compute dtype,
the fp16 loss scale's setup, and the update over bf16 masters and optimizer states.

`Precision` says three dtypes: `compute` (the parameters forward and backward run in:
fp32, bf16 or fp16), `master` (the weights the optimizer updates: fp32, or bf16 — then,
in memory, the compute parameters themselves, held once) and `states` (the optimizer's
moments: fp32 or bf16) and `grads` (the gradient accumulators: fp32, or the compute
dtype when asked: DeepSpeed's `data_types.grad_accum_dtype`). Gradients are reduced in
fp32 (or `communication_data_type`) whatever these say; a half-precision accumulator
takes each micro-step's reduced gradient rounded into its sum, and the update widens it
to fp32 unit by unit.
An update over bf16 tensors runs in fp32 (`widened`) and rounds its results back
stochastically, each tensor's elements from a seed that depends on the step, the
tensor's name and the kind of state only, at their position in the tensor
(`fzero.optim.rounding_seed`): the same at every plan, stage and world size, and again
on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import native, partition
from fzero.config import Config
from fzero.optim import (
    ROUNDING_STRIDE,
    DynamicLossScale,
    StaticLossScale,
    bf16_stochastic,
    rounding_seed,
)
from fzero.partition import Memory, Plan, Unit

__all__ = [
    "DTYPES",
    "STATE_DTYPES",
    "Precision",
    "cast_floats",
    "gradient_wire_dtype",
    "init_state",
    "loss_scaler",
    "memory_of",
    "narrowed",
    "precision_of",
    "round_bf16_",
    "round_range_",
    "round_spans_into",
    "rounding_spans",
    "run_plan",
    "widened",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Precision(NamedTuple):
    """The dtypes of a run (see the module docstring). DeepSpeed's `bf16` block spells
    them as `enabled` (compute), `bf16_master_weights_and_grads` (master) and
    `bf16_optimizer_states` (states), and `data_types.grad_accum_dtype` says `grads`;
    `fzero.Precision("bf16", master="bf16", states="bf16", grads="bf16")` is the same
    in fzero's own API."""

    compute: str = "fp32"
    master: str = "fp32"
    states: str = "fp32"
    grads: str = "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute]

    @property
    def master_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.master]

    @property
    def state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.states]

    @property
    def grad_dtype(self) -> torch.dtype:
        return DTYPES[self.grads]

    def check(self) -> Precision:
        """This precision, or a ValueError naming the field, its value and what is allowed."""
        if self.compute not in DTYPES:
            raise ValueError(f"precision compute is {self.compute!r}; allowed: {sorted(DTYPES)}")
        for name in ("master", "states"):
            value = getattr(self, name)
            if value not in STATE_DTYPES:
                raise ValueError(f"precision {name} is {value!r}; allowed: {sorted(STATE_DTYPES)}")
        if self.master == "bf16" and self.compute != "bf16":
            raise ValueError(
                f"precision master is 'bf16' but compute is {self.compute!r}: bf16 master "
                "weights are the bf16 parameters themselves, so compute must be 'bf16' too"
            )
        if self.grads not in DTYPES:
            raise ValueError(f"precision grads is {self.grads!r}; allowed: {sorted(DTYPES)}")
        if self.grads not in ("fp32", self.compute):
            raise ValueError(
                f"precision grads (DeepSpeed's data_types.grad_accum_dtype) is "
                f"{self.grads!r} but compute is {self.compute!r}: gradients accumulate in "
                "fp32 or in the compute dtype (DeepSpeed's ZeRO accumulates in the model's "
                "dtype whatever this key says, and refuses other mixes without ZeRO); set "
                f"'fp32' or {self.compute!r}"
            )
        return self


def precision_of(config: Config, given: str | Precision | None = None) -> Precision:
    """The precision a door runs: `given` (a `Precision`, or a compute dtype's name whose
    master and states the config's `bf16` block says), else the config's."""
    if isinstance(given, Precision):
        return given.check()
    if isinstance(given, tuple) or (given is not None and not isinstance(given, str)):
        raise TypeError(f"precision is {given!r}; give a dtype name or a fzero.Precision")
    bf16 = config.bf16
    compute = given or ("fp16" if config.fp16.enabled else "bf16" if bf16.enabled else "fp32")
    return Precision(
        compute,
        master="bf16" if bf16.enabled and bf16.bf16_master_weights_and_grads else "fp32",
        states="bf16" if bf16.enabled and bf16.bf16_optimizer_states else "fp32",
        grads=config.data_types.grad_accum_dtype or "fp32",
    ).check()


# DeepSpeed's offload devices as memory kinds (`partition.Memory`)
_MEMORY_KINDS = {None: "device", "none": "device", "cpu": "host", "nvme": "nvme"}


def memory_of(config: Config, precision: Precision) -> Memory:
    """Where the config's `offload_param` and `offload_optimizer` put the states, and the
    master and state dtypes `precision` says, as a plan states them (`partition.Memory`)."""
    zero = config.zero_optimization
    return Memory(
        params=_MEMORY_KINDS[zero.offload_param.device],
        optimizer=_MEMORY_KINDS[zero.offload_optimizer.device],
        master=precision.master,
        states=precision.states,
        grads=precision.grads,
    )


def run_plan(
    plan: Plan, config: Config, precision: Precision, *, door: str = ""
) -> tuple[Plan, Precision]:
    """The plan a door runs and its precision. Where the plan's states live and their
    dtypes are the plan's (`Plan.memory`); what it leaves at the defaults, the config's
    offload devices and `precision`'s master and state dtypes say (`memory_of`), and a
    field both state differently is an error naming it. The compute dtype is
    `precision`'s; the master and state dtypes the plan's (so a strategy may say bf16
    states). A `PlanError` also names what no plan may say (the optimizer off the device
    at stage 0, parameters off it below stage 3, fp16 sums in the swap file) and, for
    a functional `door` (its name: `fzero.init`, `train_step`), stage 3's parameter
    shards off the device, which only the engine places (they would stay in memory)."""
    said_by = "the config (offload_param, offload_optimizer, bf16) or precision"
    plan = partition.with_memory(plan, memory_of(config, precision), said_by)
    memory = plan.memory
    for unit in plan.units:
        if plan.grads_dtype(unit) not in ("fp32", precision.compute) and unit.grads_dtype:
            raise partition.PlanError(
                f"unit {unit.name!r}: grads_dtype is {unit.grads_dtype!r} but the compute "
                f"dtype is {precision.compute!r}: a gradient accumulator is fp32 or in the "
                "compute dtype"
            )
        if unit.master_dtype == "bf16" and precision.compute != "bf16":
            raise partition.PlanError(
                f"unit {unit.name!r}: master_dtype is 'bf16' but the compute dtype is "
                f"{precision.compute!r}: bf16 masters are the bf16 parameters themselves, "
                "so compute must be bf16 too (DeepSpeed's bf16.enabled)"
            )
    placed = [(u, plan.params_memory(u)) for u in plan.units if plan.params_memory(u) != "device"]
    if door and placed:
        unit, where = placed[0]
        said = (
            f"memory.params is {where!r} (DeepSpeed's zero_optimization.offload_param.device)"
            if unit.params_memory is None
            else f"unit {unit.name!r}'s params_memory is {where!r}"
        )
        raise partition.PlanError(
            f"{door}: {said}, but the functional doors keep stage 3's parameter shards in "
            "memory with the compute; the engine (fzero.shard, fzero.initialize) places "
            "them on the host or in a swap file. Use the engine, or keep them on the "
            "device (memory.params 'device', offload_param 'none')"
        )
    return plan, Precision(precision.compute, memory.master, memory.states, memory.grads).check()


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in `value` (nested tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def loss_scaler(config: Config) -> DynamicLossScale | StaticLossScale:
    """The fp16 block's loss scaling: dynamic when `loss_scale` is 0, else static."""
    fp16 = config.fp16
    if fp16.loss_scale:
        return StaticLossScale(fp16.loss_scale)
    return DynamicLossScale(
        initial_scale_power=fp16.initial_scale_power,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


# ---- bf16 masters and optimizer states ------------------------------------------------------


def init_state(optimizer: Any, master: Tensor, dtype: torch.dtype) -> Any:
    """The optimizer's initial state over `master`, its tensors in `dtype`."""
    state = optimizer.init(master)
    fields = {
        k: v.to(dtype)
        for k, v in state._asdict().items()
        if isinstance(v, Tensor) and v.is_floating_point() and v.dtype != dtype
    }
    return state._replace(**fields) if fields else state


def rounding_spans(
    unit: Unit, index: int, step: int, kind: int, lo: int, hi: int
) -> list[tuple[int, int, int]]:
    """Elements [lo, hi) of unit `index`'s buffer as spans `(a, b, seed)`, a and b counted
    from `lo`: rounding those elements with `bf16_stochastic(x[a:b], seed)` draws for
    each element of a tensor the bits `fzero.optim.rounding_seed(step, fqn, kind)` gives
    it at its position in the tensor (so the same at any plan, stage, unit or world
    size); padding between and after tensors draws from the unit's index (its values
    are zeros, which round to zero)."""
    spans: list[tuple[int, int, int]] = []
    pad = ((step * 1_000_003 + index) * 16 + kind) * 0x2545F4914F6CDD1D

    def gap(a: int, b: int) -> None:
        spans.append((a - lo, b - lo, (pad + a * ROUNDING_STRIDE) % 2**64))

    at = lo
    for offset, numel, start, fqn in _pieces(unit):
        a, b = max(lo, offset), min(hi, offset + numel)
        if a >= b:
            continue
        if at < a:
            gap(at, a)
        seed = rounding_seed(step, fqn, kind) + (start + a - offset) * ROUNDING_STRIDE
        spans.append((a - lo, b - lo, seed % 2**64))
        at = b
    if at < hi:
        gap(at, hi)
    return spans


def _pieces(unit: Unit) -> list[tuple[int, int, int, str]]:
    """The unit's tensor pieces `(offset in the buffer, numel, start in the tensor, fqn)`,
    in buffer order."""
    return sorted(
        (pc.offset, pc.numel, pc.start, pl.fqn) for pl in unit.placements for pc in pl.pieces
    )


def round_range_(
    x: Tensor, out: Tensor, *, unit: Unit, index: int, step: int, kind: int, start: int
) -> None:
    """fp32 `x`, elements [start, start + x.numel()) of unit `index`'s buffer, rounded
    stochastically into bf16 `out` with the documented seeds (`rounding_spans`)."""
    spans = rounding_spans(unit, index, step, kind, start, start + x.numel())
    round_spans_into(x, out, spans)


def round_spans_into(x: Tensor, out: Tensor, spans: list[tuple[int, int, int]] | None) -> Tensor:
    """fp32 `x` into bf16 `out` (both flat, or viewed so): stochastically, elements
    [a, b) of each of `spans` from its seed (`rounding_spans`), or with `spans` None to
    nearest, as `Tensor.to` rounds; returns `out`."""
    if spans is None:
        return out.copy_(x)
    flat, into = x.reshape(-1), out.view(-1)
    for a, b, seed in spans:
        round_bf16_(flat[a:b], into[a:b], seed)
    return out


def round_bf16_(x: Tensor, out: Tensor, seed: int) -> None:
    """fp32 `x` rounded stochastically into bf16 `out` (native kernel where available)."""
    seed %= 2**64
    if native.available(x.device):
        native.bf16_stochastic_(x, out, seed)
    else:
        bf16_stochastic(x, seed, out=out)


def narrowed(state: Any) -> bool:
    """Whether a master or optimizer state (a tensor or a NamedTuple of them) holds bf16."""
    if isinstance(state, Tensor):
        return state.dtype == torch.bfloat16
    return any(
        isinstance(v, Tensor) and v.dtype == torch.bfloat16 for v in state._asdict().values()
    )


@contextlib.contextmanager
def widened(rt: Any, *, step: int, start: int) -> Iterator[None]:
    """Inside the block, `rt.master` and `rt.state`'s bf16 tensors are fp32 copies; on a
    normal exit the results are rounded back stochastically into the bf16 storage (the
    same tensors as before) and `rt.state` keeps the new non-tensor fields (a step
    count). `start`: the partition's first element in its unit (for the seeds)."""
    master, state = rt.master, rt.state
    wide_master = master.float() if master.dtype == torch.bfloat16 else master
    fields: Mapping[str, Any] = state._asdict()
    narrow = [k for k, v in fields.items() if isinstance(v, Tensor) and v.dtype == torch.bfloat16]
    rt.master = wide_master
    rt.state = state._replace(**{k: fields[k].float() for k in narrow})
    try:
        yield
    except BaseException:
        rt.master, rt.state = master, state  # the bf16 storage was not touched
        raise
    where = {"unit": rt.unit, "index": rt.index, "step": step, "start": start}
    if wide_master is not master:
        round_range_(rt.master, master, kind=0, **where)
    new = rt.state._asdict()
    for kind, k in enumerate(narrow, start=1):
        round_range_(new[k], fields[k], kind=kind, **where)
    rt.master, rt.state = master, rt.state._replace(**{k: fields[k] for k in narrow})


_WIRE_DTYPES = {
    None: torch.float32,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def gradient_wire_dtype(config: Config) -> torch.dtype:
    """The dtype gradients travel in when reduced over ranks: the config's
    `communication_data_type` (DeepSpeed's key), fp32 when it is not given."""
    return _WIRE_DTYPES[config.communication_data_type]
