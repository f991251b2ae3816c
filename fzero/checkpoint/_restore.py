"""`restore`: a sharded checkpoint into a `TrainState` (collective).

The old plan comes from the index and fills the new plan's partitions with
`partition.reshard_reads`, so world size, stage and strategy may all change. A restore
runs in two passes. The first checks every tensor this rank needs against its checksum,
reading it through a small reused buffer, and all ranks agree that every check passed
before anything is replaced: a damaged file seen by one rank fails the restore
everywhere and loses nothing. The second reads the verified bytes (now in the page
cache) straight into the state's own buffers: no new memory is faulted in, which is what
made reading into fresh buffers cost twice DCP's in-place load. Should that second read
fail (the file vanished in between), every rank raises `PartlyRestoredError`: the state
is partly overwritten and must be restored again. Units that do not live in memory (the
engine's NVMe offload) are read in one verified pass and go to their next slot through
the state's `SwappedUnits` as they are read (with sub-groups, verified first and then
read and written a piece at a time: [Note: checkpoints in pieces] in
`fzero.core.swap_pieces`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.checkpoint._files import CheckpointError, hugepage_hint
from fzero.checkpoint._format import (
    Reader,
    check_tag,
    read_index,
    read_latest,
    saved_rng,
    slice_key,
)
from fzero.checkpoint._save import (
    Extras,
    extras_of,
    grad_numel,
    same_on_every_rank,
    side_group,
    state_kinds,
    wait_for_save,
)
from fzero.core.groups import check_same_plan
from fzero.core.precision import init_state
from fzero.core.publish import Publisher, runtime_of
from fzero.core.state import (
    Counters,
    PieceSource,
    TrainState,
    UnitState,
    optimizer_partition,
)
from fzero.optim import LossScaleState, Optimizer
from fzero.partition import Plan, PlanError

__all__ = ["PartlyRestoredError", "Restored", "find", "restore", "restored_counters"]


class Restored(NamedTuple):
    """What `restore` read: the new `state`, the `client_state` saved with it, the
    module's frozen parameters and buffers (`module`, by key), the checkpoint's
    `directory` and its `index` (counters, scheduler, each rank's random state)."""

    state: TrainState
    client_state: Any
    module: dict[str, Tensor]
    directory: str
    index: dict[str, Any]


def find(load_dir: str | os.PathLike[str], tag: str | None) -> str | None:
    """`load_dir/tag` (default: the tag `load_dir/latest` names), or None if absent."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    directory = os.path.join(load_dir, check_tag(tag, "load_checkpoint"))
    return directory if os.path.isdir(directory) else None


def restore(
    directory: str | os.PathLike[str],
    like: TrainState,
    *,
    optimizer: Optimizer | None = None,
    tag: str | None = None,
    module: torch.nn.Module | None = None,
    load_optimizer_states: bool = True,
    accumulation: int | None = None,
    extras: Extras | None = None,
    owner: object = None,
    install: bool = True,
    strict: bool = True,
) -> Restored:
    """Read the checkpoint `directory/tag` (default: the tag in `directory/latest`) into a
    state laid out like `like` (its plan — any world size, stage or strategy may have
    saved it — dtypes and devices); collective. `optimizer` checks the saved optimizer's
    name, and re-initialises the state when `load_optimizer_states` is False. `module`
    checks (and `Restored.module` returns) the frozen parameters and buffers; without
    `strict`, those the checkpoint or the module lacks are skipped (a changed shape
    still fails).
    With `install` (the default) the new masters are also written to the compute-dtype
    parameters (collective), so the returned state is ready to train; the counters,
    loss scale and generator come from the checkpoint (with `accumulation`, micro-steps
    are realigned to it when the save was at a boundary). `like` is consumed (as by a
    step): the restored state reuses its buffers, reading master and optimizer state in
    place. If any rank cannot read or verify its part, every rank raises
    `CheckpointError` and `like` is untouched; if reading fails after the checksums
    passed (the files changed in between), every rank raises `PartlyRestoredError` and
    `like` must be restored again."""
    where = f"fzero.checkpoint.restore (micro-step {like.counters.micro_steps})"
    with comm.named_operation(where, entry="always"):  # a rank that skipped it: named
        return _restore(
            directory, like, optimizer, tag, module, load_optimizer_states, accumulation,
            extras, owner, install, strict,
        )  # fmt: skip


def _restore(
    directory: str | os.PathLike[str],
    like: TrainState,
    optimizer: Optimizer | None,
    tag: str | None,
    module: torch.nn.Module | None,
    load_optimizer_states: bool,
    accumulation: int | None,
    extras: Extras | None,
    owner: object,
    install: bool,
    strict: bool,
) -> Restored:
    wait_for_save(owner)
    check_same_plan(like.plan, "fzero.checkpoint.restore")
    extras = extras_of(like.plan, module, extras)
    group = side_group(extras)
    found = find(directory, tag)
    same_on_every_rank(group, "load_checkpoint", load_dir=os.fspath(directory), tag=tag)
    if found is None:
        raise CheckpointError(
            f"no checkpoint in {os.fspath(directory)} (tag {tag!r}): nothing to restore"
        )
    with contextlib.ExitStack() as files:
        failure = ""
        try:
            read = _read(found, like, optimizer, extras, load_optimizer_states, strict, files)
        except (CheckpointError, OSError) as error:
            failure = str(error)
        # Every rank learns whether every rank could read its part before anything changes.
        _agree(failure, group, CheckpointError)
        if _in_memory(like):  # the second pass, into the state's buffers
            try:
                read.fill()
            except (CheckpointError, OSError) as error:
                failure = f"{error} (after its checksums passed)"
            _agree(failure, group, PartlyRestoredError)
    index, units = read.index, read.units(like, optimizer, load_optimizer_states)
    counters = restored_counters(index, accumulation)
    loss_scale = like.loss_scale
    if index["loss_scale"] is not None and like.loss_scale is not None:
        loss_scale = LossScaleState(*index["loss_scale"])
    rng = like.rng
    saved = saved_rng(index, like.rank, like.plan.processes)
    if like.rng is not None and saved is not None and saved.get("torch") is not None:
        rng = torch.tensor(list(saved["torch"]), dtype=torch.uint8)
    if install and like.residence is not None:  # NVMe: the stored slots become current
        like.residence.commit()
        units = tuple(
            _install_swapped(like, i, unit) if like.residence.holds(i) else _install(like, i, unit)
            for i, unit in enumerate(units)
        )
    elif install:
        units = tuple(_install(like, i, unit) for i, unit in enumerate(units))
    state = like.replace(units=units, counters=counters, loss_scale=loss_scale, rng=rng)
    return Restored(state, read.client_state, read.module, found, index)


def _in_memory(like: TrainState) -> bool:
    """Whether some unit of `like` keeps its master and state in memory (not all in a
    swap file): restored into its buffers in place."""
    if like.residence is None:
        return True
    return not all(like.residence.holds(i) for i in range(len(like.units)))


def _install(like: TrainState, i: int, unit: UnitState) -> UnitState:
    """Unit i of the restored state, ready to train: the master written to the
    parameters (all-gathered where whole), held once again as their view when it was;
    the gradient accumulator zeroed unless it was loaded. Collective."""
    old = like.units[i]
    if unit.grad is old.grad:
        old.grad.zero_()
    else:
        old.grad.copy_(unit.grad)
    _publish(like, i, unit)
    if _viewed(like, i):
        assert unit.params is not None
        unit = unit._replace(
            master=unit.params[optimizer_partition(like.plan, like.plan.units[i], like.rank)]
        )
    return unit._replace(grad=old.grad)


def _install_swapped(like: TrainState, i: int, unit: UnitState) -> UnitState:
    """Unit i of a restored state whose master and optimizer state are in its swap file
    (committed): the gradient as `_install`'s, the master read back and written to the
    parameters. Collective."""
    old = like.units[i]
    if unit.grad is old.grad:
        old.grad.zero_()
    else:
        old.grad.copy_(unit.grad)
    if _in_pieces(like, i):  # a compute-dtype copy of the master, read piece by piece
        if old.params is not None:
            written = like.residence.master_copy(i, old.params.dtype)  # type: ignore[union-attr]
            _publish(like, i, old, written)
        return unit._replace(grad=old.grad)
    with like.residence.resident(i) as held:  # type: ignore[union-attr]
        _publish(like, i, held._replace(params=old.params))
    return unit._replace(grad=old.grad)


def _publish(like: TrainState, i: int, unit: UnitState, written: Tensor | None = None) -> None:
    """Unit i's master (or `written`, its copy in the parameters' dtype) written to its
    compute-dtype parameters (collective where whole)."""
    if unit.params is None:
        return  # stage 3, fp32: the master is the shard
    publisher = Publisher(
        like.plan, like.rank, compute_dtype=unit.params.dtype, device=unit.params.device
    )
    publisher.publish(runtime_of(like.plan, i, unit), written)
    publisher.finish_publish()


def restored_counters(index: Mapping[str, Any], accumulation: int | None) -> Counters:
    """The saved counters; at a boundary, micro-steps realigned to `accumulation`."""
    counters = Counters(**index["counters"])
    if accumulation is not None and not index["mid_accumulation"]:  # it may have changed
        counters = counters._replace(micro_steps=counters.global_steps * accumulation)
    return counters


class PartlyRestoredError(CheckpointError):
    """A restore failed after it began writing the state's buffers: the state holds
    neither its old values nor the checkpoint's; restore a checkpoint again to go on."""


