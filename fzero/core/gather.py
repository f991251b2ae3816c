"""Stage 3 inside `fzero.train_step`: parameters gathered per unit while used.

A `loss_fn` gets, for each stage-3 parameter, a placeholder: a leaf tensor of the right
shape and dtype that holds one element (zero strides). While `loss_fn` and its backward
run, a torch-function mode swaps a placeholder, wherever an operation receives it, for
the unit's gathered parameter (an all-gather of every rank's shard, done once while the
unit stays gathered), linked to the placeholder by `_Bind` so its gradient arrives at the
placeholder. A saved-tensor hook keeps references instead of gathered values, so backward
gathers a unit again when it needs it. At most `max_live` elements stay gathered (least
recently used first out, never the unit in use), and none once the forward has returned:
the same promise the engine's module hooks keep (`fzero.engine._stage3`), without hooks on
the module, which `train_step` never sees.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fzero import comm
from fzero.core.layout import gather_pieces
from fzero.partition import Placement, Plan

__all__ = ["PlaceholderGatherer", "placeholder"]


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
    ) -> None:
        self.plan, self.shard, self.dtype, self.device = plan, shard, dtype, device
        self.max_live = max_live
        self.placeholders: dict[int, tuple[int, Placement, tuple[int, ...]]] = {}
        self.live: collections.OrderedDict[int, Tensor] = collections.OrderedDict()
        self._by_storage: dict[int, int] = {}
        self.live_numel = 0
        self.peak_numel = 0
        self.gathers = 0

    def full(self, index: int) -> Tensor:
        """Unit `index`'s whole compute-dtype buffer (collective when not gathered)."""
        if index in self.live:
            self.live.move_to_end(index)
            return self.live[index]
        numel = self.plan.units[index].numel
        while self.live and self.live_numel + numel > self.max_live:
            self.release(next(iter(self.live)))
        shard = self.shard(index).to(self.device, self.dtype)
        full = torch.empty(numel, dtype=self.dtype, device=self.device)
        if self.plan.world_size > 1:
            comm.all_gather_into(full, shard.contiguous())
        else:
            full.copy_(shard)
        self.live[index] = full
        self._by_storage[full.untyped_storage().data_ptr()] = index
        self.live_numel += numel
        self.peak_numel = max(self.peak_numel, self.live_numel)
        self.gathers += 1
        return full

    def release(self, index: int) -> None:
        full = self.live.pop(index)
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

    def active(self) -> _Active:
        """The context inside which placeholders are swapped and saved views released."""
        return _Active(self)


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
