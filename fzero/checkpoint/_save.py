"""`save`: a `TrainState` to a sharded checkpoint (collective).

Every rank writes the slices of the plan's tensors it owns (`partition.local_slices`) —
fp32 masters and each optimizer state tensor, named `{kind}/{fqn}/{start}:{stop}` — and
mid-accumulation its gradient accumulators, to `rank{r:05d}.safetensors`; rank 0 adds
the module's frozen parameters and buffers (`module=`). Everything goes to
`save_dir/.{tag}.partial/`; each file is fsynced, rank 0 writes the index once every rank
has reported its checksums, renames the directory to `save_dir/{tag}` and only then
replaces `save_dir/latest` (write, fsync, rename). A crash at any point leaves the
previous `latest` loadable. Units that do not live in memory (the engine's NVMe offload)
are read one at a time through the state's `SwappedUnits`, or with sub-groups a piece
of one kind at a time ([Note: checkpoints in pieces] in `fzero.core.swap_pieces`).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm, partition
from fzero._version import __version__
from fzero.checkpoint._checksum import WRITE_ALGORITHM
from fzero.checkpoint._files import (
    Chunks,
    WrittenFile,
    fsync_dir,
    write_safetensors,
    write_safetensors_stream,
)
from fzero.checkpoint._format import (
    CLIENT_FILE,
    INDEX,
    MODEL_16BIT,
    AsyncSave,
    check_tag,
    jsonable,
    rank_file,
    slice_key,
    write_durably,
)
from fzero.checkpoint._index import encode_client_state, pack
from fzero.core.groups import groups_of
from fzero.core.state import TrainState, UnitState
from fzero.optim import Optimizer
from fzero.partition import Plan

__all__ = [
    "Extras",
    "WrittenModel",
    "extras_of",
    "grad_numel",
    "module_tensors",
    "same_on_every_rank",
    "save",
    "side_group",
    "state_kinds",
    "wait_for_save",
]

log = logging.getLogger("fzero")


class WrittenModel(NamedTuple):
    """A safetensors file written before the save (`write_safetensors_stream`'s result
    for `path`), moved into the checkpoint as it commits."""

    path: str
    written: WrittenFile


@dataclass(frozen=True)
class Extras:
    """What a checkpoint records besides the `TrainState` and how it is written.

    `module`: frozen parameters and buffers by state_dict key (rank 0 writes them);
    `keys`: the model's state_dict keys in order (default: the plan's names); `config`,
    `precision`, `batch`, `scheduler`: index records for whoever reads it back;
    `model_16bit`: a consolidated model written beside the shards (its tensors, or a
    `WrittenModel`: a file written already, one unit at a time); `rng`: this rank's
    random state (default: the state's generator); `group_key`: which side process group
    carries the checkpoint's collectives (`comm.side_group`); `frozen`: the keys of
    `module` that are frozen parameters (the others are buffers)."""

    module: Mapping[str, Tensor] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()
    keys: Sequence[str] | None = None
    config: Any = None
    precision: str | None = None
    batch: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None
    model_16bit: Mapping[str, Tensor] | WrittenModel = field(default_factory=dict)
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


def frozen_keys(module: torch.nn.Module, tensors: Mapping[str, Any]) -> frozenset[str]:
    """The state_dict keys among `tensors` that are parameters (frozen ones: the plan
    holds the trainable), not buffers."""
    entries = module.state_dict(keep_vars=True)
    return frozenset(k for k in tensors if isinstance(entries[k], torch.nn.Parameter))


def extras_of(plan: Plan, module: torch.nn.Module | None, extras: Extras | None) -> Extras:
    if extras is not None:
        return extras
    if module is None:
        return Extras()
    keys = list(module.state_dict(keep_vars=True))
    tensors = module_tensors(plan, module)
    return Extras(module=tensors, keys=keys, frozen=frozen_keys(module, tensors))


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
    whole = state.plan.stage_of(index) == 0
    return state.plan.shard_range(state.plan.units[index], state.rank)[0] if whole else 0


def grad_numel(plan: Plan, index: int, rank: int) -> int:
    unit = plan.units[index]
    return unit.numel if plan.stage_of(unit) < 2 else plan.grads_size(unit, rank)


class _Entry(NamedTuple):
    """One tensor of a rank file: its index record, the unit it belongs to (None: a
    module tensor), its safetensors spec, how to get it from the unit resident, and
    which elements of the unit it is when read in pieces (kind, begin, end)."""

    record: dict[str, Any]
    unit: int | None
    spec: tuple[str, torch.dtype, tuple[int, ...]]
    get: Any
    span: tuple[str, int, int] | None = None


def _save_entries(
    state: TrainState, mid_accumulation: bool, module: Mapping[str, Tensor]
) -> list[_Entry]:
    """What this rank's file holds, unit by unit: each slice of the master and of every
    state kind, mid-window the gradient accumulator; on rank 0, the module's tensors."""
    kinds = ["master", *state_kinds(state)]
    slices = partition.written_slices(state.plan, state.rank)
    entries: list[_Entry] = []
    for index in range(len(state.plan.units)):
        for kind in kinds:
            dtype = stored_dtype(state, kind, index)
            for s in (s for s in slices if s.unit == index):
                key = slice_key(kind, s.fqn, s.start, s.stop)
                at = _partition_start(state, index) + s.shard_offset
                record = {"key": key, "kind": kind, "fqn": s.fqn, "start": s.start, "stop": s.stop}
                get = functools.partial(_slice_of, kind, at, s.numel, dtype)
                span = (kind.removeprefix("optim."), at, at + s.numel)
                entries.append(_Entry(record, index, (key, dtype, (s.numel,)), get, span))
        unit = state.plan.units[index]
        shared = state.plan.unit_replica(unit, state.rank) and state.plan.stage_of(unit) >= 2
        if mid_accumulation and not shared:  # a reduced shard's replicas hold it alike
            key, numel = f"grad/unit{index}", grad_numel(state.plan, index, state.rank)
            record = {"key": key, "kind": "grad", "fqn": None, "start": 0, "stop": numel}
            dtype = stored_dtype(state, "grad", index)  # the plan's memory.grads
            spec = (key, dtype, (numel,))
            get = functools.partial(_grad_of, dtype)
            entries.append(_Entry(record, index, spec, get, ("grad", 0, numel)))
    if state.rank == 0:
        for name, t in module.items():
            key = f"module/{name}"
            record = {"key": key, "kind": "module", "fqn": name, "start": 0, "stop": t.numel()}
            spec = (key, t.dtype, tuple(t.shape))
            entries.append(_Entry(record, None, spec, lambda _, t=t: t))
    return entries


def stored_dtype(state: TrainState, kind: str, index: int) -> torch.dtype:
    """The dtype a checkpoint keeps unit `index`'s `kind` in: the state's own (bf16
    masters and moments stay bf16, unit by unit: `Plan.states_dtype`); a unit in the
    swap file, each kind in the file's dtype for it."""
    residence = state.residence
    if kind == "grad":  # in the file, or in memory beside it (`swap_gradients` false)
        in_file = residence is not None and residence.grad_in_file(index)
        return residence.grad_dtype if in_file else state.units[index].grad.dtype
    if residence is not None and residence.holds(index):
        return residence.master_dtype if kind == "master" else residence.state_dtype
    return _buffer(state.units[index], kind).dtype


def _slice_of(kind: str, at: int, numel: int, dtype: torch.dtype, unit: UnitState) -> Tensor:
    """`numel` elements of `kind` from `at`, in `dtype` (NVMe bf16 moments are read back
    as fp32 copies of bf16 values: exact)."""
    return _buffer(unit, kind)[at : at + numel].to(dtype)


def _grad_of(dtype: torch.dtype, unit: UnitState) -> Tensor:
    """The unit's gradient accumulator in `dtype` (a swap file's bf16 one is read back as
    fp32 copies of bf16 values: exact)."""
    return unit.grad.to(dtype)


def _entry_tensors(state: TrainState, entries: list[_Entry]) -> Iterator[Tensor | Chunks]:
    """The entries' tensors in order, one unit resident at a time; a unit the swap file
    moves in sub-group pieces gives each entry as the parts of the pieces it overlaps
    (`Chunks`: [Note: checkpoints in pieces] in `fzero.core.swap_pieces`), each part
    valid until the next is asked for."""
    for index, group in itertools.groupby(entries, key=lambda entry: entry.unit):
        if index is None:
            yield from (entry.get(None) for entry in group)
        elif _in_pieces(state, index):
            assert state.residence is not None
            with state.residence.pieces(index) as pieces:
                for entry in group:
                    assert entry.span is not None
                    yield Chunks(pieces.span(*entry.span))
        else:
            with state.resident(index) as unit:
                yield from (entry.get(unit) for entry in group)


def _in_pieces(state: TrainState, index: int) -> bool:
    """Whether unit `index` lives in a swap file that checkpoints move in pieces."""
    residence = state.residence
    return residence is not None and residence.holds(index) and residence.sub_group > 0


def _to_host(tensor: Tensor | Chunks, copy: bool) -> Tensor | Chunks:
    """An entry on the host, contiguous (`copy`: a copy of its own, parts joined, for a
    writer that runs after the state moves on)."""
    if isinstance(tensor, Chunks):
        if copy:  # each part copied as it comes: the next overwrites its buffer
            parts = [part.detach().to("cpu", copy=True) for part in tensor.parts]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return Chunks(part.detach().cpu().contiguous() for part in tensor.parts)
    return tensor.detach().to("cpu", copy=copy).contiguous()


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
            frozen = key in extras.frozen  # else a buffer
            table.append(
                {"key": key, "shape": list(t.shape), "dtype": dtype, "fqn": None, "frozen": frozen}
            )
    return table


def _state_rng(state: TrainState) -> dict[str, Any]:
    return {"torch": bytes(state.rng.tolist())} if state.rng is not None else {}


def side_group(extras: Extras) -> Any:
    """A gloo group of its own, so a save thread's collectives never interleave with
    training's."""
    return comm.side_group(extras.group_key)


def same_on_every_rank(group: Any, call: str, **arguments: Any) -> None:
    """Ranks that pass different directories or tags (rank-local names, say) would pair
    up unrelated collectives and fail obscurely: say so first, naming each rank's."""
    if dist.get_world_size() == 1:
        return
    packed = comm.all_gather_bytes(
        msgpack.packb(arguments), group=group, what=f"{call}'s arguments"
    )
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


def wait_for_save(owner: object = None) -> None:
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
    owner: object = None,
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
    where = f"fzero.checkpoint.save (step {state.step})"
    with comm.named_operation(where, entry="always"):  # a rank that skipped it: named
        return _save(
            directory, state, optimizer, tag, client_state, module, accumulation,
            save_latest, async_save, extras, owner,
        )  # fmt: skip


def _save(
    directory: str | os.PathLike[str],
    state: TrainState,
    optimizer: Optimizer,
    tag: str | None,
    client_state: Mapping[str, Any] | None,
    module: torch.nn.Module | None,
    accumulation: int | None,
    save_latest: bool,
    async_save: bool,
    extras: Extras | None,
    owner: object,
) -> str:
    wait_for_save(owner)
    extras = extras_of(state.plan, module, extras)
    tag = check_tag(tag if tag is not None else f"global_step{state.step}", "save_checkpoint")
    save_dir = os.fspath(directory)
    group = side_group(extras)
    same_on_every_rank(group, "save_checkpoint", save_dir=save_dir, tag=tag)
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    if comm.get_rank() == 0:  # the process's (a mesh's replicas share plan ranks)
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    client_tensors: dict[str, Tensor] = {}
    encoded_client = encode_client_state(dict(client_state or {}), client_tensors)
    mid_accumulation = _mid_accumulation(state, accumulation)
    entries = _save_entries(state, mid_accumulation, extras.module)
    records = [entry.record for entry in entries]
    specs = [entry.spec for entry in entries]
    body = _index_body(state, optimizer, extras, tag, mid_accumulation, accumulation)
    body["client_state"] = encoded_client
    rng = dict(extras.rng) if extras.rng is not None else _state_rng(state)
    model_16bit = extras.model_16bit
    if not isinstance(model_16bit, WrittenModel):
        model_16bit = {k: v.contiguous() for k, v in model_16bit.items()}
    comm.barrier(group, what="the partial directory made")  # exists for everyone
    if async_save:  # host copies of everything (NVMe offload: read back first)
        tensors = [_to_host(t, copy=True) for t in _entry_tensors(state, entries)]
        client_tensors = {k: v.clone() for k, v in client_tensors.items()}
        stream: Iterable[Tensor | Chunks] = tensors
    else:  # written as produced: NVMe offload holds one unit (or piece) at a time
        stream = (_to_host(t, copy=False) for t in _entry_tensors(state, entries))

    def write() -> None:
        _write(
            group,
            state.rank,
            groups_of(state.plan).replica,
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
    if state.plan.processes > 1:
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
        **({"processes": state.plan.processes} if state.plan.replicas > 1 else {}),
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
        "checksum_algorithm": WRITE_ALGORITHM,
    }


def _precision(state: TrainState) -> str:
    dtype = next(
        (u.params.dtype if u.params is not None else u.master.dtype for u in state.units),
        torch.float32,
    )
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _write(
    group: Any,
    rank: int,
    replica: int,
    paths: tuple[str, str, str, str],
    tensors: tuple[list[Any], Iterable[Tensor | Chunks]],
    records: list[dict[str, Any]],
    rng: dict[str, Any],
    body: dict[str, Any],
    extra_files: dict[str, dict[str, Tensor] | WrittenModel],
    save_latest: bool,
) -> None:
    save_dir, tag, partial, final = paths
    specs, stream = tensors
    mine: dict[str, Any] = {"rank": rank, "rng": rng}
    if replica == 0:  # a mesh's other replicas hold the same shards: they write nothing
        path = os.path.join(partial, rank_file(rank))
        written = write_safetensors_stream(path, specs, stream)
        for record in records:
            record["crc"] = written.tensor_digests[record["key"]]
        mine.update(file=written.name, size=written.size, checksum=written.checksum, slices=records)
    reports = comm.all_gather_bytes(
        msgpack.packb(mine, use_bin_type=True), group=group, what="the ranks' written files"
    )
    if comm.get_rank() == 0:
        every = [msgpack.unpackb(r, raw=False) for r in reports]
        by_rank = sorted((r for r in every if "file" in r), key=lambda r: r["rank"])
        writers = [{k: v for k, v in r.items() if k != "rank"} for r in by_rank]
        if len(writers) != len(every):
            body = {**body, "process_rng": [r["rng"] for r in every]}
        files = {}
        for name, contents in extra_files.items():
            if isinstance(contents, WrittenModel):
                os.replace(contents.path, os.path.join(partial, name))
                extra = contents.written
            elif contents:
                extra = write_safetensors(os.path.join(partial, name), contents.items())
            else:
                continue
            files[name] = {
                "size": extra.size,
                "checksum": extra.checksum,
                "crcs": extra.tensor_digests,
            }
        body = {**body, "ranks": writers, "files": files}
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
    comm.barrier(group, what="the checkpoint committed")  # for everyone