def _agree(failure: str, group: Any, error: type[CheckpointError]) -> None:
    """Raise `error` on every rank if any rank failed (collective)."""
    failures = comm.all_gather_bytes(failure.encode(), group=group, what="restore failures")
    messages = [f"rank {r}: {m.decode()}" for r, m in enumerate(failures) if m]
    if messages:
        raise error("; ".join(messages))


class _Fill(NamedTuple):
    """A partition buffer to read in the second pass, from whichever old ranks hold it."""

    unit: int
    kind: str
    out: Tensor
    reads: list[tuple[int, Any]]


@dataclasses.dataclass
class _Read:
    """What the first pass of `_read` found: the index, units already complete (read into
    new buffers, or sent to their residence), the in-place fills still to do, the
    module's frozen tensors and the client state."""

    index: dict[str, Any]
    plan: Plan
    reader: Reader
    done: dict[int, UnitState]
    fills: list[_Fill]
    grads: dict[int, Tensor]  # gradient accumulators saved mid-accumulation
    module: dict[str, Tensor]
    client_state: Any

    def fill(self) -> None:
        for f in self.fills:
            _fill(self.plan, self.reader, f.kind, f.out, f.reads)

    def units(
        self, like: TrainState, optimizer: Optimizer | None, with_state: bool
    ) -> tuple[UnitState, ...]:
        tensors: dict[int, dict[str, Tensor]] = {}
        for f in self.fills:
            tensors.setdefault(f.unit, {})[f.kind] = f.out
        units = []
        for i, old in enumerate(like.units):
            unit = self.done.get(i)
            if unit is None:
                unit = _unit_from(old, tensors[i], self.index, optimizer, with_state)
                if i in self.grads:
                    unit = unit._replace(grad=self.grads[i].to(old.grad.device))
            units.append(unit)
        return tuple(units)


