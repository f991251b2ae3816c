"""`save` / `restore`: a `TrainState` to and from a sharded checkpoint (collective).

A save writes, on every rank, the slices of the plan's tensors it owns
(`partition.local_slices`) — fp32 masters and each optimizer state tensor, named
`{kind}/{fqn}/{start}:{stop}` — and mid-accumulation its gradient accumulators, to
`rank{r:05d}.safetensors`; rank 0 adds the module's frozen parameters and buffers
(`module=`). Everything goes to `save_dir/.{tag}.partial/`; each file is fsynced, rank 0
writes the index once every rank has reported its checksums, renames the directory to
`save_dir/{tag}` and only then replaces `save_dir/latest` (write, fsync, rename). A crash
at any point leaves the previous `latest` loadable.

A restore reads the old plan from the index and fills the new plan's partitions with
`partition.reshard_reads`, so world size, stage and strategy may all change. Every rank
reads its part into new buffers, then all ranks agree that every read succeeded before
anything is replaced: a damaged file seen by one rank fails the restore everywhere and
loses nothing. Units that do not live in memory (the engine's NVMe offload) are read one
at a time through the state's `Residence`.

The engine's `save_checkpoint` / `load_checkpoint` are these with the engine's extras
(`Extras`: its config, batch sizes, scheduler, the process's random state).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import shutil
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm, partition
from fzero._train_state import Counters, TrainState, UnitState, publish
from fzero._version import __version__
from fzero.checkpoint._files import (
    CheckpointError,
    fsync_dir,
    hugepage_hint,
    write_safetensors,
    write_safetensors_stream,
)
from fzero.checkpoint._format import (
    CLIENT_FILE,
    FAULT_VARIABLE,
    INDEX,
    MODEL_16BIT,
    AsyncSave,
    Reader,
    check_tag,
    jsonable,
    rank_file,
    read_index,
    read_latest,
    slice_key,
    write_durably,
)
from fzero.checkpoint._index import encode_client_state, pack
from fzero.optim import LossScaleState, Optimizer
from fzero.partition import Plan, PlanError

__all__ = ["Extras", "Restored", "module_tensors", "restore", "save", "wait_for_save"]

log = logging.getLogger("fzero")


@dataclass(frozen=True)
class Extras:
    """What a checkpoint records besides the `TrainState` and how it is written.

    `module`: frozen parameters and buffers by state_dict key (rank 0 writes them);
    `keys`: the model's state_dict keys in order (default: the plan's names); `config`,
    `precision`, `batch`, `scheduler`: index records for whoever reads it back;
    `model_16bit`: a consolidated model written beside the shards; `rng`: this rank's
    random state (default: the state's generator); `group_key`: which side process group
    carries the checkpoint's collectives (`comm.side_group`)."""

    module: Mapping[str, Tensor] = field(default_factory=dict)
    keys: Sequence[str] | None = None
    config: Any = None
    precision: str | None = None
    batch: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None
    model_16bit: Mapping[str, Tensor] = field(default_factory=dict)
    rng: Mapping[str, Any] | None = None
    group_key: int = -1


def module_tensors(plan: Plan, module: torch.nn.Module) -> dict[str, Tensor]:
    """`module`'s frozen parameters and buffers: state_dict entries the plan does not hold."""
    managed = set()
    for spec in plan.manifest.tensors:
        managed.update((spec.fqn, *spec.aliases))
    return {
        key: t.detach()
        for key, t in module.state_dict(keep_vars=True).items()
        if key not in managed
    }


def _extras_of(plan: Plan, module: torch.nn.Module | None, extras: Extras | None) -> Extras:
    if extras is not None:
        return extras
    if module is None:
        return Extras()
    keys = list(module.state_dict(keep_vars=True))
    return Extras(module=module_tensors(plan, module), keys=keys)


# ---- what a rank holds -------------------------------------------------------------------


def state_kinds(state: TrainState) -> list[str]:
    """The tensor kinds of the optimizer state (`optim.exp_avg`, ...), from its fields."""
    first = state.units[0].optim if state.units else None
    if first is None:
        return []
    return [f"optim.{name}" for name, value in first._asdict().items() if isinstance(value, Tensor)]


def _buffer(unit: UnitState, kind: str) -> Tensor:
    if kind == "master":
        return unit.master
    return getattr(unit.optim, kind.removeprefix("optim."))


def _partition_start(state: TrainState, index: int) -> int:
    """Where the rank's owned shard starts inside its partition (stage 0 holds all)."""
    return state.plan.units[index].shard_range(state.rank)[0] if state.plan.stage == 0 else 0


def _grad_numel(plan: Plan, index: int) -> int:
    unit = plan.units[index]
    return unit.numel if plan.stage < 2 else unit.shard_numel


# One tensor of a rank file: its index record, the unit it belongs to (None: a module
# tensor), its safetensors spec, and how to get it from the unit resident.
_Entry = tuple[dict[str, Any], int | None, tuple[str, torch.dtype, tuple[int, ...]], Any]


def _save_entries(
    state: TrainState, mid_accumulation: bool, module: Mapping[str, Tensor]
) -> list[_Entry]:
    """What this rank's file holds, unit by unit: each slice of the master and of every
    state kind, mid-window the gradient accumulator; on rank 0, the module's tensors."""
    kinds = ["master", *state_kinds(state)]
    slices = partition.local_slices(state.plan, state.rank)
    entries: list[_Entry] = []
    for index in range(len(state.plan.units)):
        for kind in kinds:
            for s in (s for s in slices if s.unit == index):
                key = slice_key(kind, s.fqn, s.start, s.stop)
                at = _partition_start(state, index) + s.shard_offset
                record = {"key": key, "kind": kind, "fqn": s.fqn, "start": s.start, "stop": s.stop}
                get = functools.partial(_slice_of, kind, at, s.numel)
                entries.append((record, index, (key, torch.float32, (s.numel,)), get))
        if mid_accumulation:
            key, numel = f"grad/unit{index}", _grad_numel(state.plan, index)
            record = {"key": key, "kind": "grad", "fqn": None, "start": 0, "stop": numel}
            entries.append((record, index, (key, torch.float32, (numel,)), _grad_of))
    if state.rank == 0:
        for name, t in module.items():
            key = f"module/{name}"
            record = {"key": key, "kind": "module", "fqn": name, "start": 0, "stop": t.numel()}
            entries.append((record, None, (key, t.dtype, tuple(t.shape)), lambda _, t=t: t))
    return entries


def _slice_of(kind: str, at: int, numel: int, unit: UnitState) -> Tensor:
    return _buffer(unit, kind)[at : at + numel]


def _grad_of(unit: UnitState) -> Tensor:
    return unit.grad


def _entry_tensors(state: TrainState, entries: list[_Entry]) -> Iterator[Tensor]:
    """The entries' tensors in order, one unit resident at a time."""
    for index, group in itertools.groupby(entries, key=lambda entry: entry[1]):
        if index is None:
            yield from (get(None) for *_, get in group)
            continue
        with state.resident(index) as unit:
            yield from (get(unit) for *_, get in group)


def _tensor_table(plan: Plan, extras: Extras) -> list[dict[str, Any]]:
    """The model's state_dict keys in order, with shape, dtype and source."""
    canonical = {}
    for spec in plan.manifest.tensors:
        for name in (spec.fqn, *spec.aliases):
            canonical[name] = spec
    keys = extras.keys if extras.keys is not None else [*canonical, *extras.module]
    table = []
    for key in keys:
        if key in canonical:
            spec = canonical[key]
            table.append(
                {"key": key, "shape": list(spec.shape), "dtype": spec.dtype, "fqn": spec.fqn}
            )
        else:
            t = extras.module[key]
            dtype = partition.dtype_name(t.dtype)
            table.append({"key": key, "shape": list(t.shape), "dtype": dtype, "fqn": None})
    return table


def _state_rng(state: TrainState) -> dict[str, Any]:
    return {"torch": bytes(state.rng.tolist())} if state.rng is not None else {}


def _group(extras: Extras) -> Any:
    """A gloo group of its own, so a save thread's collectives never interleave with
    training's."""
    return comm.side_group(extras.group_key)


def same_on_every_rank(group: Any, call: str, **arguments: Any) -> None:
    """Ranks that pass different directories or tags (rank-local names, say) would pair
    up unrelated collectives and fail obscurely: say so first, naming each rank's."""
    if dist.get_world_size() == 1:
        return
    packed = comm.all_gather_bytes(msgpack.packb(arguments), group=group)
    every = [msgpack.unpackb(b) for b in packed]
    if any(value != every[0] for value in every):
        listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(
            f"{call}: ranks passed different arguments ({listing}); every rank must pass "
            "the same directory and tag"
        )


# ---- save ---------------------------------------------------------------------------------

# Asynchronous saves still being written, by who started them (an engine, or None).
_SAVES: dict[int, AsyncSave] = {}
_WAIT_AT_EXIT: set[int] = set()


def wait_for_save(owner: Any = None) -> None:
    """Block until `owner`'s asynchronous save (if any) is written; raise its error."""
    pending = _SAVES.pop(id(owner), None)
    if pending is not None:
        pending.wait()


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    optimizer: Optimizer,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    module: torch.nn.Module | None = None,
    accumulation: int | None = None,
    save_latest: bool = True,
    async_save: bool = False,
    extras: Extras | None = None,
    owner: Any = None,
) -> str:
    """Save `state` to `directory/tag` (default tag `global_step{N}`) and point
    `directory/latest` at it; collective. `optimizer` is the one the state was built
    with (its name is recorded and checked on restore). `client_state` (ints, floats,
    strings, lists, dicts, tensors) comes back from `restore`. `module` adds the model's
    frozen parameters and buffers and its state_dict key order (so the checkpoint
    consolidates to the model's own state dict). `accumulation`: the gradient
    accumulation steps, to know a save mid-window, whose accumulators are saved too
    (default: mid-window when any rank's accumulator holds a gradient). With
    `async_save`, tensors are copied to host memory and written by a background thread;
    the next save or restore by the same `owner`, or the process exit, waits for it and
    raises its error. Returns the checkpoint's directory."""
    wait_for_save(owner)
    extras = _extras_of(state.plan, module, extras)
    tag = check_tag(tag if tag is not None else f"global_step{state.step}", "save_checkpoint")
    save_dir = os.fspath(directory)
    group = _group(extras)
    same_on_every_rank(group, "save_checkpoint", save_dir=save_dir, tag=tag)
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    if state.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    client_tensors: dict[str, Tensor] = {}
    encoded_client = encode_client_state(dict(client_state or {}), client_tensors)
    mid_accumulation = _mid_accumulation(state, accumulation)
    entries = _save_entries(state, mid_accumulation, extras.module)
    records = [record for record, *_ in entries]
    specs = [spec for _, _, spec, _ in entries]
    body = _index_body(state, optimizer, extras, tag, mid_accumulation, accumulation)
    body["client_state"] = encoded_client
    rng = dict(extras.rng) if extras.rng is not None else _state_rng(state)
    model_16bit = {k: v.contiguous() for k, v in extras.model_16bit.items()}
    dist.barrier(group=group)  # the partial directory exists for everyone
    if async_save:  # host copies of everything (NVMe offload: read back first)
        tensors = [
            t.detach().to("cpu", copy=True).contiguous() for t in _entry_tensors(state, entries)
        ]
        client_tensors = {k: v.clone() for k, v in client_tensors.items()}
        stream: Iterable[Tensor] = tensors
    else:  # written as produced: NVMe offload holds one unit at a time
        stream = (t.detach().cpu().contiguous() for t in _entry_tensors(state, entries))

    def write() -> None:
        _write(
            group,
            state.rank,
            (save_dir, tag, partial, final),
            (specs, stream),
            records,
            rng,
            body,
            {CLIENT_FILE: client_tensors, MODEL_16BIT: model_16bit},
            save_latest,
        )

    if not async_save:
        write()
        return final
    if id(owner) not in _WAIT_AT_EXIT:  # the process's exit waits for the last save
        atexit.register(wait_for_save, owner)
        _WAIT_AT_EXIT.add(id(owner))
    _SAVES[id(owner)] = AsyncSave(write)
    return final


