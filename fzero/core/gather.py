"""Stage 3 inside `fzero.train_step`: parameters gathered per unit while used.

A `loss_fn` gets, for each stage-3 parameter, a placeholder: a leaf tensor of the right
shape and dtype that holds one element (zero strides). While `loss_fn` and its backward
run, a torch-function mode swaps a placeholder, wherever an operation receives it, for
the unit's gathered parameter (an all-gather of every rank's shard, done once while the
unit stays gathered), linked to the placeholder by `_Bind` so its gradient arrives at the
placeholder. A saved-tensor hook keeps references instead of gathered values, so backward
gathers a unit again when it needs it. At most `max_live` elements stay gathered (least
recently used first out, never the unit in use).

The engine's rules, without hooks on the module (which `train_step` never sees): the
first step records the order units are first used in, forward and backward (`UseTrace`,
kept by the step function); later steps prefetch along it (all-gathers in flight for the
next `prefetch_numel` elements, within `max_live`), and when forward returns a unit stays
gathered only if backward uses it again within `max_reuse` elements of other units
(DeepSpeed's `stage3_max_reuse_distance`); the rest are released and gathered again.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fzero import comm
from fzero.core.groups import (
    check_even,
    gather_unit,
    groups_of,
    secondary_block,
)
from fzero.core.layout import gather_pieces
from fzero.core.quantize import quantized_all_gather
from fzero.partition import Placement, Plan

__all__ = [
    "PlaceholderGatherer",
    "UseTrace",
    "placeholder",
    "resolve_placeholder",
    "reuse_distance",
    "units_to_prefetch",
]

_RUNNING: list[PlaceholderGatherer] = []  # the gatherers of the steps running now


def resolve_placeholder(value: Any) -> Any:
    """A stage-3 placeholder of a step running now as its gathered parameter (for code
    that runs outside the step's operations, such as an activation-checkpoint
    recomputation); anything else as it is."""
    for gatherer in reversed(_RUNNING):
        if isinstance(value, Tensor) and id(value) in gatherer.placeholders:
            return gatherer.swap(value)
    return value


def units_to_prefetch(
    order: Sequence[int], start: int, numel: Callable[[int], int], budget: int
) -> list[int]:
    """The units of `order[start:]` within `budget` elements ahead, in order (DeepSpeed's
    `stage3_prefetch_bucket_size`: the unit that crosses the budget still counts). Both
    doors prefetch by it; each skips units already gathered and stops at its live bound."""
    chosen = []
    for index in order[start:]:
        if budget <= 0:
            break
        budget -= numel(index)
        chosen.append(index)
    return chosen


def reuse_distance(upcoming: Sequence[int], index: int, numel: Callable[[int], int]) -> int | None:
    """Elements of the other units used before unit `index` is used next in `upcoming`
    (DeepSpeed's `stage3_max_reuse_distance` compares it), or None if it is not used
    again. Both doors keep a unit gathered after forward by it."""
    if index not in upcoming:
        return None
    return sum(numel(i) for i in upcoming[: upcoming.index(index)])


@dataclass
class UseTrace:
    """The order stage-3 units are first used in, per phase, as recorded by the first
    step; `complete` once that step's backward has ended."""

    order: dict[str, list[int]] = field(default_factory=lambda: {"forward": [], "backward": []})
    complete: bool = False


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A leaf of `shape` that holds one element (every stride 0), requiring grad."""
    stand_in = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)
    return stand_in.requires_grad_()


class _Bind(torch.autograd.Function):
    """`value` in the graph in place of `stand_in`: the gradient goes to `stand_in`.
    torch.func-ready (`setup_context`, a generated vmap rule), so a `loss_fn` may use
    `vmap` and other transforms over the model."""

    generate_vmap_rule = True

    @staticmethod
    def forward(stand_in: Tensor, value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class PlaceholderGatherer:
    """Gathered stage-3 units of one step, by unit index, least recently used first.

    `shard(i)` gives unit i's compute-dtype shard on this rank; `placeholders` maps
    `id(placeholder)` to (unit index, placement, shape)."""

    def __init__(
        self,
        plan: Plan,
        shard: Callable[[int], Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_live: int,
        trace: UseTrace | None = None,
        prefetch_numel: int = 0,
        max_reuse: int = 0,
        quantized: bool = False,
    ) -> None:
        """`quantized`: gathers travel as int8 blocks (qwZ, `fzero.core.quantize`)."""
        self.plan, self.shard, self.dtype, self.device = plan, shard, dtype, device
        self.quantized = quantized
        check_even(plan, quantized, "zero_quantized_weights (qwZ)")
        self.max_live, self.prefetch_numel, self.max_reuse = max_live, prefetch_numel, max_reuse
        self.trace = trace if trace is not None else UseTrace()
        self.phase = "forward"
        self.placeholders: dict[int, tuple[int, Placement, tuple[int, ...]]] = {}
        self.live: collections.OrderedDict[int, Tensor] = collections.OrderedDict()
        self.inflight: dict[int, tuple[Tensor, Any]] = {}  # prefetched: (buffer, all-gather)
        self._by_storage: dict[int, int] = {}
        self.live_numel = 0
        self.peak_numel = 0
        self.gathers = 0
        self.groups = groups_of(plan)
        self.secondary: dict[int, Tensor] = {}  # hpZ: forward's gathers kept for backward

    def full(self, index: int) -> Tensor:
        """Unit `index`'s whole compute-dtype buffer (collective when not gathered)."""
        if index in self.live:
            self.live.move_to_end(index)
            full = self.live[index]
        elif index in self.inflight:
            full, work = self.inflight.pop(index)
            work.wait()
            self._add_live(index, full)
        else:
            numel = self.plan.units[index].numel
            self._make_room(numel)
            full = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._start_gather(index, full).wait()
            self.live_numel += numel
            self._add_live(index, full)
        self._record(index)
        self._prefetch_after(index)
        return full

    def _make_room(self, numel: int) -> None:
        while self.live and self.live_numel + numel > self.max_live:
            self.release(next(iter(self.live)))

    def _start_gather(self, index: int, full: Tensor) -> Any:
        self.gathers += 1
        what = f"parameters of unit {index} {self.plan.units[index].name!r}"
        if self.phase == "backward" and index in self.secondary:  # hpZ: within the group
            block, group = self.secondary[index], self.groups.secondary
            what += " (hpZ secondary)"
            return comm.all_gather_into(full, block, async_op=True, what=what, group=group)
        shard = self.shard(index).to(self.device, self.dtype)
        group = self.groups.shard
        if self.quantized:
            return quantized_all_gather(full, shard.contiguous(), group=group)
        if self.plan.world_size > 1:
            unit, world = self.plan.units[index], self.plan.world_size
            return gather_unit(full, shard.contiguous(), unit, world, what=what, group=group)
        full.copy_(shard)
        return _Done()

    def _add_live(self, index: int, full: Tensor) -> None:
        self.live[index] = full
        self._by_storage[full.untyped_storage().data_ptr()] = index
        self.peak_numel = max(self.peak_numel, self.live_numel)

    def _record(self, index: int) -> None:
        order = self.trace.order[self.phase]
        if not self.trace.complete and index not in order:
            order.append(index)

    def _prefetch_after(self, index: int) -> None:
        """Start gathering the units the trace uses next, up to `prefetch_numel` elements
        ahead, while the live total stays within `max_live` (the same on every rank)."""
        if not self.trace.complete or self.prefetch_numel <= 0:
            return
        order = self.trace.order[self.phase]
        if index not in order:
            return
        numel = self._numel
        for nxt in units_to_prefetch(order, order.index(index) + 1, numel, self.prefetch_numel):
            if nxt in self.live or nxt in self.inflight:
                continue
            if self.live_numel + numel(nxt) > self.max_live:
                break
            full = torch.empty(numel(nxt), dtype=self.dtype, device=self.device)
            self.inflight[nxt] = (full, self._start_gather(nxt, full))
            self.live_numel += numel(nxt)
            self.peak_numel = max(self.peak_numel, self.live_numel)

    def _numel(self, index: int) -> int:
        return self.plan.units[index].numel

    def end_forward(self) -> None:
        """Forward has returned: keep a unit gathered only if backward uses it again
        within `max_reuse` elements of other units (known once a step is recorded)."""
        self._drop_inflight()
        if not self.trace.complete:
            self.release_all()
        else:
            backward = self.trace.order["backward"]
            for index in list(self.live):
                distance = reuse_distance(backward, index, self._numel)
                if distance is None or distance > self.max_reuse:
                    self.release(index)
        self.phase = "backward"

    def end_step(self) -> None:
        """Backward has ended: release everything; the first step's trace is complete."""
        self._drop_inflight()
        self.release_all()
        self.secondary.clear()
        self.trace.complete = True

    def _drop_inflight(self) -> None:
        for index, (full, work) in list(self.inflight.items()):
            work.wait()  # issued on every rank: it completes, unused
            self.live_numel -= full.numel()
            del self.inflight[index]

    def release(self, index: int) -> None:
        full = self.live.pop(index)
        block = secondary_block(self.groups, full) if self.phase == "forward" else None
        if block is not None:
            self.secondary[index] = block
        del self._by_storage[full.untyped_storage().data_ptr()]
        self.live_numel -= full.numel()

    def release_all(self) -> None:
        for index in list(self.live):
            self.release(index)

    def tensor(self, index: int, placement: Placement, shape: tuple[int, ...]) -> Tensor:
        """One tensor of unit `index`, gathered (a view of the unit's buffer)."""
        return gather_pieces(self.full(index), placement, shape)

    def swap(self, value: Tensor) -> Tensor:
        """A placeholder becomes its gathered parameter; any other tensor is itself."""
        entry = self.placeholders.get(id(value))
        if entry is None:
            return value
        return _Bind.apply(value, self.tensor(*entry))

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor hook: a view of a gathered unit is kept as where it lies in it."""
        try:
            index = self._by_storage.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without plain storage
            return tensor
        if index is None:
            return tensor
        return (index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, packed: Any) -> Tensor:
        """Saved-tensor hook: the saved view, its unit gathered again if released."""
        if isinstance(packed, Tensor):
            return packed
        index, size, stride, offset = packed
        return self.full(index).as_strided(size, stride, offset)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The block is this gatherer's step, forward and backward (`resolve_placeholder`)."""
        _RUNNING.append(self)
        try:
            yield
        finally:
            _RUNNING.remove(self)

    def active(self) -> _Active:
        """The context inside which placeholders are swapped and saved views released."""
        return _Active(self)


class _Done:
    """A collective that already completed (one rank: a copy)."""

    def wait(self) -> None:
        return None


class _Swap(TorchFunctionMode):
    def __init__(self, gatherer: PlaceholderGatherer) -> None:
        super().__init__()
        self.gatherer = gatherer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        args, kwargs = pytree.tree_map_only(Tensor, self.gatherer.swap, (args, kwargs or {}))
        return func(*args, **kwargs)


class _Active:
    def __init__(self, gatherer: PlaceholderGatherer) -> None:
        self.gatherer = gatherer
        self._contexts: list[Any] = []

    def __enter__(self) -> PlaceholderGatherer:
        g = self.gatherer
        self._contexts = [_Swap(g), torch.autograd.graph.saved_tensors_hooks(g.pack, g.unpack)]
        for context in self._contexts:
            context.__enter__()
        return g

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
