"""The NVMe residency as a `TrainState`'s `SwappedUnits` (`fzero.core.state`): what
checkpoints and `train_step` reach a swap file's units through, over the `Residency`
the engine and `fzero.init` build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from fzero.core import nvme as _nvme
from fzero.core.layout import UnitRuntime
from fzero.core.residency import Residency
from fzero.core.state import UnitState
from fzero.core.swap_buffers import swap_buffer_numel

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
    def state_dtype(self) -> torch.dtype:
        """The dtype the file holds the optimizer's moments in (`resident` gives fp32)."""
        return self.residency.state_dtype

    def holds(self, index: int) -> bool:
        """Whether unit `index` lives in the file (else in the state's own buffers)."""
        return self.residency.holds(index)

    def store_next(self, index: int, unit: UnitState, with_grad: bool) -> None:
        """Write `unit` to the other slot of unit `index`'s regions (current after
        `commit`); memory keeps none of it."""
        rt = self.units[index]
        if self.residency.slots == 1 and not self.residency.broken:  # until `commit`
            self.residency.broken = (
                f"a checkpoint load overwrote units in place in {self.residency.nvme.path} "
                "(commit 'in_place') and did not finish; load a checkpoint again to go on"
            )
        rt.master, rt.state = unit.master, unit.optim
        if with_grad and self.residency.grads_on_disk:
            rt.grad = unit.grad
        self.residency.write_next_slot(rt, with_grad=with_grad)

    def commit(self) -> None:
        """Make what `store_next` wrote current, every unit at once (after every rank
        has written its part): the file holds the stored step from now on."""
        for rt in self.units:
            if self.residency.holds(rt.index):
                rt.slot = self.residency.next_slot(rt)
        self.residency.broken = ""

    def master_pieces(self, index: int) -> int:
        """Elements per piece unit `index`'s master is read in (`read_master`): the
        step's sub-group where the unit's partition is larger ([Note: sub-groups]); 0:
        read it whole (`resident`)."""
        piece = self.residency.sub_group
        unit = self.residency.plan.units[index]
        large = self.holds(index) and self.residency.partition_numel(unit) > piece
        return piece if piece and large else 0

    def read_master(self, index: int, start: int, stop: int) -> Tensor:
        """Elements [start, stop) of unit `index`'s current fp32 master, read from the
        file alone (no moments, no gradient); `start` a multiple of 1024 (a 4 KiB page)."""
        rt, residency = self.units[index], self.residency
        buffer = _nvme.aligned_empty(swap_buffer_numel(stop - start))[: stop - start]
        region = residency.region(rt, 0, rt.slot)
        residency.nvme.wait(residency.nvme.submit(region, buffer, False, 4 * start), "reading")
        return buffer

    def check_usable(self) -> None:
        """Raise if the file holds no single step (a failed in-place step or load)."""
        self.residency.check_usable()
