"""Stage 3 inside `fzero.train_step`: parameters gathered per unit while used, driven by
placeholders (the engine drives the same `Gatherer` by module hooks: `fzero.core.stage3`).

A `loss_fn` gets, for each stage-3 parameter, a placeholder: a leaf tensor of the right
shape and dtype that holds one element (zero strides). While `loss_fn` and its backward
run, a torch-function mode swaps a placeholder, wherever an operation receives it, for
the unit's gathered parameter (`Gatherer.use`: gathered once while the unit stays
gathered), linked to the placeholder by `_Bind` so its gradient arrives at the
placeholder. A saved-tensor hook keeps references instead of gathered values, so backward
gathers a unit again when it needs it. With no module hooks to release by, a gather for
use releases the least recently used units to stay within `max_live` (never the unit in
use).

The `Gatherer` (`fzero.core.gathering`) decides the rest as it does for the engine: the
first step records the order units are first used in, forward and backward (`UseTrace`,
kept by the step function); later steps prefetch along it, and when forward returns a
unit stays gathered only if its next use is within `max_reuse` elements of other units
(DeepSpeed's `stage3_max_reuse_distance`); the rest are released and gathered again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fzero.core.gathering import Gatherer, GatherSettings, ShardSource, UseTrace
from fzero.core.layout import gather_pieces
from fzero.partition import Placement, Plan

__all__ = [
    "Placeholders",
    "StateShards",
    "placeholder",
    "resolve_placeholder",
]

_RUNNING: list[Placeholders] = []  # the placeholders of the steps running now


def resolve_placeholder(value: Any) -> Any:
    """A stage-3 placeholder of a step running now as its gathered parameter (for code
    that runs outside the step's operations, such as an activation-checkpoint
    recomputation); anything else as it is."""
    for gatherer in reversed(_RUNNING):
        if isinstance(value, Tensor) and id(value) in gatherer.placeholders:
            return gatherer.swap(value)
    return value


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


class Placeholders:
    """Stage-3 units of one call, gathered while its placeholders are used.

    `shards` gives each unit's compute-dtype shard on this rank; `placeholders` maps
    `id(placeholder)` to (unit index, placement, shape)."""

    def __init__(
        self,
        plan: Plan,
        shards: ShardSource,
        *,
        dtype: torch.dtype,
        device: torch.device,
        settings: GatherSettings,
        trace: UseTrace | None = None,
    ) -> None:
        self.gatherer = Gatherer(
            plan,
            shards,
            dtype=dtype,
            device=device,
            settings=replace(settings, evict=True),
            trace=trace,
            bind=self._bound,
            unbind=self._unbound,
        )
        self.placeholders: dict[int, tuple[int, Placement, tuple[int, ...]]] = {}
        self._by_storage: dict[int, int] = {}  # gathered buffers: storage -> unit
        self._storage_of: dict[int, int] = {}
        self.gatherer.begin_phase("forward")

    # what a call reports and `eval_step` keeps between calls
    @property
    def live(self) -> Any:
        """The gathered units (and those on their way), least recently used first."""
        return self.gatherer.live

    @property
    def live_numel(self) -> int:
        return self.gatherer.live_numel

    @property
    def peak_numel(self) -> int:
        return self.gatherer.peak_numel

    @property
    def gathers(self) -> int:
        return self.gatherer.gathers

    def _bound(self, index: int, full: Tensor) -> None:
        key = full.untyped_storage().data_ptr()
        self._by_storage[key], self._storage_of[index] = index, key

    def _unbound(self, index: int) -> None:
        key = self._storage_of.pop(index, None)
        if key is not None:
            del self._by_storage[key]

    def full(self, index: int) -> Tensor:
        """Unit `index`'s whole compute-dtype buffer (collective when not gathered)."""
        return self.gatherer.use(index)

    def widen(self, max_live: int) -> None:
        """Let every unit stay gathered (a call that needs the whole model at once)."""
        self.gatherer.widen(max_live)

    def end_forward(self) -> None:
        """Forward has returned: keep a unit gathered only if its next use is within
        `max_reuse` elements of other units (known once a step is recorded)."""
        gatherer = self.gatherer
        gatherer.drop_prefetched()
        if not gatherer.trace.complete:
            gatherer.release_all()
        else:
            for index in list(gatherer.live):
                if not gatherer.keeps_after_forward(index):
                    gatherer.release(index)
        gatherer.end_phase()
        gatherer.begin_phase("backward")

    def end_step(self) -> None:
        """The call's passes have ended: release everything; the phase is recorded."""
        gatherer = self.gatherer
        gatherer.drop_prefetched()
        gatherer.release_all()
        gatherer.secondary.clear()
        gatherer.end_phase()
        if gatherer.phase == "forward":  # no backward pass of fzero's (`grad_fn`)
            gatherer.trace.recorded.add("backward")

    def release(self, index: int) -> None:
        self.gatherer.release(index)

    def release_all(self) -> None:
        self.gatherer.release_all()

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
        """The block is this call's step, forward and backward (`resolve_placeholder`)."""
        _RUNNING.append(self)
        try:
            yield
        finally:
            _RUNNING.remove(self)

    def active(self) -> _Active:
        """The context inside which placeholders are swapped and saved views released."""
        return _Active(self)


class StateShards:
    """A `TrainState`'s stage-3 shards as a `ShardSource`: each unit's compute-dtype
    parameters, or its master where that serves."""

    def __init__(self, units: Sequence[Any]) -> None:
        self.units = units

    def on_disk(self, index: int) -> bool:
        return False

    def shard(self, index: int) -> Tensor:
        unit = self.units[index]
        return unit.params if unit.params is not None else unit.master

    def read(self, index: int, into: Tensor) -> Any:
        raise NotImplementedError("a TrainState's shards are in memory, never read")

    def wait_read(self, ticket: Any) -> None:
        raise NotImplementedError("a TrainState's shards are in memory, never read")

    def abandon_read(self, ticket: Any) -> None:
        raise NotImplementedError("a TrainState's shards are in memory, never read")


class _Swap(TorchFunctionMode):
    def __init__(self, gatherer: Placeholders) -> None:
        super().__init__()
        self.gatherer = gatherer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        args, kwargs = pytree.tree_map_only(Tensor, self.gatherer.swap, (args, kwargs or {}))
        return func(*args, **kwargs)


class _Active:
    def __init__(self, gatherer: Placeholders) -> None:
        self.gatherer = gatherer
        self._contexts: list[Any] = []

    def __enter__(self) -> Placeholders:
        g = self.gatherer
        self._contexts = [_Swap(g), torch.autograd.graph.saved_tensors_hooks(g.pack, g.unpack)]
        for context in self._contexts:
            context.__enter__()
        return g

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
