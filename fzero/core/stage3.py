"""Stage 3: parameters live as shards; each unit is gathered before use and freed after.

ZeRO-3 (Rajbhandari et al. 2020) as DeepSpeed runs it: forward pre-hooks on the modules
gather their units, post-hooks release them unless the next use is within
`stage3_max_reuse_distance`; a saved-tensor hook keeps references to parameters instead
of their full values, so backward gathers them again. The first pass of each phase
records the order units are used in, later passes prefetch along it
(`stage3_prefetch_bucket_size`, bounded by `stage3_max_live_parameters`). Between uses
a unit's compute-dtype shard lives where `offload_param` says: the device, the host or
a swap file. The engine drives it from module hooks; `fzero.train_step`'s placeholders
(`fzero.core.gather`) follow the same prefetch and reuse rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fzero import comm
from fzero.config import Config
from fzero.core import nvme as _nvme
from fzero.core.gather import reuse_distance, units_to_prefetch
from fzero.core.groups import (
    check_even,
    gather_unit,
    groups_of,
    secondary_block,
)
from fzero.core.layout import UnitRuntime, bind, unbind
from fzero.core.publish import Timer
from fzero.core.quantize import quantized_all_gather
from fzero.partition import Plan

__all__ = ["Stage3Gatherer"]


class Stage3Gatherer:
    """Gathering, prefetch and release of stage-3 units, and where their shards live."""

    def __init__(
        self,
        config: Config,
        plan: Plan,
        *,
        rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool,
        timers: Timer,
    ) -> None:
        zero = config.zero_optimization
        self.plan, self.groups, self.rank = plan, groups_of(plan), rank
        self.group = self.groups.shard  # the plan's ranks (a mesh's shard group)
        # ZeRO++ hpZ: what forward gathered, kept split within the secondary group for
        # backward's gathers (unit -> this process's block), until the next forward
        self.secondary: dict[int, Tensor] = {}
        self.compute_dtype, self.device, self._pin = compute_dtype, device, pin_memory
        self.timers = timers
        self.units: list[UnitRuntime] = []  # the engine's, once built
        self.hooks: list[Any] = []
        # called when backward first needs a parameter (the engine tracks autograd passes)
        self.on_backward_use: Callable[[], None] = lambda: None
        self.phase = "forward"
        self._trace: dict[str, list[int]] = {"forward": [], "backward": []}
        # units the last backward gathered again (released after forward): what
        # `partition.comm_volume(regathered=...)` needs to predict a step's all-gathers
        self.regathered: set[int] = set()
        self._traced: set[str] = set()
        self._cursor = 0
        self._prefetch_numel = zero.stage3_prefetch_bucket_size
        self._max_live = zero.stage3_max_live_parameters
        self._eval_live = zero.stage3_eval_live_parameters
        self._live = 0
        self._max_reuse = zero.stage3_max_reuse_distance
        # qwZ: forward and backward gathers travel as int8 blocks (`fzero.core.quantize`);
        # units gathered that way, which an exact gather (state dicts, `destroy`,
        # `gathered_parameters`) gathers again
        self._quantized = zero.zero_quantized_weights
        check_even(plan, self._quantized, "zero_quantized_weights (qwZ)")
        self.approximate: set[int] = set()
        self._params: dict[int, UnitRuntime] = {}
        # stage 3 parameter shards between uses: on the device, the host or NVMe
        self.param_offload = zero.offload_param.device
        self.param_swap: Any = None
        self._param_writes: list[tuple[Any, Tensor]] = []  # (ticket, buffer) in flight
        self._writes_in_flight = zero.offload_param.buffer_count
        if self.param_offload == "nvme":
            self.param_swap = _nvme.SwapFile(
                zero.offload_param.nvme_path,
                rank,
                [u.shard_size(rank) * compute_dtype.itemsize for u in plan.units],
                threads=config.aio.thread_count,
                block_size=config.aio.block_size,
                what="param",
                key="zero_optimization.offload_param.nvme_path",
            )

    def store_param_shard(self, rt: UnitRuntime, value: Tensor, wait: bool = True) -> None:
        """Keep `value` as the unit's compute-dtype shard where `offload_param` says:
        the device (no offload), the host, or the param swap file (without `wait` the
        write may still be in flight: `finish_param_writes` ends them)."""
        self.secondary.pop(rt.index, None)  # stale from now on
        if rt.full is not None and rt.active == 0:  # kept gathered: stale from now on
            self.release(rt)
        if self.param_offload == "nvme":
            if value is not rt.param_shard or value.numel():
                aligned = value
                if value.dtype != self.compute_dtype or value.data_ptr() % _nvme.ALIGN:
                    aligned = _nvme.aligned_empty(value.numel(), self.compute_dtype)
                    aligned.copy_(value)
                ticket = self.param_swap.submit(rt.index, aligned, True)
                self._param_writes.append((ticket, aligned))
                while len(self._param_writes) > (0 if wait else self._writes_in_flight):
                    self._wait_param_write()
            rt.param_shard = torch.empty(0, dtype=self.compute_dtype)
        elif self.param_offload == "cpu" and value is rt.param_shard:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=self._pin)
            rt.param_shard = host.copy_(value)
        elif value is not rt.param_shard:
            rt.param_shard.copy_(value)

    def gather(self, rt: UnitRuntime, *, wait: bool = True, quantized: bool = False) -> None:
        """All-gather the unit's parameters (asynchronously unless `wait`; as int8 blocks
        with `quantized`, else exactly). With `offload_param: nvme` a prefetch only starts
        reading the shard; the all-gather starts when the unit is used."""
        if rt.full is not None and not quantized and rt.index in self.approximate:
            self._land(rt)  # gathered as int8 blocks: gather the exact values over them
            self.approximate.discard(rt.index)
            if rt.param_read is None:
                shard = rt.param_shard if rt.param_shard is not None else rt.master
                self._start_gather(rt, shard.to(self.device))
        if rt.full is None:
            if quantized:
                self.approximate.add(rt.index)
            self._live += rt.unit.numel  # only stage-3 units without a persistent buffer get here
            if self.phase == "backward":
                self.regathered.add(rt.index)
            if self.param_offload == "nvme" and self._read_whole(rt):
                # one rank on the host: the shard is the unit; read it in place (an
                # all-gather of one would copy it into fresh pages: 25 ms per 16.8M)
                rt.full = _nvme.aligned_empty(rt.unit.numel, self.compute_dtype)
                rt.param_read = self.param_swap.submit(rt.index, rt.full, False)
                rt.gather_input = rt.full
            elif self.param_offload == "nvme":
                rt.full = torch.empty(rt.unit.numel, dtype=self.compute_dtype, device=self.device)
                shard = _nvme.aligned_empty(rt.unit.shard_size(self.rank), self.compute_dtype)
                rt.param_read = self.param_swap.submit(rt.index, shard, False)
                rt.gather_input = shard  # alive until read and all-gathered
            elif self.phase == "backward" and rt.index in self.secondary:  # hpZ
                rt.full = torch.empty(rt.unit.numel, dtype=self.compute_dtype, device=self.device)
                rt.gather_input = self.secondary[rt.index]
                rt.gather_work = comm.all_gather_into(
                    rt.full,
                    rt.gather_input,
                    async_op=True,
                    what=f"parameters of unit {rt.index} {rt.unit.name!r} (hpZ secondary)",
                    group=self.groups.secondary,
                )
            else:  # offload_param cpu: host to device
                rt.full = torch.empty(rt.unit.numel, dtype=self.compute_dtype, device=self.device)
                shard = rt.param_shard if rt.param_shard is not None else rt.master
                self._start_gather(rt, shard.to(self.device))
        if wait and rt.param_read is not None:
            self._finish_read(rt)
        if wait and rt.gather_work is not None:
            with self.timers("comm"):
                rt.gather_work.wait()
            rt.gather_work = rt.gather_input = None
            bind(rt)

    def _wait_param_write(self) -> None:
        ticket, _ = self._param_writes.pop(0)
        self.param_swap.wait(ticket, "writing")

    def finish_param_writes(self) -> str:
        """Wait for every parameter write in flight: "" or the first I/O error."""
        failure = ""
        while self._param_writes:
            try:
                self._wait_param_write()
            except OSError as error:
                failure = failure or str(error)
        return failure

    def _start_gather(self, rt: UnitRuntime, shard: Tensor) -> None:
        if rt.index in self.approximate:
            rt.gather_work = quantized_all_gather(rt.full, shard, group=self.group)
        else:
            rt.gather_work = gather_unit(
                rt.full,
                shard,
                rt.unit,
                self.plan.world_size,
                what=f"parameters of unit {rt.index} {rt.unit.name!r}",
                group=self.group,
            )
        rt.gather_input = shard  # alive until the all-gather is done

    def _land(self, rt: UnitRuntime) -> None:
        """Wait for the unit's gather in flight, if any."""
        if rt.param_read is not None:
            self._finish_read(rt)
        if rt.gather_work is not None:
            rt.gather_work.wait()
            rt.gather_work = rt.gather_input = None

    def _finish_read(self, rt: UnitRuntime) -> None:
        """Wait for the unit's shard to arrive from the param swap file; all-gather it."""
        ticket, rt.param_read = rt.param_read, None
        self.param_swap.wait(ticket, "reading")
        if rt.gather_input is rt.full:  # read in place (`_read_whole`)
            rt.gather_input = None
            bind(rt)
            return
        self._start_gather(rt, rt.gather_input.to(self.device))

    def _read_whole(self, rt: UnitRuntime) -> bool:
        return (
            self.device.type == "cpu"
            and comm.get_world_size() == 1
            and rt.unit.shard_size(self.rank) == rt.unit.numel
        )

    def release(self, rt: UnitRuntime) -> None:
        """Free the unit's gathered parameters (persistent units stay)."""
        if rt.unit.persistent or rt.full is None:
            return
        if rt.param_read is not None:  # a read-ahead nobody used: let it land first
            ticket, rt.param_read = rt.param_read, None
            self.param_swap.io.wait(ticket)
            rt.gather_input = None
        if rt.gather_work is not None:  # a prefetch nobody used: let it land first
            rt.gather_work.wait()
            rt.gather_work = rt.gather_input = None
        block = secondary_block(self.groups, rt.full) if self.phase == "forward" else None
        if block is not None:
            self.secondary[rt.index] = block
        rt.full = None
        self.approximate.discard(rt.index)
        self._live -= rt.unit.numel
        rt.used = False
        unbind(rt, self.compute_dtype, self.device)

    def use(self, rt: UnitRuntime) -> None:
        """Gather `rt` for use now and prefetch the units the trace says come next.

        The first pass of each phase (forward, backward) records the order units are
        first used in; later passes follow it and keep up to
        `stage3_prefetch_bucket_size` elements of the next units in flight. All ranks
        run the same program, so they issue the same collectives in the same order.
        """
        if rt.unit.persistent:
            return
        if not rt.used:
            rt.used = True
            self._advance_trace(rt)
        self.gather(rt, quantized=self._quantized)

    def _advance_trace(self, rt: UnitRuntime) -> None:
        trace = self._trace[self.phase]
        if self.phase not in self._traced:
            trace.append(rt.index)
            return
        if self._cursor >= len(trace) or trace[self._cursor] != rt.index:
            self._cursor = len(trace) + 1  # the program took another path: stop prefetching
            return
        self._cursor += 1
        for index in units_to_prefetch(trace, self._cursor, self._numel, self._prefetch_numel):
            ahead = self.units[index]
            if ahead.full is None:
                if self.live_numel() + ahead.unit.numel > self._max_live:
                    break
                self.gather(ahead, wait=False, quantized=self._quantized)
            elif ahead.param_read is not None:
                # read ahead on an earlier use (NVMe): all-gather it now, so that overlaps
                # this unit's compute too
                self._finish_read(ahead)

    def live_numel(self) -> int:
        """Elements of stage-3 units gathered (or being gathered) now (a running count:
        the prefetch asks for it once per unit ahead, on every forward)."""
        return self._live

    def begin_phase(self, phase: str) -> None:
        """A forward or backward starts: units count as unused, the trace from its start."""
        self.phase, self._cursor = phase, 0
        if phase == "backward":
            self.regathered = set()
        else:
            self.secondary.clear()
        for rt in self.units:
            rt.used = False
            if phase == "forward":  # the root's forward starts: no holder runs yet
                rt.active = 0

    def end_phase(self) -> None:
        """A recorded phase is followed from now on."""
        self._traced.add(self.phase)  # a recorded phase is followed from now on

    def keeps(self, rt: UnitRuntime) -> bool:
        """Whether a unit whose holders' forwards have ended stays gathered: in a forward
        without gradients (generation, evaluation) while the gathered total stays within
        `stage3_eval_live_parameters`, else by `keeps_after_forward`."""
        if not torch.is_grad_enabled() and self.live_numel() <= self._eval_live:
            return True
        return self.keeps_after_forward(rt)

    def keeps_after_forward(self, rt: UnitRuntime) -> bool:
        """DeepSpeed's `stage3_max_reuse_distance`: a unit whose next use (later in this
        forward, or in backward) comes within that many elements of other units' use is
        kept gathered instead of being released and gathered again, as long as the live
        total stays within `stage3_max_live_parameters`. The unit used last in forward
        is the first backward needs (distance 0), as FSDP keeps its root."""
        if "forward" not in self._traced or "backward" not in self._traced:
            return False
        upcoming = self._trace["forward"][self._cursor :] + self._trace["backward"]
        distance = reuse_distance(upcoming, rt.index, self._numel)
        if distance is None:
            return False
        return distance <= self._max_reuse and self.live_numel() <= self._max_live

    def _numel(self, index: int) -> int:
        return self.units[index].unit.numel

    def install_hooks(self, root: torch.nn.Module) -> None:
        """Gather each module's units before its forward, release them after (unless
        their next use is close, or an enclosing module's forward still holds them);
        shape stand-ins for released parameters' gradients.

        A unit hangs on its module and on every module holding one of its parameters
        directly (or by `register_external_parameter`): a tied weight (T5's `shared` in
        `encoder.embed_tokens` and `lm_head`) is gathered whichever holder runs, also when
        a caller runs a submodule on its own (`generate` runs the encoder alone)."""
        holders: dict[int, list[torch.nn.Module]] = {}
        for module in root.modules():
            # DeepSpeed's `register_external_parameter`: a module that uses another's
            # parameter in its forward holds it too
            external = getattr(module, "_external_params", {})
            for p in (*module._parameters.values(), *external.values()):
                if p is not None:
                    holders.setdefault(id(p), []).append(module)
        by_module: dict[int, tuple[torch.nn.Module, list[UnitRuntime]]] = {}
        for rt in self.units:
            if rt.unit.persistent:
                continue
            modules = [root.get_submodule(rt.unit.module)]
            modules += [m for p, _, _ in rt.params for m in holders.get(id(p), [])]
            for module in modules:
                rts = by_module.setdefault(id(module), (module, []))[1]
                if rt not in rts:
                    rts.append(rt)
        for module, rts in by_module.values():

            def pre(_module: Any, _inputs: Any, rts: list[UnitRuntime] = rts) -> None:
                for rt in rts:
                    rt.active += 1
                    self.use(rt)

            def post(_module: Any, _inputs: Any, _output: Any, rts=rts) -> None:
                for rt in rts:
                    rt.active = max(0, rt.active - 1)
                # In backward (activation-checkpoint recomputation) autograd holds the
                # parameters themselves: they are released when their gradients arrive.
                # Outside any pass (a submodule run alone after a step: `generate`'s
                # encoder) they are released as in forward.
                if self.phase != "forward" and torch._C._current_graph_task_id() != -1:
                    return
                for rt in rts:
                    if rt.active == 0 and not self.keeps(rt):
                        self.release(rt)

            self.hooks.append(module.register_forward_pre_hook(pre))
            self.hooks.append(module.register_forward_hook(post, always_call=True))
        self._params = {id(p): rt for rt in self.units for p, _, _ in rt.params}
        for rt in self.units:
            if not rt.unit.persistent:
                for p, _, shape in rt.params:
                    self.hooks.append(p.register_hook(self._shape_for_accumulation(p, shape)))

    def _shape_for_accumulation(self, p: torch.nn.Parameter, shape: tuple[int, ...]):
        """Before autograd stores a gradient in `p.grad` it matches it to `p`'s layout; a
        released parameter gets a zero-stride stand-in of the right shape (no memory)."""

        def hook(grad: Tensor) -> None:
            if p.data.shape != shape:
                p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(shape)

        return hook

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor hook: a saved stage-3 parameter (or a view of one) is kept as a
        reference and re-gathered when backward needs it, so no full unit stays alive."""
        base = tensor._base if tensor._base is not None else tensor
        rt = self._params.get(id(base))
        if rt is None or rt.unit.persistent:
            return tensor
        if base is tensor:
            return ("param", tensor, None)
        return (
            "view",
            base,
            (tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset()),
        )

    def unpack(self, packed: Any) -> Tensor:
        """Saved-tensor hook: the parameter a backward node needs, gathered again."""
        if not isinstance(packed, tuple):
            return packed
        kind, param, geometry = packed
        self.on_backward_use()  # the engine learns of the autograd pass (it frees units)
        self.use(self._params[id(param)])
        if kind == "param":
            return param
        size, stride, offset = geometry
        return param.detach().as_strided(size, stride, param.storage_offset() + offset)
