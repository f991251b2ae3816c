"""`TrainState`: one rank's whole training state as a value (flax's `TrainState`,
levanter's trainer state) — what a step takes and returns, and what a checkpoint is.

Per unit of the plan (`UnitState`), this rank holds:

- `master`: the fp32 weights of its optimizer partition (its shard at stages 1-3, the
  whole unit buffer at stage 0);
- `optim`: the optimizer's state over `master` (`fzero.optim`, e.g. `AdamState`);
- `params`: the compute-dtype parameters: the whole unit buffer at stages 0-2 and for
  stage-3 persistent units, this rank's shard otherwise (None where `master` serves:
  fp32 at stage 3);
- `grad`: the fp32 gradient accumulator (the whole buffer at stages 0-1, the shard at
  stages 2-3).

With fp32 compute, `master` may be a view of `params` (the same numbers, held once).
Besides the units: step counters, the fp16 loss-scale state and the random-number state
a step draws from. The plan, counters and loss scale are the pytree's static context, the
tensors (and optimizer step counts) its leaves:
`torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)` copies a state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fzero.optim import LossScaleState
from fzero.partition import Plan, Unit

__all__ = [
    "Counters",
    "KindPieces",
    "PieceSource",
    "SwappedUnits",
    "TrainState",
    "UnitState",
    "optimizer_partition",
    "owned_grad",
    "partition_numel",
]


class UnitState(NamedTuple):
    """One unit's tensors on this rank (see the module docstring)."""

    master: Tensor
    optim: Any
    params: Tensor | None
    grad: Tensor


class Counters(NamedTuple):
    """DeepSpeed's counters: optimizer steps taken, samples seen, micro-steps (forward +
    backward) run, steps skipped by an fp16 overflow, and the schedule's position."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    lr_steps: int = 0


class PieceSource(NamedTuple):
    """What a checkpoint load writes a swapped unit from, piece by piece: `fill(kind,
    start, out)` puts elements [start, start + len(out)) of `kind` ("master", an
    optimizer state field, "grad") into fp32 `out`; `optim` is the unit's optimizer
    state record (its scalars are kept: the step count seeds bf16 rounding); `init`,
    when given, makes the optimizer state of a master piece instead of `fill`."""

    fill: Callable[[str, int, Tensor], None]
    optim: Any
    init: Callable[[Tensor], Any] | None = None


class KindPieces(Protocol):
    """A swapped unit read piece by piece: `span(kind, begin, end)` yields elements
    [begin, end) of `kind` ("master", an optimizer state field, "grad") as stored, in
    consecutive parts, each valid until the next is asked for."""

    def span(self, kind: str, begin: int, end: int) -> Iterator[Tensor]: ...


class SwappedUnits(Protocol):
    """Where units' masters and optimizer states live when not in memory (the NVMe swap
    file, `fzero.core.residency`): `resident(i)` makes unit i's tensors readable inside
    the block; `store_next(i, unit)` writes a loaded unit where the next `commit()` makes
    it current; `check_usable()` raises when the file holds no single step;
    `state_dtype` is the dtype the file keeps the optimizer's moments in, `master_dtype`
    the masters', `grad_dtype` the gradient accumulators' (of the units whose
    accumulator it holds: `grad_in_file(i)`); `holds(i)`
    whether unit i lives there (a plan may keep some units in memory). With a
    `sub_group` above 0, checkpoints move units in pieces of that many elements instead:
    `pieces(i)` reads them, `store_pieces(i, ...)` is `store_next`'s counterpart,
    `master_copy(i, dtype)` the master to publish."""

    @property
    def state_dtype(self) -> torch.dtype: ...

    @property
    def master_dtype(self) -> torch.dtype: ...

    @property
    def grad_dtype(self) -> torch.dtype: ...

    @property
    def sub_group(self) -> int: ...

    def pieces(self, index: int) -> contextlib.AbstractContextManager[KindPieces]: ...

    def master_copy(self, index: int, dtype: torch.dtype) -> Tensor: ...

    def store_pieces(self, index: int, source: PieceSource, with_grad: bool) -> None: ...

    def holds(self, index: int) -> bool: ...

    def grad_in_file(self, index: int) -> bool: ...

    def resident(self, index: int) -> contextlib.AbstractContextManager[UnitState]: ...

    def store_next(self, index: int, unit: UnitState, with_grad: bool) -> None: ...

    def commit(self) -> None: ...

    def check_usable(self) -> None: ...


@dataclass(frozen=True)
class TrainState:
    """One rank's training state: `units` (one `UnitState` per unit of `plan`, this
    `rank`'s partitions), `counters`, `loss_scale` (fp16) and `rng` (the torch generator
    state the next step draws dropout from; None: the process's own generator).
    `residence` is None when every unit is in memory; with NVMe offload it is the swap
    file (see `SwappedUnits`), the `master` and `optim` tensors here of the units it
    holds are empty and `resident(i)` reads them. A step updates the file in place:
    like the buffers, it belongs to the state the step returns."""

    plan: Plan
    rank: int
    units: tuple[UnitState, ...]
    counters: Counters = field(default_factory=Counters)
    loss_scale: LossScaleState | None = None
    rng: Tensor | None = None
    residence: SwappedUnits | None = field(default=None, compare=False)

    @property
    def step(self) -> int:
        """Optimizer steps taken (`counters.global_steps`)."""
        return self.counters.global_steps

    def replace(self, **changes: Any) -> TrainState:
        """A copy with `changes` (fields by name)."""
        return replace(self, **changes)

    @contextlib.contextmanager
    def resident(self, index: int) -> Iterator[UnitState]:
        """Unit `index`'s tensors, readable inside the block (NVMe: read back first)."""
        if self.residence is None or not self.residence.holds(index):
            yield self.units[index]
        else:
            with self.residence.resident(index) as unit:
                yield unit