def _read(
    directory: str,
    like: TrainState,
    optimizer: Optimizer | None,
    extras: Extras,
    with_state: bool,
    strict: bool,
    files: contextlib.ExitStack,
) -> _Read:
    """The first pass: every tensor this rank needs, checked. A partition whose buffer in
    `like` can take it in place (fp32, contiguous, in host memory) is only verified and
    left to `_Read.fill`; any other is read, verified, into a new buffer, and units
    outside memory go to their next slot through `like.residence`."""
    index = read_index(directory)
    old_plan = partition.from_bytes(index["plan"])
    plan = like.plan
    _check_model(plan, like.rank, old_plan, index, directory, extras.module, strict)
    if index["mid_accumulation"] and (
        index.get("processes", index["world_size"]) != plan.processes
        or dataclasses.replace(old_plan, memory=plan.memory) != plan  # memory may differ
    ):
        raise CheckpointError(
            f"{directory} was saved mid gradient-accumulation at world size "
            f"{index['world_size']}, stage {index['stage']}; it loads only into the same world "
            f"size, stage and plan (here world size {plan.world_size}, stage {plan.stage})"
        )
    kinds = ["master"]
    if with_state:
        _check_optimizer(like, optimizer, index, directory)
        kinds += state_kinds(like)
    elif optimizer is None:
        raise ValueError("load_optimizer_states=False needs the optimizer to start its state")
    reader = files.enter_context(Reader(directory, index, old_plan))
    read = _Read(index, plan, reader, {}, [], {}, {}, None)
    reads = _reads_by_unit(plan, like.rank, old_plan)
    for i, old in enumerate(like.units):
        if _in_pieces(like, i):
            _store_pieces(like, i, reader, reads.get(i, []), (kinds, with_state), optimizer, read)
            continue
        if index["mid_accumulation"]:
            # in the accumulator's dtype (the plan's memory.grads), cast as it is read
            grad = torch.empty(grad_numel(plan, i, like.rank), dtype=old.grad.dtype)
            reader.read_whole(_grad_writer(plan, i, like.rank), f"grad/unit{i}", grad)
            read.grads[i] = grad
        if like.residence is None or not like.residence.holds(i):
            for kind in kinds:
                out = _in_place(like, i, kind)
                for _, r in reads.get(i, []):
                    s = reader.old_slice(r.old_rank, r.old_unit, r.old_offset)
                    reader.verify(r.old_rank, slice_key(kind, s.fqn, s.start, s.stop))
                read.fills.append(_Fill(i, kind, out, reads.get(i, [])))
            continue
        tensors = {kind: _new_partition(plan, like.rank, i) for kind in kinds}
        for kind, out in tensors.items():
            _fill(plan, reader, kind, out, reads.get(i, []))
        unit = _unit_from(old, tensors, index, optimizer, with_state)
        if i in read.grads:
            unit = unit._replace(grad=read.grads.pop(i).to(old.grad.device))
        like.residence.store_next(i, unit, index["mid_accumulation"])  # memory keeps none
        read.done[i] = old._replace(grad=unit.grad)
    on_disk = {t["key"] for t in index["tensors"] if t["fqn"] is None}
    for key, tensor in extras.module.items():
        if key not in on_disk:  # only without `strict` (checked above)
            continue
        saved = torch.empty(tensor.shape, dtype=partition.dtype_of(_saved_dtype(index, key)))
        reader.read_whole(0, f"module/{key}", saved)
        read.module[key] = saved
    read.client_state = reader.client_state(index)
    return read


