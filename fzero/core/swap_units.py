"""The NVMe residency as a `TrainState`'s `SwappedUnits` (`fzero.core.state`): what
checkpoints and `train_step` reach a swap file's units through, over the `Residency`
the engine and `fzero.init` build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from fzero.core.layout import UnitRuntime
from fzero.core.residency import Residency
from fzero.core.state import PieceSource, UnitState
from fzero.core.swap_pieces import PieceReader, master_copy, store_in_pieces

__all__ = ["SwapFileUnits"]


class SwapFileUnits:
    """The NVMe residency as a `TrainState`'s `SwappedUnits`: units by index (checkpoints
    read and write them through it, one unit in memory at a time), and the runtime
    records (`units`: each unit's current slot) a step updates them through."""

    def __init__(self, residency: Residency, units: list[UnitRuntime]) -> None:
        self.residency, self.units = residency, units

    @contextlib.contextmanager
    def resident(self, index: int) -> Iterator[UnitState]:
        rt = self.units[index]
        with self.residency.resident(rt, write_back=False):
            yield UnitState(rt.master, rt.state, None, rt.grad)

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the file holds the masters in (`resident` gives fp32)."""
        return self.residency.master_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype the file holds the gradient accumulators in (`resident` gives fp32)."""
        return self.residency.grad_dtype

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype the file holds the optimizer's moments in (`resident` gives fp32)."""
        return self.residency.state_dtype

    def grad_in_file(self, index: int) -> bool:
        """Whether unit `index`'s gradient accumulator lives in the file (else in the
        state's own buffer, in the plan's `grads_dtype`)."""
        return self.residency.grad_on_disk(index)

    def holds(self, index: int) -> bool:
        """Whether unit `index` lives in the file (else in the state's own buffers)."""
        return self.residency.holds(index)

    @property
    def sub_group(self) -> int:
        """Elements per piece checkpoints move a unit in (`pieces`, `store_pieces`); 0:
        whole units (`resident`, `store_next`)."""
        return self.residency.sub_group

    @contextlib.contextmanager
    def pieces(self, index: int) -> Iterator[PieceReader]:
        """Unit `index`'s kinds readable piece by piece inside the block ([Note:
        checkpoints in pieces])."""
        reader = PieceReader(self.residency, self.units[index])
        try:
            yield reader
        finally:
            reader.close()

    def master_copy(self, index: int, dtype: torch.dtype) -> Tensor:
        """Unit `index`'s current master in `dtype`, read piece by piece."""
        return master_copy(self.residency, self.units[index], dtype)

    def store_next(self, index: int, unit: UnitState, with_grad: bool) -> None:
        """Write `unit` to the other slot of unit `index`'s regions (current after
        `commit`); memory keeps none of it."""
        rt = self.units[index]
        self._overwriting()
        rt.master, rt.state = unit.master, unit.optim
        if with_grad and self.residency.grads_on_disk:
            rt.grad = unit.grad
        self.residency.write_next_slot(rt, with_grad=with_grad)

    def store_pieces(self, index: int, source: PieceSource, with_grad: bool) -> None:
        """`store_next` piece by piece from `source` ([Note: checkpoints in pieces]);
        with `with_grad` the gradient accumulator too."""
        self._overwriting()
        store_in_pieces(self.residency, self.units[index], source, with_grad)

    def _overwriting(self) -> None:
        """With one slot, the file holds no single step until `commit`: say so first."""
        if self.residency.slots == 1 and not self.residency.broken:
            self.residency.broken = (
                f"a checkpoint load overwrote units in place in {self.residency.nvme.path} "
                "(commit 'in_place') and did not finish; load a checkpoint again to go on"
            )

    def commit(self) -> None:
        """Make what `store_next` wrote current, every unit at once (after every rank
        has written its part): the file holds the stored step from now on."""
        for rt in self.units:
            if self.residency.holds(rt.index):
                rt.slot = self.residency.next_slot(rt)
        self.residency.broken = ""

    def check_usable(self) -> None:
        """Raise if the file holds no single step (a failed in-place step or load)."""
        self.residency.check_usable()