def _flatten(state: TrainState) -> tuple[list[Any], Any]:
    context = (state.plan, state.rank, state.counters, state.loss_scale, state.residence)
    return [state.units, state.rng], context


def _unflatten(children: Any, context: Any) -> TrainState:
    plan, rank, counters, loss_scale, residence = context
    units, rng = children
    return TrainState(
        plan,
        rank,
        tuple(UnitState(*u) for u in units),
        counters=counters,
        loss_scale=loss_scale,
        rng=rng,
        residence=residence,
    )


pytree.register_pytree_node(
    TrainState,
    _flatten,
    _unflatten,
    serialized_type_name="fzero.TrainState",
)


def optimizer_partition(plan: Plan, unit: Unit, rank: int) -> slice:
    """`rank`'s optimizer partition of `unit`'s flat buffer: the whole buffer at stage 0
    (every rank updates all of it), its shard (`Unit.shard_range`) at stages 1-3 (the
    unit's stage, `Plan.stage_of`)."""
    if plan.stage_of(unit) == 0:
        return slice(0, unit.numel)
    start, stop = plan.shard_range(unit, rank)
    return slice(start, stop)


def owned_grad(plan: Plan, unit: Unit, rank: int, grad: Tensor, for_update: bool = False) -> Tensor:
    """The part of `unit`'s reduced gradient accumulator `grad` that plan rank `rank`
    owns: its shard of a whole gradient (stages 0-1; at stage 0 with `for_update` all of
    it, which every rank updates), the accumulator (stages 2-3), or with an optimizer
    split finer than the gradients the block the boundary's reduce-scatter left in it
    (`Plan.optimizer_in_grads`). Each element is owned by one rank of the plan: what the
    gradient norm sums (a unit on its own axes, `Unit.shard_axes`, has replicas among
    the plan's ranks: there only its replica 0 owns its shard, the others nothing; with
    `for_update` each has its shard, which each updates alike)."""
    stage = plan.stage_of(unit)
    if not for_update and plan.unit_replica(unit, rank):
        return grad[:0]
    if stage >= 2:
        return grad if plan.optimizer_extra_size == 1 else grad[plan.optimizer_in_grads(unit, rank)]
    if for_update:
        return grad[optimizer_partition(plan, unit, rank)]
    return grad[slice(*plan.shard_range(unit, rank))]


def partition_numel(plan: Plan, unit: Unit, rank: int) -> int:
    """Elements of `rank`'s optimizer partition of `unit` (`optimizer_partition`)."""
    part = optimizer_partition(plan, unit, rank)
    return part.stop - part.start