def _in_pieces(like: TrainState, i: int) -> bool:
    """Whether unit `i` lives in a swap file that checkpoints move in pieces."""
    residence = like.residence
    return residence is not None and residence.holds(i) and residence.sub_group > 0


def _store_pieces(
    like: TrainState,
    i: int,
    reader: Reader,
    reads: list[tuple[int, Any]],
    kinds: tuple[list[str], bool],
    optimizer: Optimizer | None,
    read: _Read,
) -> None:
    """Unit i to its next slot piece by piece ([Note: checkpoints in pieces] in
    `fzero.core.swap_pieces`): every saved tensor it takes verified first, then read by
    byte range into each piece. A gradient accumulator kept in memory (it has its
    elements) is read whole into `read.grads`, as for a unit read whole."""
    assert like.residence is not None
    plan, old, mid = like.plan, like.units[i], read.index["mid_accumulation"]
    grad_key, (kinds_read, with_state) = f"grad/unit{i}", kinds
    for kind in kinds_read:
        for _, r in reads:
            s = reader.old_slice(r.old_rank, r.old_unit, r.old_offset)
            reader.verify(r.old_rank, slice_key(kind, s.fqn, s.start, s.stop))
    if mid and old.grad.numel():
        grad = torch.empty(grad_numel(plan, i, like.rank), dtype=old.grad.dtype)
        reader.read_whole(like.rank, grad_key, grad)
        read.grads[i] = grad
    elif mid:
        reader.verify(like.rank, grad_key)

    def fill(kind: str, start: int, out: Tensor) -> None:
        if kind == "grad":
            reader.read_span(like.rank, grad_key, start, out)
            return
        out.zero_()  # the padding no saved slice covers
        prefixed = kind if kind == "master" else f"optim.{kind}"
        _fill_span(plan, reader, prefixed, (start, out), reads)

    if with_state:
        init, optim = None, old.optim._replace(**read.index["optimizer"]["scalars"])
    else:  # load_optimizer_states=False: the moments start afresh
        assert optimizer is not None
        dtype = _state_dtype(old.optim)
        init = functools.partial(init_state, optimizer, dtype=dtype)
        optim = init_state(optimizer, torch.empty(0), dtype)
    like.residence.store_pieces(i, PieceSource(fill, optim, init), mid)
    grad = read.grads.pop(i, None)
    read.done[i] = old if grad is None else old._replace(grad=grad.to(old.grad.device))