def _mid_accumulation(state: TrainState, accumulation: int | None) -> bool:
    """Whether `state` is inside an accumulation window (collective without
    `accumulation`: a step zeroes the accumulators, so any gradient left says so)."""
    if accumulation is not None:
        return state.counters.micro_steps % accumulation != 0
    flag = torch.tensor([float(any(bool(u.grad.any()) for u in state.units))])
    if state.plan.world_size > 1:
        comm.all_reduce(flag, op="max")
    return bool(flag.item())


def _index_body(
    state: TrainState,
    optimizer: Optimizer,
    extras: Extras,
    tag: str,
    mid: bool,
    accumulation: int | None,
) -> dict[str, Any]:
    first = state.units[0].optim if state.units else None
    scalars = {
        k: v for k, v in (first._asdict().items() if first else ()) if not isinstance(v, Tensor)
    }
    batch = {"train_batch_size": None, "micro_batch_size": None, **(extras.batch or {})}
    batch["gradient_accumulation_steps"] = accumulation
    scheduler = {"lr_steps": state.counters.lr_steps, "client": None, "client_groups": None}
    return {
        "tag": tag,
        "fzero_version": __version__,
        "world_size": state.plan.world_size,
        "stage": state.plan.stage,
        "precision": extras.precision or _precision(state),
        "plan": partition.to_bytes(state.plan),
        "counters": state.counters._asdict(),
        "batch": batch,
        "mid_accumulation": mid,
        "config": jsonable(extras.config),
        "optimizer": {
            "name": optimizer.name,
            "hparams": jsonable(optimizer.hparams),
            "scalars": scalars,
            "kinds": state_kinds(state),
        },
        "scheduler": {**scheduler, **(extras.scheduler or {})},
        "loss_scale": list(state.loss_scale) if state.loss_scale else None,
        "tensors": _tensor_table(state.plan, extras),
    }


