"""Where stage 3's compute-dtype parameter shards live between uses (`offload_param`):
on the compute device, in host memory, or in a swap file (ZeRO-Infinity, Rajbhandari
et al. 2021). `ParamShardStore` places each unit's shard when the engine is built,
serves it to the `Gatherer` (`fzero.core.gathering.ShardSource`) and takes the new one
after a step or a restore (`store`).

Where fp32 is both the compute and the master dtype and nothing is offloaded, the fp32
master serves as the shard (`UnitRuntime.param_shard` is None): held once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fzero.config import AioConfig, OffloadParamConfig
from fzero.core import nvme as _nvme
from fzero.core.gathering import Gatherer
from fzero.core.layout import UnitRuntime
from fzero.partition import Plan

__all__ = ["ParamShardStore", "PublishedShards"]


class ParamShardStore:
    """Stage 3's compute-dtype shards of `units` (the engine's records, in plan order),
    each where the plan says (`Plan.params_memory`: its unit's own, else `memory.params`):
    "device" (as built), "host" (host memory, pinned with `pin_memory`) or "nvme" (a
    region of one swap file under `offload.nvme_path`, the config's; the record keeps an
    empty tensor). A shard of fp32 compute with no offload is the master itself.

    `units` may be an iterator that builds them (`fzero.engine._build.build_units`):
    each unit's shard is placed before the next is taken, so with "nvme" one unit's
    shard is in memory at a time while the engine is built, never the rank's share
    (which `units` holds once drawn)."""

    def __init__(
        self,
        units: Iterable[UnitRuntime],
        plan: Plan,
        *,
        rank: int,
        process_rank: int,
        dtype: torch.dtype,
        offload: OffloadParamConfig,
        aio: AioConfig,
        pin_memory: bool,
    ) -> None:
        self.units: list[UnitRuntime] = []
        self.dtype, self.pin = dtype, pin_memory
        self.where = [plan.params_memory(u) for u in plan.units]
        self.swap: _nvme.SwapFile | None = None
        self._writes: list[tuple[Any, Tensor]] = []  # (ticket, buffer) in flight
        self._writes_in_flight = offload.buffer_count
        if "nvme" in self.where:
            self.swap = _nvme.SwapFile(
                offload.nvme_path or "",
                process_rank,
                [
                    plan.grads_size(u, rank) * dtype.itemsize if where == "nvme" else 0
                    for u, where in zip(plan.units, self.where)
                ],
                threads=aio.thread_count,
                block_size=aio.block_size,
                what="param",
                key="zero_optimization.offload_param.nvme_path",
            )
        for rt in units:
            self.units.append(rt)
            if rt.param_shard is not None:
                self.store(rt.index, rt.param_shard)

    def on_disk(self, index: int) -> bool:
        """Whether unit `index`'s shard lives in the swap file."""
        return self.where[index] == "nvme"

    def shard(self, index: int) -> Tensor:
        """Unit `index`'s shard in memory (the master where it serves)."""
        rt = self.units[index]
        return rt.param_shard if rt.param_shard is not None else rt.master

    def read(self, index: int, into: Tensor) -> Any:
        """Start reading unit `index`'s shard from the swap file into `into`."""
        assert self.swap is not None
        return self.swap.submit(index, into, False)

    def wait_read(self, ticket: Any) -> None:
        assert self.swap is not None
        self.swap.wait(ticket, "reading")

    def abandon_read(self, ticket: Any) -> None:
        """A read nobody will use: let it land, whatever it returned."""
        assert self.swap is not None
        self.swap.io.wait(ticket)

    def store(self, index: int, value: Tensor, wait: bool = True) -> None:
        """Keep `value` as unit `index`'s shard where it lives (a copy into it, or a
        write to the swap file, which without `wait` may still be in flight:
        `finish_writes` ends them)."""
        rt = self.units[index]
        if self.where[index] == "nvme":
            assert self.swap is not None
            if value is not rt.param_shard or value.numel():
                aligned = value
                if value.dtype != self.dtype or value.data_ptr() % _nvme.ALIGN:
                    aligned = _nvme.aligned_empty(value.numel(), self.dtype)
                    aligned.copy_(value)
                self._writes.append((self.swap.submit(index, aligned, True), aligned))
                while len(self._writes) > (0 if wait else self._writes_in_flight):
                    self._wait_write()
            rt.param_shard = torch.empty(0, dtype=self.dtype)
        elif self.where[index] == "host" and value is rt.param_shard:  # placed on the host
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pin)
            rt.param_shard = host.copy_(value)
        elif rt.param_shard is not None and value is not rt.param_shard:
            rt.param_shard.copy_(value)

    def _wait_write(self) -> None:
        assert self.swap is not None
        ticket, _ = self._writes.pop(0)
        self.swap.wait(ticket, "writing")

    def finish_writes(self) -> str:
        """Wait for every write in flight: "" or the first I/O error."""
        failure = ""
        while self._writes:
            try:
                self._wait_write()
            except OSError as error:
                failure = failure or str(error)
        return failure


class PublishedShards:
    """What a step publishes stage 3's new shards to (`fzero.core.publish.ParamShards`):
    the store, after the gatherer's copies of the unit are made stale."""

    def __init__(self, store: ParamShardStore, gatherer: Gatherer) -> None:
        self.store, self.gatherer = store, gatherer

    def store_param_shard(self, rt: UnitRuntime, value: Tensor, wait: bool = True) -> None:
        self.gatherer.invalidate(rt.index)
        self.store.store(rt.index, value, wait)

    def finish_param_writes(self) -> str:
        return self.store.finish_writes()