def _fill_span(
    plan: Plan, reader: Reader, kind: str, span: tuple[int, Tensor], reads: list[tuple[int, Any]]
) -> None:
    """`_fill` of elements [start, start + len(out)) of a unit's partition only, each
    overlapping read by byte range (`Reader.read_span`)."""
    start, out = span
    stop = start + out.numel()
    for target, r in reads:
        unit = plan.units[r.new_unit]
        at = r.new_offset + (unit.shard_range(target)[0] if plan.stage_of(unit) == 0 else 0)
        low, high = max(start, at), min(stop, at + r.numel)
        if low >= high:
            continue
        s = reader.old_slice(r.old_rank, r.old_unit, r.old_offset)
        begin = r.old_offset - s.shard_offset + (low - at)
        key = slice_key(kind, s.fqn, s.start, s.stop)
        reader.read_span(r.old_rank, key, begin, out[low - start : high - start])


def _unit_from(
    old: UnitState,
    tensors: dict[str, Tensor],
    index: Mapping[str, Any],
    optimizer: Optimizer | None,
    with_state: bool,
) -> UnitState:
    """A unit of the restored state: the loaded master and optimizer state on the devices
    of `old`'s; parameters and gradient are still `old`'s (`restore` writes them)."""
    device = old.master.device
    master = tensors["master"].to(device, old.master.dtype)
    if with_state:
        fields = {
            k: t.to(device, getattr(old.optim, k).dtype)
            for k, t in ((k.removeprefix("optim."), t) for k, t in tensors.items())
            if k != "master"
        }
        optim = old.optim._replace(**fields, **index["optimizer"]["scalars"])
    else:
        assert optimizer is not None
        optim = init_state(optimizer, master, _state_dtype(old.optim))
    return UnitState(master, optim, old.params, old.grad)


def _state_dtype(optim: Any) -> torch.dtype:
    """The dtype of an optimizer state's floating tensors (fp32 when it has none)."""
    tensors = [v for v in optim._asdict().values() if isinstance(v, Tensor)]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def _viewed(like: TrainState, i: int) -> bool:
    """Whether `like`'s unit i keeps its master as a view of its parameters (fp32)."""
    old = like.units[i]
    if old.params is None or old.params.numel() != like.plan.units[i].numel:
        return False
    return (
        old.master.numel() > 0
        and old.params[optimizer_partition(like.plan, like.plan.units[i], like.rank)].data_ptr()
        == old.master.data_ptr()
    )


def _in_place(like: TrainState, i: int, kind: str) -> Tensor:
    """Where unit i's partition of `kind` is read in the second pass: `like`'s own buffer
    when it is fp32 or bf16, contiguous and in host memory, else a new one; its padding
    zeroed (the reads fill every other element, cast to the buffer's dtype)."""
    old = like.units[i]
    out = old.master if kind == "master" else getattr(old.optim, kind.removeprefix("optim."))
    numel, gaps = _layout(like.plan, like.rank, i)
    if not (
        out.device.type == "cpu"
        and out.dtype in (torch.float32, torch.bfloat16)
        and out.is_contiguous()
        and out.numel() == numel
    ):
        return _new_partition(like.plan, like.rank, i)
    for start, stop in gaps:
        out[start:stop].zero_()
    return out


def _grad_writer(plan: Plan, i: int, rank: int) -> int:
    """The plan rank whose file holds the accumulator of unit i that `rank` holds: its
    own, but a reduced shard of a unit on its own axes (stages 2-3) its replica 0's."""
    unit = plan.units[i]
    if plan.stage_of(unit) < 2:
        return rank
    return plan.shard_writer(unit, plan.shard_index(unit, rank))


