"""A stage-3 unit's gathered copy on this rank: one state machine, one implementation of
gathering, prefetch, release and the live bound, which both doors drive.

ZeRO-3 (Rajbhandari et al. 2020) keeps parameters as shards and gathers a unit while it
is used. How a unit moves between having only its shard here and having its whole
buffer is written once, in `Gatherer`, over one record per unit (`GatheredUnit`):

    [Note: a unit's states]

        SHARDED ──reading──▶ READING ──landed (in place)──────────────▶ GATHERED
           │                    └──gathering (the read landed)──┐          │
           └──────────────────────gathering────────────────────▶ GATHERING ┘ landed
        GATHERED (int8 blocks, qwZ) ──gathering (exact)──▶ GATHERING
        any ──released──▶ SHARDED

    READING: the shard is being read from the parameter swap file (`offload_param:
    nvme`); GATHERING: an all-gather into the unit's buffer is in flight; GATHERED: the
    whole buffer is here. Only the named transitions change a record, and each checks
    the state it leaves (FSDP2's `ShardedState` shape).

What the `Gatherer` decides, the same for both doors (DeepSpeed's stage-3 knobs):

- the first pass of each phase (forward, backward) records the order units are first
  used in (`UseTrace`); later passes prefetch along it, keeping up to
  `prefetch_numel` elements of the next units in flight
  (`stage3_prefetch_bucket_size`), bounded by `max_live`
  (`stage3_max_live_parameters`); a pass that leaves the recorded order stops
  prefetching until the phase ends;
- after its forward a unit stays gathered only if its next use comes within
  `max_reuse` elements of other units' use (`stage3_max_reuse_distance`), or, in a
  forward without gradients, while the gathered total stays within `eval_live`
  (`stage3_eval_live_parameters`);
- ZeRO++ hpZ: what forward gathered is kept split within the secondary group, and
  backward gathers from that copy; qwZ: gathers travel as int8 blocks, and an exact
  gather (state dicts, `GatheredParameters`) gathers them again;
- where the shard comes from is a `ShardSource` (the engine's `ParamShardStore`:
  device, host or swap file; `train_step`'s state).

The two drivers: the engine's module hooks (`fzero.core.stage3.ModuleGathering`) and
`train_step`'s placeholders (`fzero.core.gather.Placeholders`). Each tells the
`Gatherer` when a phase begins and ends and which unit is used, and decides nothing.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from fzero import comm
from fzero.core import nvme as _nvme
from fzero.core.groups import (
    check_even,
    check_finer,
    gather_unit,
    groups_of,
    secondary_block,
    unit_group,
)
from fzero.core.quantize import quantized_all_gather
from fzero.partition import Plan

__all__ = [
    "GatherSettings",
    "GatheredUnit",
    "Gatherer",
    "ShardSource",
    "UnitPhase",
    "UseTrace",
    "reuse_distance",
    "units_to_prefetch",
]

Timer = Callable[[str], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def _untimed(_name: str) -> Iterator[None]:
    yield


class UnitPhase(enum.Enum):
    """Where a stage-3 unit's gathered copy stands on this rank (see the Note above)."""

    SHARDED = "sharded"
    READING = "reading"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class GatheredUnit:
    """One stage-3 unit on this rank: its state and the buffers of the transition in
    flight. `full`: the whole compute-dtype buffer (READING in place, GATHERING,
    GATHERED); `source`: what is read into or all-gathered from, alive until it lands;
    `work`: the all-gather in flight; `ticket`: the swap-file read in flight; `exact`:
    False when gathered as int8 blocks (qwZ); `used`: first used in the current phase;
    `active`: forwards of modules holding the unit running now (the engine's driver)."""

    index: int
    numel: int
    state: UnitPhase = UnitPhase.SHARDED
    full: Tensor | None = None
    source: Tensor | None = None
    work: Any = None
    ticket: Any = None
    exact: bool = True
    used: bool = False
    active: int = 0

    def _leave(self, allowed: tuple[UnitPhase, ...], transition: str) -> None:
        if self.state not in allowed:
            names = ", ".join(s.name for s in allowed)
            raise RuntimeError(
                f"fzero internal error: stage-3 unit {self.index} is {self.state.name}; "
                f"'{transition}' leaves only {names}"
            )

    def reading(self, full: Tensor, into: Tensor, ticket: Any) -> None:
        """SHARDED -> READING: the shard is being read into `into` (`full` when in place)."""
        self._leave((UnitPhase.SHARDED,), "reading")
        self.state, self.full, self.source, self.ticket = UnitPhase.READING, full, into, ticket

    def read_landed(self) -> Any:
        """The read in flight has been waited for; returns its ticket."""
        self._leave((UnitPhase.READING,), "read landed")
        ticket, self.ticket = self.ticket, None
        return ticket

    def gathering(self, full: Tensor, source: Tensor, work: Any) -> None:
        """-> GATHERING: an all-gather of `source` into `full` is in flight (from
        SHARDED, from a landed read, or over an int8-block copy to make it exact)."""
        self._leave((UnitPhase.SHARDED, UnitPhase.READING, UnitPhase.GATHERED), "gathering")
        self.state, self.full, self.source, self.work = UnitPhase.GATHERING, full, source, work

    def landed(self) -> None:
        """GATHERING (its all-gather waited for) or READING in place -> GATHERED."""
        self._leave((UnitPhase.GATHERING, UnitPhase.READING), "landed")
        self.state, self.source, self.work, self.ticket = UnitPhase.GATHERED, None, None, None

    def released(self) -> None:
        """-> SHARDED: the whole buffer is dropped (nothing may be in flight)."""
        if self.work is not None or self.ticket is not None:
            raise RuntimeError(
                f"fzero internal error: stage-3 unit {self.index} released with a transfer "
                "in flight"
            )
        self.state, self.full, self.source = UnitPhase.SHARDED, None, None
        self.exact, self.used = True, False