def _precision(state: TrainState) -> str:
    dtype = next((u.params.dtype for u in state.units if u.params is not None), torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _write(
    group: Any,
    rank: int,
    paths: tuple[str, str, str, str],
    tensors: tuple[list[Any], Iterable[Tensor]],
    records: list[dict[str, Any]],
    rng: dict[str, Any],
    body: dict[str, Any],
    extra_files: dict[str, dict[str, Tensor]],
    save_latest: bool,
) -> None:
    save_dir, tag, partial, final = paths
    specs, stream = tensors
    written = write_safetensors_stream(os.path.join(partial, rank_file(rank)), specs, stream)
    if os.environ.get(FAULT_VARIABLE) == f"kill-rank-{rank}":
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die with a half-written save
    for record in records:
        record["crc"] = written.crcs[record["key"]]
    mine = {
        "file": written.name,
        "size": written.size,
        "checksum": written.checksum,
        "slices": records,
        "rng": rng,
    }
    reports = comm.all_gather_bytes(msgpack.packb(mine, use_bin_type=True), group=group)
    if rank == 0:
        files = {}
        for name, contents in extra_files.items():
            if contents:
                extra = write_safetensors(os.path.join(partial, name), contents.items())
                files[name] = {"size": extra.size, "checksum": extra.checksum, "crcs": extra.crcs}
        body = {**body, "ranks": [msgpack.unpackb(r, raw=False) for r in reports], "files": files}
        write_durably(os.path.join(partial, INDEX), pack(body))
        fsync_dir(partial)
        if os.path.exists(final):
            old = os.path.join(save_dir, f".{tag}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(partial, final)
            shutil.rmtree(old)
        else:
            os.rename(partial, final)
        fsync_dir(save_dir)
        if save_latest:
            write_durably(os.path.join(save_dir, "latest.partial"), tag.encode())
            os.replace(os.path.join(save_dir, "latest.partial"), os.path.join(save_dir, "latest"))
            fsync_dir(save_dir)
        log.info("fzero: saved checkpoint %s", final)
    dist.barrier(group=group)  # committed for everyone


# ---- restore --------------------------------------------------------------------------------


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
    owner: Any = None,
    install: bool = True,
) -> Restored:
    """Read the checkpoint `directory/tag` (default: the tag in `directory/latest`) into a
    state laid out like `like` (its plan — any world size, stage or strategy may have
    saved it — dtypes and devices); collective. `optimizer` checks the saved optimizer's
    name, and re-initialises the state when `load_optimizer_states` is False. `module`
    checks (and `Restored.module` returns) the frozen parameters and buffers.
    With `install` (the default) the new masters are also written to the compute-dtype
    parameters (collective), so the returned state is ready to train; the counters,
    loss scale and generator come from the checkpoint (with `accumulation`, micro-steps
    are realigned to it when the save was at a boundary). `like` is consumed (as by a
    step): the restored state reuses its parameter and gradient buffers. If any rank
    cannot read its part, every rank raises `CheckpointError` and `like` is untouched."""
    wait_for_save(owner)
    extras = _extras_of(like.plan, module, extras)
    group = _group(extras)
    found = find(directory, tag)
    same_on_every_rank(group, "load_checkpoint", load_dir=os.fspath(directory), tag=tag)
    if found is None:
        raise CheckpointError(
            f"no checkpoint in {os.fspath(directory)} (tag {tag!r}): nothing to restore"
        )
    try:
        index, units, staged, client_state = _read(
            found, like, optimizer, extras, load_optimizer_states
        )
        failure = ""
    except (CheckpointError, OSError) as error:
        failure = str(error)
    # Every rank learns whether every rank could read its part before anything changes.
    failures = comm.all_gather_bytes(failure.encode(), group=group)
    messages = [f"rank {r}: {m.decode()}" for r, m in enumerate(failures) if m]
    if messages:
        raise CheckpointError("; ".join(messages))
    counters = restored_counters(index, accumulation)
    loss_scale = like.loss_scale
    if index["loss_scale"] is not None and like.loss_scale is not None:
        loss_scale = LossScaleState(*index["loss_scale"])
    rng = like.rng
    if like.rng is not None and like.rank < index["world_size"]:
        saved = index["ranks"][like.rank]["rng"].get("torch")
        rng = torch.tensor(list(saved), dtype=torch.uint8) if saved is not None else rng
    if install:
        units = tuple(_install(like, i, unit) for i, unit in enumerate(units))
    state = like.replace(units=units, counters=counters, loss_scale=loss_scale, rng=rng)
    return Restored(state, client_state, staged, found, index)


def _install(like: TrainState, i: int, unit: UnitState) -> UnitState:
    """Unit i of the restored state, ready to train: the master written to the
    parameters (all-gathered where whole), held once again as their view when it was;
    the gradient accumulator zeroed unless it was loaded. Collective."""
    old = like.units[i]
    if unit.grad is old.grad:
        old.grad.zero_()
    else:
        old.grad.copy_(unit.grad)
    publish(like.plan, like.rank, i, unit)
    if _viewed(like, i):
        assert unit.params is not None
        unit = unit._replace(master=unit.params[_part(like, i)])
    return unit._replace(grad=old.grad)


def restored_counters(index: Mapping[str, Any], accumulation: int | None) -> Counters:
    """The saved counters; at a boundary, micro-steps realigned to `accumulation`."""
    counters = Counters(**index["counters"])
    if accumulation is not None and not index["mid_accumulation"]:  # it may have changed
        counters = counters._replace(micro_steps=counters.global_steps * accumulation)
    return counters


def _read(
    directory: str,
    like: TrainState,
    optimizer: Optimizer | None,
    extras: Extras,
    with_state: bool,
) -> tuple[dict[str, Any], tuple[UnitState, ...], dict[str, Tensor], Any]:
    """Everything this rank needs from the checkpoint, read into new buffers unit by unit
    (units outside memory go to their next slot through `like.residence`)."""
    index = read_index(directory)
    old_plan = partition.from_bytes(index["plan"])
    plan = like.plan
    _check_model(plan, like.rank, old_plan, index, directory, extras.module)
    if index["mid_accumulation"] and (index["world_size"] != plan.world_size or old_plan != plan):
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
    units: list[UnitState] = []
    with Reader(directory, index, old_plan) as reader:
        reads = _reads_by_unit(plan, like.rank, old_plan)
        for i, old in enumerate(like.units):
            tensors = {kind: _new_partition(plan, like.rank, i) for kind in kinds}
            for kind, out in tensors.items():
                _fill(plan, reader, kind, out, reads.get(i, []))
            unit = _unit_from(old, tensors, index, optimizer, with_state)
            if index["mid_accumulation"]:
                grad = torch.empty(_grad_numel(plan, i), dtype=torch.float32)
                reader.read_whole(like.rank, f"grad/unit{i}", grad)
                unit = unit._replace(grad=grad.to(old.grad.device))
            if like.residence is not None:  # to the unit's next slot; memory keeps none of it
                like.residence.store_next(i, unit, index["mid_accumulation"])
                unit = old._replace(grad=unit.grad)
            units.append(unit)
        staged = {}
        for key, tensor in extras.module.items():
            saved = torch.empty(tensor.shape, dtype=partition.dtype_of(_saved_dtype(index, key)))
            reader.read_whole(0, f"module/{key}", saved)
            staged[key] = saved
        client_state = reader.client_state(index)
    return index, tuple(units), staged, client_state


def _unit_from(
    old: UnitState,
    tensors: dict[str, Tensor],
    index: Mapping[str, Any],
    optimizer: Optimizer | None,
    with_state: bool,
) -> UnitState:
    """A unit of the restored state: the loaded master and optimizer state on the devices
    of `old`'s; parameters and gradient are still `old`'s (`restore` writes them)."""
    master = tensors["master"].to(old.master.device)
    if with_state:
        fields = {k.removeprefix("optim."): t.to(old.master.device) for k, t in tensors.items()}
        fields.pop("master")
        optim = old.optim._replace(**fields, **index["optimizer"]["scalars"])
    else:
        assert optimizer is not None
        optim = optimizer.init(master)
    return UnitState(master, optim, old.params, old.grad)


def _part(like: TrainState, i: int) -> slice:
    """The rank's optimizer partition of unit i (the whole buffer at stage 0)."""
    unit = like.plan.units[i]
    return slice(0, unit.numel) if like.plan.stage == 0 else slice(*unit.shard_range(like.rank))


def _viewed(like: TrainState, i: int) -> bool:
    """Whether `like`'s unit i keeps its master as a view of its parameters (fp32)."""
    old = like.units[i]
    if old.params is None or old.params.numel() != like.plan.units[i].numel:
        return False
    return old.master.numel() > 0 and old.params[_part(like, i)].data_ptr() == old.master.data_ptr()


def _new_partition(plan: Plan, rank: int, i: int) -> Tensor:
    """An uninitialised fp32 buffer like the unit's partition, its padding zeroed (the
    reads fill every other element)."""
    unit = plan.units[i]
    ranks = range(plan.world_size) if plan.stage == 0 else [rank]
    covered = []
    for r in ranks:
        for s in partition.local_slices(plan, r):
            if s.unit == i:
                base = unit.shard_range(r)[0] if plan.stage == 0 else 0
                covered.append((base + s.shard_offset, s.numel))
    numel = unit.numel if plan.stage == 0 else unit.shard_numel
    buffer = torch.empty(numel, dtype=torch.float32)
    hugepage_hint(buffer)
    at = 0
    for start, count in sorted(covered):
        buffer[at:start].zero_()
        at = start + count
    buffer[at:].zero_()
    return buffer


def _check_model(
    plan: Plan,
    rank: int,
    old_plan: Plan,
    index: Mapping[str, Any],
    directory: str,
    module: Mapping[str, Tensor],
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
    if missing or unexpected or changed:
        raise CheckpointError(
            f"{directory} does not fit this model's frozen parameters and buffers: missing "
            f"{missing}, unexpected {unexpected}, shape changed {changed}"
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
    """The reshard reads that fill this rank's partitions (stage 0: every rank's part of
    the whole buffers), by new unit: (target rank, read)."""
    targets = range(plan.world_size) if plan.stage == 0 else [rank]
    by_unit: dict[int, list[tuple[int, Any]]] = {}
    for target in targets:
        for read in partition.reshard_reads(old_plan, plan, target):
            by_unit.setdefault(read.new_unit, []).append((target, read))
    return by_unit


def _fill(plan: Plan, reader: Reader, kind: str, out: Tensor, reads: list[tuple[int, Any]]) -> None:
    """One unit's new partition buffer of `kind`, from whichever old ranks hold it."""
    for target, read in reads:
        unit = plan.units[read.new_unit]
        at = read.new_offset + (unit.shard_range(target)[0] if plan.stage == 0 else 0)
        old = reader.old_slice(read.old_rank, read.old_unit, read.old_offset)
        key = slice_key(kind, old.fqn, old.start, old.stop)
        reader.read_range(
            read.old_rank, key, read.old_offset - old.shard_offset, out[at : at + read.numel]
        )


def _saved_dtype(index: Mapping[str, Any], key: str) -> str:
    return next(t["dtype"] for t in index["tensors"] if t["key"] == key)