def _layout(plan: Plan, rank: int, i: int) -> tuple[int, list[tuple[int, int]]]:
    """The numel of unit i's partition on `rank` and the ranges no saved slice covers."""
    unit = plan.units[i]
    whole = plan.stage_of(unit) == 0
    ranks = range(plan.world_size) if whole else [rank]
    covered = []
    for r in ranks:
        for s in partition.local_slices(plan, r):
            if s.unit == i:
                base = unit.shard_range(r)[0] if whole else 0
                covered.append((base + s.shard_offset, s.numel))
    numel = unit.numel if whole else unit.shard_size(plan.shard_index(unit, rank))
    gaps, at = [], 0
    for start, count in sorted(covered):
        gaps.append((at, start))
        at = start + count
    gaps.append((at, numel))
    return numel, [(a, b) for a, b in gaps if b > a]


def _new_partition(plan: Plan, rank: int, i: int) -> Tensor:
    """An uninitialised fp32 buffer like the unit's partition, its padding zeroed."""
    numel, gaps = _layout(plan, rank, i)
    buffer = torch.empty(numel, dtype=torch.float32)
    hugepage_hint(buffer)
    for start, stop in gaps:
        buffer[start:stop].zero_()
    return buffer


def _check_model(
    plan: Plan,
    rank: int,
    old_plan: Plan,
    index: Mapping[str, Any],
    directory: str,
    module: Mapping[str, Tensor],
    strict: bool = True,
) -> None:
    try:
        partition.reshard_reads(old_plan, plan, rank)
    except PlanError as error:
        raise CheckpointError(f"{directory} does not fit this model: {error}") from None
    if not module:
        return
    saved = {t["key"]: t for t in index["tensors"] if t["fqn"] is None}
    missing = sorted(set(module) - set(saved))
    unexpected = sorted(set(saved) - set(module))
    changed = sorted(
        f"{k}: {tuple(saved[k]['shape'])} -> {tuple(module[k].shape)}"
        for k in set(saved) & set(module)
        if tuple(saved[k]["shape"]) != tuple(module[k].shape)
    )
    if not strict:
        missing = unexpected = []
    differences = [
        f"{what} {names}"
        for what, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape changed", changed),
        )
        if names
    ]
    if differences:
        raise CheckpointError(
            f"{directory} does not fit this model's frozen parameters and buffers: "
            + "; ".join(differences)
        )


def _check_optimizer(
    like: TrainState, optimizer: Optimizer | None, index: Mapping[str, Any], directory: str
) -> None:
    saved = index["optimizer"]
    name = optimizer.name if optimizer is not None else saved["name"]
    if saved["name"] != name or saved["kinds"] != state_kinds(like):
        raise CheckpointError(
            f"{directory} holds {saved['name']} state {saved['kinds']}; this run uses "
            f"{name} with {state_kinds(like)}: pass load_optimizer_states=False to load the "
            "weights only"
        )


def _reads_by_unit(plan: Plan, rank: int, old_plan: Plan) -> dict[int, list[tuple[int, Any]]]:
    """The reshard reads that fill this rank's partitions (a unit at stage 0: every rank's
    part of its whole buffer), by new unit: (target rank, read)."""
    targets = range(plan.world_size) if plan.runs_stage(lambda s: s == 0) else [rank]
    by_unit: dict[int, list[tuple[int, Any]]] = {}
    for target in targets:
        for read in partition.reshard_reads(old_plan, plan, target):
            if target == rank or plan.stage_of(read.new_unit) == 0:
                by_unit.setdefault(read.new_unit, []).append((target, read))
    return by_unit


def _fill(plan: Plan, reader: Reader, kind: str, out: Tensor, reads: list[tuple[int, Any]]) -> None:
    """One unit's new partition buffer of `kind`, from whichever old ranks hold it."""
    for target, read in reads:
        unit = plan.units[read.new_unit]
        at = read.new_offset + (unit.shard_range(target)[0] if plan.stage_of(unit) == 0 else 0)
        old = reader.old_slice(read.old_rank, read.old_unit, read.old_offset)
        key = slice_key(kind, old.fqn, old.start, old.stop)
        reader.read_range(
            read.old_rank, key, read.old_offset - old.shard_offset, out[at : at + read.numel]
        )


def _saved_dtype(index: Mapping[str, Any], key: str) -> str:
    return next(t["dtype"] for t in index["tensors"] if t["key"] == key)