@dataclass
class UseTrace:
    """The order stage-3 units are first used in, per phase, as the first pass of each
    phase recorded it (`recorded`: the phases followed from now on)."""

    order: dict[str, list[int]] = field(default_factory=lambda: {"forward": [], "backward": []})
    recorded: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Both phases recorded (a whole step has run)."""
        return {"forward", "backward"} <= self.recorded


@dataclass(frozen=True)
class GatherSettings:
    """DeepSpeed's stage-3 knobs as the `Gatherer` reads them (elements), and whether a
    gather for use releases the least recently used units to stay within `max_live`
    (`evict`: `train_step`'s placeholders, which have no module hooks to release by)."""

    max_live: int
    prefetch_numel: int = 0
    max_reuse: int = 0
    eval_live: int = 0
    quantized: bool = False
    evict: bool = False


class ShardSource(Protocol):
    """Where a unit's compute-dtype shard is between uses: in memory (`shard(i)`), or in
    a swap file (`on_disk(i)`: `read(i, into)` starts reading, `wait_read` ends it,
    `abandon_read` lets an unused read land)."""

    def on_disk(self, index: int) -> bool: ...

    def shard(self, index: int) -> Tensor: ...

    def read(self, index: int, into: Tensor) -> Any: ...

    def wait_read(self, ticket: Any) -> None: ...

    def abandon_read(self, ticket: Any) -> None: ...


def units_to_prefetch(
    order: Sequence[int], start: int, numel: Callable[[int], int], budget: int
) -> list[int]:
    """The units of `order[start:]` within `budget` elements ahead, in order (DeepSpeed's
    `stage3_prefetch_bucket_size`: the unit that crosses the budget still counts)."""
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
    again."""
    if index not in upcoming:
        return None
    return sum(numel(i) for i in upcoming[: upcoming.index(index)])


class Gatherer:
    """Stage-3 units gathered while used, for one plan on this rank (see the module
    docstring). `bind(i, full)` and `unbind(i)` are what a driver does when unit i's
    whole buffer arrives and goes (the engine points the module's parameters at it)."""

    def __init__(
        self,
        plan: Plan,
        shards: ShardSource,
        *,
        dtype: torch.dtype,
        device: torch.device,
        settings: GatherSettings,
        trace: UseTrace | None = None,
        timer: Timer = _untimed,
        bind: Callable[[int, Tensor], None] | None = None,
        unbind: Callable[[int], None] | None = None,
    ) -> None:
        check_even(plan, settings.quantized, "zero_quantized_weights (qwZ)")
        check_finer(plan, settings.quantized, "zero_quantized_weights (qwZ)")
        self.plan, self.shards, self.dtype, self.device = plan, shards, dtype, device
        self.settings, self.timer = settings, timer
        self.trace = trace if trace is not None else UseTrace()
        self.groups = groups_of(plan)
        self.groups_secondary = plan.mesh.secondary if plan.mesh is not None else ()
        self.rank = self.groups.rank
        self._bind, self._unbind = bind, unbind
        self.units = [GatheredUnit(i, u.numel) for i, u in enumerate(plan.units)]
        self.phase = "forward"
        self._cursor = 0
        # units holding a whole buffer (or one on its way), least recently used first
        self.live: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.live_numel = 0
        self.peak_numel = 0
        self.gathers = 0  # all-gathers of parameters started (a step's metric)
        # units the last backward gathered again (released after forward): what
        # `partition.comm_volume(regathered=...)` needs to predict a step's all-gathers
        self.regathered: set[int] = set()
        # ZeRO++ hpZ: what forward gathered, kept split within the secondary group for
        # backward's gathers (unit -> this process's block), until the next forward
        self.secondary: dict[int, Tensor] = {}

    # ---- phases ---------------------------------------------------------------------------

    def begin_phase(self, phase: str) -> None:
        """A forward or backward starts: units count as unused, the trace from its start."""
        self.phase, self._cursor = phase, 0
        if phase == "backward":
            self.regathered = set()
        else:
            self.secondary.clear()
        for g in self.units:
            g.used = False
            if phase == "forward":  # the root's forward starts: no holder runs yet
                g.active = 0

    def end_phase(self) -> None:
        """The phase running now is recorded: followed from now on."""
        self.trace.recorded.add(self.phase)

    # ---- use, gather, release -------------------------------------------------------------

    def use(self, index: int) -> Tensor:
        """Unit `index`'s whole buffer, for use now: its gather (if not gathered) starts,
        then the units the trace says come next are prefetched, then it is waited for.
        The first use in a phase records the unit (first pass) or follows the trace."""
        g = self.units[index]
        if self.plan.stage_of(index) < 3:
            raise RuntimeError(
                f"fzero internal error: unit {index} is whole (persistent or below stage 3), "
                "never gathered"
            )
        if self.settings.evict and g.full is None:
            self._make_room(g.numel, index)
        self.gather(index, wait=False, quantized=self.settings.quantized)
        if not g.used:
            g.used = True
            self._advance_trace(index)
        self.gather(index, quantized=self.settings.quantized)
        self.live.move_to_end(index)
        assert g.full is not None
        return g.full

    def gather(self, index: int, *, wait: bool = True, quantized: bool = False) -> None:
        """All-gather unit `index` (as int8 blocks with `quantized`, else exactly; over an
        int8-block copy, exactly again), waited for unless not `wait`. A shard in the swap
        file is read first; without `wait` only the read starts."""
        g = self.units[index]
        if g.full is not None and not quantized and not g.exact:
            self._land(g)  # an int8-block copy: gather the exact values over it
            g.exact = True
            if g.state is UnitPhase.GATHERED:
                self._start_gather(g, g.full, self.shards.shard(index).to(self.device))
        if g.full is None:
            self._start(g, quantized)
        if wait and g.state is UnitPhase.READING:
            self._finish_read(g)
        if wait and g.state is UnitPhase.GATHERING:
            with self.timer("comm"):
                g.work.wait()
            g.landed()
            if self._bind is not None:
                self._bind(index, g.full)

    def _start(self, g: GatheredUnit, quantized: bool) -> None:
        """SHARDED -> READING or GATHERING (the live total counts it from now)."""
        if quantized:
            g.exact = False
        self.live[g.index] = None
        self.live_numel += g.numel
        self.peak_numel = max(self.peak_numel, self.live_numel)
        if self.phase == "backward":
            self.regathered.add(g.index)
        unit = self.plan.units[g.index]
        if self.shards.on_disk(g.index) and self._reads_in_place(g.index):
            # one rank on the host: the shard is the unit; read it in place (an
            # all-gather of one would copy it into fresh pages: 25 ms per 16.8M)
            full = _nvme.aligned_empty(g.numel, self.dtype)
            g.reading(full, full, self.shards.read(g.index, full))
            return
        full = torch.empty(g.numel, dtype=self.dtype, device=self.device)
        if self.shards.on_disk(g.index):
            into = _nvme.aligned_empty(self.plan.grads_size(unit, self.rank), self.dtype)
            g.reading(full, into, self.shards.read(g.index, into))
        elif self.phase == "backward" and g.index in self.secondary:  # hpZ
            source = self.secondary[g.index]
            self.gathers += 1
            work = comm.all_gather_into(
                full,
                source,
                async_op=True,
                what=f"parameters of unit {g.index} {unit.name!r} (hpZ secondary)",
                group=self.groups.secondary,
            )
            g.gathering(full, source, work)
        else:  # offload_param cpu: host to device
            self._start_gather(g, full, self.shards.shard(g.index).to(self.device, self.dtype))

    def _start_gather(self, g: GatheredUnit, full: Tensor, shard: Tensor) -> None:
        self.gathers += 1
        unit = self.plan.units[g.index]
        own = unit_group(self.plan, self.groups, unit, self.rank)
        if not g.exact:
            work = quantized_all_gather(full, shard.contiguous(), group=own.group)
        elif own.world == 1:
            work = _Done(full.copy_(shard))
        elif self.plan.mesh is not None and self.plan.mesh.hierarchical and self.groups.hops:
            work = _Done(self._gather_by_axis(g.index, full, shard.contiguous()))
        else:
            work = gather_unit(
                full,
                shard.contiguous(),
                unit,
                own.world,
                what=f"parameters of unit {g.index} {unit.name!r}",
                group=own.group,
            )
        g.gathering(full, shard, work)  # the shard stays alive until the gather lands

    def _gather_by_axis(self, index: int, full: Tensor, shard: Tensor) -> Tensor:
        """MiCS's hierarchical all-gather: one all-gather per shard axis, the outermost
        first, each over the blocks gathered so far (rank-order blocks: the block of
        group index (i_1, ..., i_k) in row-major order), then one copy into `full`."""
        what = f"parameters of unit {index} {self.plan.units[index].name!r}"
        held, sizes = shard, []
        for group, size in self.groups.hops:  # outermost axis first
            gathered = torch.empty(size * held.numel(), dtype=held.dtype, device=held.device)
            comm.all_gather_into(gathered, held, what=f"{what} (one axis)", group=group)
            held, sizes = gathered, [size, *sizes]
        # `held` is [s_k, ..., s_1, block]: the innermost axis index outermost
        blocks = held.view(*sizes, shard.numel())
        order = [*reversed(range(len(sizes))), len(sizes)]
        full.view(*reversed(sizes), shard.numel()).copy_(blocks.permute(order))
        return full

    def _finish_read(self, g: GatheredUnit) -> None:
        """The shard arrives from the swap file: all-gather it (or, read in place, done)."""
        self.shards.wait_read(g.read_landed())
        assert g.full is not None and g.source is not None
        if g.source is g.full:  # read in place
            g.landed()
            if self._bind is not None:
                self._bind(g.index, g.full)
            return
        self._start_gather(g, g.full, g.source.to(self.device))

    def _land(self, g: GatheredUnit) -> None:
        """Wait for the unit's transfer in flight, if any."""
        if g.state is UnitPhase.READING:
            self._finish_read(g)
        if g.state is UnitPhase.GATHERING:
            g.work.wait()
            g.landed()

    def _reads_in_place(self, index: int) -> bool:
        return (
            self.device.type == "cpu"
            and comm.get_world_size() == 1
            and self.plan.grads_size(self.plan.units[index], self.rank) == self.units[index].numel
        )

    def holds(self, index: int) -> bool:
        """Whether unit `index` is whole here now (persistent or below stage 3, or
        gathered)."""
        return self.plan.stage_of(index) < 3 or self.units[index].full is not None

    def release(self, index: int) -> None:
        """Drop unit `index`'s whole buffer (whole units, never gathered, stay).
        Released in forward, hpZ keeps this process's block of it for backward."""
        g = self.units[index]
        if self.plan.stage_of(index) < 3 or g.full is None:
            return
        if g.state is UnitPhase.READING:  # a read-ahead nobody used: let it land first
            self.shards.abandon_read(g.read_landed())
        else:
            if g.state is UnitPhase.GATHERING:  # a prefetch nobody used: let it land first
                g.work.wait()
                g.landed()
            # hpZ: a unit split over the secondary's axes alone is its own copy
            own = self.plan.units[index].shard_axes
            copies = self.phase == "forward" and (own is None or own != self.groups_secondary)
            block = secondary_block(self.groups, g.full) if copies else None
            if block is not None:
                self.secondary[index] = block
        del self.live[index]
        self.live_numel -= g.numel
        g.released()
        if self._unbind is not None:
            self._unbind(index)

    def release_all(self) -> None:
        for index in list(self.live):
            self.release(index)

    def drop_prefetched(self) -> None:
        """Release the units still on their way that nobody used (prefetched beyond
        where the pass went)."""
        for index in list(self.live):
            if self.units[index].state is not UnitPhase.GATHERED:
                self.release(index)

    def invalidate(self, index: int) -> None:
        """Unit `index`'s shard changes (a step, a restore): its hpZ block is stale and a
        copy kept gathered is released (unless a module holding it runs now)."""
        g = self.units[index]
        if g.full is not None and g.active == 0:
            self.release(index)
        self.secondary.pop(index, None)

    def widen(self, max_live: int) -> None:
        """Let at least `max_live` elements be gathered at once (a call that needs every
        unit whole)."""
        if max_live > self.settings.max_live:
            self.settings = replace(self.settings, max_live=max_live)

    def _make_room(self, numel: int, index: int) -> None:
        """Release the least recently used units (not in use, not `index`) until
        `numel` more elements fit within `max_live`."""
        for other in list(self.live):
            if self.live_numel + numel <= self.settings.max_live:
                return
            if other != index and self.units[other].active == 0:
                self.release(other)

    # ---- the trace ------------------------------------------------------------------------

    def _advance_trace(self, index: int) -> None:
        """The first use of unit `index` in this phase: recorded (first pass), or the
        trace followed and the next units prefetched."""
        order = self.trace.order[self.phase]
        if self.phase not in self.trace.recorded:
            if index not in order:
                order.append(index)
            return
        if self._cursor >= len(order) or order[self._cursor] != index:
            self._cursor = len(order) + 1  # the program took another path: stop prefetching
            return
        self._cursor += 1
        budget = self.settings.prefetch_numel
        for ahead in units_to_prefetch(order, self._cursor, self._numel, budget):
            g = self.units[ahead]
            if g.full is None:
                if self.live_numel + g.numel > self.settings.max_live:
                    break
                self.gather(ahead, wait=False, quantized=self.settings.quantized)
            elif g.state is UnitPhase.READING:
                # read ahead on an earlier use (NVMe): all-gather it now, so that overlaps
                # this unit's compute too
                self._finish_read(g)

    def keeps(self, index: int) -> bool:
        """Whether a unit whose holders' forwards have ended stays gathered: in a forward
        without gradients (generation, evaluation) while the gathered total stays within
        `eval_live`, else by `keeps_after_forward`."""
        if not torch.is_grad_enabled() and self.live_numel <= self.settings.eval_live:
            return True
        return self.keeps_after_forward(index)

    def keeps_after_forward(self, index: int) -> bool:
        """DeepSpeed's `stage3_max_reuse_distance`: a unit whose next use (later in this
        forward, or in backward) comes within that many elements of other units' use is
        kept gathered instead of being released and gathered again, as long as the live
        total stays within `max_live`. The unit used last in forward is the first
        backward needs (distance 0), as FSDP keeps its root."""
        if not self.trace.complete:
            return False
        upcoming = self.trace.order["forward"][self._cursor :] + self.trace.order["backward"]
        distance = reuse_distance(upcoming, index, self._numel)
        if distance is None:
            return False
        return distance <= self.settings.max_reuse and self.live_numel <= self.settings.max_live

    def _numel(self, index: int) -> int:
        return self.units[index].numel


class _Done:
    """A gather that completed at once (one rank: a copy)."""

    def __init__(self, _result: Any) -> None:
        pass

    def wait(self) -> None:
        return None
