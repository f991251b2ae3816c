"""`Engine.save_checkpoint` / `Engine.load_checkpoint`: DeepSpeed's semantics, fzero's format.

A save is collective. Every rank writes the slices it owns under the engine's
plan (`partition.local_slices`) — fp32 masters and each optimizer state tensor,
named `{kind}/{fqn}/{start}:{stop}` — to `rank{r:05d}.safetensors`; rank 0 also
writes the module's frozen parameters and buffers. All of it goes to
`save_dir/.{tag}.partial/`; each file is fsynced, rank 0 writes the index once
every rank has reported its checksums, fsyncs, renames the directory to
`save_dir/{tag}` and only then replaces `save_dir/latest` (write, fsync, rename).
A crash at any point leaves the previous `latest` loadable.

A load reads the old plan from the index and fills this engine's shards with
`partition.reshard_reads`, so world size, stage and strategy may all change.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import random
import re
import shutil
import signal
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm, partition
from fzero._version import __version__
from fzero.checkpoint._files import (
    CheckpointError,
    SafetensorsFile,
    fsync_dir,
    hugepage_hint,
    write_safetensors,
    write_safetensors_stream,
)
from fzero.checkpoint._index import decode_client_state, encode_client_state, pack, unpack
from fzero.optim import LossScaleState
from fzero.partition import LocalSlice, Plan, PlanError

# An fzero Engine, taken by duck type: the checkpoint package imports nothing from the
# engine (the engine imports it), and reads only the engine's public attributes.
Engine = Any

__all__ = ["AsyncSave", "load_checkpoint", "read_index", "read_latest", "save_checkpoint"]

log = logging.getLogger("fzero")

INDEX = "index.msgpack"
CLIENT_FILE = "client.safetensors"
MODEL_16BIT = "model.safetensors"
FAULT_VARIABLE = "FZERO_CHECKPOINT_FAULT"  # tests: "kill-rank-R" kills rank R mid-save
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def slice_key(kind: str, fqn: str, start: int, stop: int) -> str:
    return f"{kind}/{fqn}/{start}:{stop}"


def check_tag(tag: str, where: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise CheckpointError(
            f"{where}: tag {tag!r} is not allowed: use 1-200 letters, digits, '_', '-', '.', "
            "not starting with '.' or '-'"
        )
    return tag


# ---- what a rank holds ---------------------------------------------------------------


def _state_kinds(engine: Engine) -> list[str]:
    first = engine.units[0].state if engine.units else None
    if first is None:
        return []
    return [f"optim.{name}" for name, value in first._asdict().items() if isinstance(value, Tensor)]


def _buffer_of(engine: Engine, rt: Any, kind: str) -> Tensor:
    """The rank's partition buffer holding `kind` for unit `rt` (master or a state tensor)."""
    if kind == "master":
        return rt.master
    return getattr(rt.state, kind.removeprefix("optim."))


def _partition_start(engine: Engine, rt: Any) -> int:
    """Where the rank's owned shard starts inside its partition buffer (stage 0 holds all)."""
    return rt.unit.shard_range(engine.rank)[0] if engine.stage == 0 else 0


# One tensor of a rank file: its index record, the unit it belongs to (None: a module
# tensor), its safetensors spec, and how to get it (its unit resident).
_Entry = tuple[dict[str, Any], int | None, tuple[str, torch.dtype, tuple[int, ...]], Any]


def _save_entries(engine: Engine, mid_accumulation: bool) -> list[_Entry]:
    """What this rank's file holds, unit by unit: each tensor slice of the master and of
    every state kind, and mid-window the gradient accumulator; then, on rank 0, the
    module's own tensors (frozen parameters, buffers)."""
    kinds = ["master", *_state_kinds(engine)]
    slices = partition.local_slices(engine.plan, engine.rank)
    entries: list[_Entry] = []
    for rt in engine.units:
        for kind in kinds:
            for s in (s for s in slices if s.unit == rt.index):
                key = slice_key(kind, s.fqn, s.start, s.stop)
                at = _partition_start(engine, rt) + s.shard_offset
                record = {"key": key, "kind": kind, "fqn": s.fqn, "start": s.start, "stop": s.stop}
                get = functools.partial(_slice_of, engine, rt, kind, at, s.numel)
                entries.append((record, rt.index, (key, torch.float32, (s.numel,)), get))
        if mid_accumulation:
            key = f"grad/unit{rt.index}"
            numel = rt.unit.numel if engine.stage < 2 else rt.unit.shard_numel
            record = {"key": key, "kind": "grad", "fqn": None, "start": 0, "stop": numel}
            get = functools.partial(getattr, rt, "grad")
            entries.append((record, rt.index, (key, torch.float32, (numel,)), get))
    if engine.rank == 0:
        for name, t in _module_tensors(engine).items():
            key = f"module/{name}"
            record = {"key": key, "kind": "module", "fqn": name, "start": 0, "stop": t.numel()}
            entries.append((record, None, (key, t.dtype, tuple(t.shape)), lambda t=t: t))
    return entries


def _slice_of(engine: Engine, rt: Any, kind: str, at: int, numel: int) -> Tensor:
    return _buffer_of(engine, rt, kind)[at : at + numel]


def _entry_tensors(engine: Engine, entries: list[_Entry]) -> Iterator[Tensor]:
    """The entries' tensors in order, one unit resident at a time: with NVMe offload
    each unit is read back from the swap file when the writer reaches it."""
    for unit, group in itertools.groupby(entries, key=lambda entry: entry[1]):
        if unit is None:
            yield from (get() for *_, get in group)
            continue
        with engine.residency.resident(engine.units[unit], write_back=False):
            yield from (get() for *_, get in group)


def _module_tensors(engine: Engine) -> dict[str, Tensor]:
    """Frozen parameters and buffers: state_dict entries the plan does not manage."""
    managed = set()
    for spec in engine.plan.manifest.tensors:
        managed.update((spec.fqn, *spec.aliases))
    return {
        key: t.detach()
        for key, t in engine.module.state_dict(keep_vars=True).items()
        if key not in managed
    }


def _tensor_table(engine: Engine, module: Mapping[str, Tensor]) -> list[dict[str, Any]]:
    """The model's state_dict keys in order, with shape, dtype and source."""
    canonical = {}
    for spec in engine.plan.manifest.tensors:
        for name in (spec.fqn, *spec.aliases):
            canonical[name] = spec
    table = []
    for key in engine.module.state_dict(keep_vars=True):
        if key in canonical:
            spec = canonical[key]
            table.append(
                {"key": key, "shape": list(spec.shape), "dtype": spec.dtype, "fqn": spec.fqn}
            )
        else:
            t = module[key]
            dtype = partition.dtype_name(t.dtype)
            table.append({"key": key, "shape": list(t.shape), "dtype": dtype, "fqn": None})
    return table


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().tolist()),
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = [
        kind,
        bytes(keys.astype("<u4").tobytes()),
        int(pos),
        int(has_gauss),
        float(cached),
    ]
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(list(state["torch"]), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.tensor(list(s), dtype=torch.uint8) for s in state["cuda"]]
        )
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.frombuffer(keys, dtype="<u4"), pos, has_gauss, cached))


def _to_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_to_lists(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _scheduler_state(engine: Engine) -> dict[str, Any]:
    state: dict[str, Any] = {"lr_steps": engine.lr_steps, "client": None, "client_groups": None}
    if engine.client_scheduler is not None:
        client = {k: v for k, v in engine.client_scheduler.state_dict().items() if not callable(v)}
        state["client"] = _jsonable(client)
    if engine.client_optimizer is not None:
        state["client_groups"] = [
            {k: _jsonable(v) for k, v in g.items() if k != "params"}
            for g in engine.client_optimizer.param_groups
        ]
    return state


# ---- save -------------------------------------------------------------------------------


class AsyncSave:
    """A save running in a background thread; `wait()` joins it and re-raises its error."""

    def __init__(self, target: Any) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                target()
            except BaseException as error:  # surfaced by wait()
                self.error = error

        self._thread = threading.Thread(target=run, name="fzero-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error


def _group(engine: Engine) -> Any:
    """A gloo group of its own, so a save thread's collectives never interleave with
    training's."""
    return comm.side_group(engine.serial)


def _same_on_every_rank(engine: Engine, call: str, **arguments: Any) -> None:
    """Ranks that pass different directories or tags (rank-local names, say) would pair
    up unrelated collectives and fail obscurely: say so first, naming each rank's."""
    if engine.world_size == 1:
        return
    packed = comm.all_gather_bytes(msgpack.packb(arguments), group=_group(engine))
    every = [msgpack.unpackb(b) for b in packed]
    if any(value != every[0] for value in every):
        listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(
            f"{call}: ranks passed different arguments ({listing}); every rank must pass "
            "the same directory and tag"
        )


def save_checkpoint(
    engine: Engine,
    save_dir: str,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    async_save: bool = False,
) -> str:
    """See `Engine.save_checkpoint`. Returns the checkpoint's directory."""
    wait_for_save(engine)
    tag = check_tag(
        tag if tag is not None else f"global_step{engine.global_steps}", "save_checkpoint"
    )
    save_dir = os.fspath(save_dir)
    _same_on_every_rank(engine, "save_checkpoint", save_dir=save_dir, tag=tag)
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    if engine.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    client_tensors: dict[str, Tensor] = {}
    encoded_client = encode_client_state(dict(client_state or {}), client_tensors)
    mid_accumulation = engine.micro_steps % engine.gradient_accumulation_steps() != 0
    entries = _save_entries(engine, mid_accumulation)
    records = [record for record, *_ in entries]
    specs = [spec for _, _, spec, _ in entries]
    module = _module_tensors(engine)
    body = _index_body(engine, tag, module, mid_accumulation, encoded_client)
    rng = _rng_state()
    if engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        # DeepSpeed's switch: also a consolidated 16-bit model next to the shards
        model_16bit = engine.state_dict()
        client_tensors_16bit = {k: v.contiguous() for k, v in model_16bit.items()}
    else:
        client_tensors_16bit = {}
    dist.barrier(group=_group(engine))  # the partial directory exists for everyone
    if async_save:  # host copies of everything (with NVMe offload: read back first)
        tensors = [
            t.detach().to("cpu", copy=True).contiguous() for t in _entry_tensors(engine, entries)
        ]
        client_tensors = {k: v.clone() for k, v in client_tensors.items()}
        stream: Iterable[Tensor] = tensors
    else:  # written as produced: NVMe offload holds one unit at a time
        stream = (t.detach().cpu().contiguous() for t in _entry_tensors(engine, entries))

    def write() -> None:
        _write(
            engine,
            (save_dir, tag, partial, final),
            (specs, stream),
            records,
            rng,
            body,
            {CLIENT_FILE: client_tensors, MODEL_16BIT: client_tensors_16bit},
            save_latest,
        )

    if async_save:
        if engine not in _WAIT_AT_EXIT:  # the process's exit waits for the last save
            atexit.register(wait_for_save, engine)
            _WAIT_AT_EXIT.add(engine)
        _PENDING[engine] = AsyncSave(write)
    else:
        write()
    return final


# Asynchronous saves still being written, by engine (the checkpoint package's own state).
_PENDING: weakref.WeakKeyDictionary[Any, AsyncSave] = weakref.WeakKeyDictionary()
_WAIT_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()


def wait_for_save(engine: Engine) -> None:
    """Block until `engine`'s asynchronous save (if any) is written; raise its error."""
    pending = _PENDING.pop(engine, None)
    if pending is not None:
        pending.wait()


def _index_body(
    engine: Engine, tag: str, module: Mapping[str, Tensor], mid: bool, client: Any
) -> dict[str, Any]:
    first = engine.units[0].state if engine.units else None
    scalars = {
        k: v for k, v in (first._asdict().items() if first else ()) if not isinstance(v, Tensor)
    }
    batch = engine.batch
    return {
        "tag": tag,
        "fzero_version": __version__,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "precision": engine.precision,
        "plan": partition.to_bytes(engine.plan),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "lr_steps": engine.lr_steps,
        },
        "batch": {
            "train_batch_size": batch.train_batch_size if batch else None,
            "micro_batch_size": batch.micro_batch_size if batch else None,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        },
        "mid_accumulation": mid,
        "config": _jsonable(engine.config),
        "optimizer": {
            "name": engine.functional_optimizer.name,
            "hparams": _jsonable(engine.functional_optimizer.hparams),
            "scalars": scalars,
            "kinds": _state_kinds(engine),
        },
        "scheduler": _scheduler_state(engine),
        "loss_scale": list(engine.loss_scale_state) if engine.loss_scale_state else None,
        "tensors": _tensor_table(engine, module),
        "client_state": client,
    }


def _write(
    engine: Engine,
    paths: tuple[str, str, str, str],
    tensors: tuple[list[Any], Iterable[Tensor]],
    records: list[dict[str, Any]],
    rng: dict[str, Any],
    body: dict[str, Any],
    extra_files: dict[str, dict[str, Tensor]],
    save_latest: bool,
) -> None:
    save_dir, tag, partial, final = paths
    group = _group(engine)
    specs, stream = tensors
    written = write_safetensors_stream(os.path.join(partial, rank_file(engine.rank)), specs, stream)
    if os.environ.get(FAULT_VARIABLE) == f"kill-rank-{engine.rank}":
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
    if engine.rank == 0:
        files = {}
        for name, contents in extra_files.items():
            if contents:
                extra = write_safetensors(os.path.join(partial, name), contents.items())
                files[name] = {"size": extra.size, "checksum": extra.checksum, "crcs": extra.crcs}
        body = {**body, "ranks": [msgpack.unpackb(r, raw=False) for r in reports], "files": files}
        _write_durably(os.path.join(partial, INDEX), pack(body))
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
            _write_durably(os.path.join(save_dir, "latest.partial"), tag.encode())
            os.replace(os.path.join(save_dir, "latest.partial"), os.path.join(save_dir, "latest"))
            fsync_dir(save_dir)
        log.info("fzero: saved checkpoint %s", final)
    dist.barrier(group=group)  # committed for everyone


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---- load -------------------------------------------------------------------------------


def read_latest(load_dir: str) -> str | None:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(256)
    try:
        tag = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        tag = repr(raw[:40])
    return check_tag(tag, f"{path}")


def read_index(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, INDEX)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a complete checkpoint"
        ) from None
    return unpack(raw, path)


def load_checkpoint(
    engine: Engine,
    load_dir: str,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, Any]:
    """See `Engine.load_checkpoint`."""
    wait_for_save(engine)
    load_dir = os.fspath(load_dir)
    _same_on_every_rank(engine, "load_checkpoint", load_dir=load_dir, tag=tag)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            warnings.warn(
                f"no checkpoint to load: {os.path.join(load_dir, 'latest')} does not exist",
                stacklevel=3,
            )
            return None, None
    directory = os.path.join(load_dir, check_tag(tag, "load_checkpoint"))
    if not os.path.isdir(directory):
        warnings.warn(f"no checkpoint to load: {directory} does not exist", stacklevel=3)
        return None, None
    return _load(
        engine, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only
    )


def _load(
    engine: Engine,
    directory: str,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str, Any]:
    # NVMe offload: each unit goes to the other slot of its swap regions as it is read
    # (one unit in memory at a time); the slots flip once every rank has read its part.
    swapped = engine.nvme is not None
    before = [(rt.state, rt.grad_on_disk) for rt in engine.units]
    try:
        index, staged, client_state = _read(
            engine,
            directory,
            load_optimizer_states and not load_module_only,
            sink=functools.partial(_to_next_slot, engine) if swapped else None,
        )
        failure = ""
    except (CheckpointError, OSError) as error:
        failure = str(error)
    # Every rank learns whether every rank could read its part before anything changes:
    # a damaged file seen by one rank fails the load everywhere, and no state is lost.
    failures = comm.all_gather_bytes(failure.encode(), group=_group(engine))
    messages = [f"rank {r}: {m.decode()}" for r, m in enumerate(failures) if m]
    if messages:
        for rt, (state, grad_on_disk) in zip(engine.units, before):
            rt.state, rt.grad_on_disk = state, grad_on_disk
        raise CheckpointError("; ".join(messages))
    by_unit: dict[int, dict[str, Any]] = {}
    for (unit_index, kind), tensor in staged.items():
        by_unit.setdefault(unit_index, {})[kind] = tensor
    with torch.no_grad():
        for rt in engine.units:
            if swapped:
                rt.slot = 1 - rt.slot
            else:
                _apply(rt, by_unit.get(rt.index, {}))
        for key, tensor in _module_tensors(engine).items():
            tensor.copy_(staged[(-1, key)])
    if load_optimizer_states and not load_module_only:
        scalars = index["optimizer"]["scalars"]
        for rt in engine.units:
            rt.state = rt.state._replace(**scalars)
    for rt in engine.units:
        with engine.residency.resident(rt, write_back=False):
            engine.publish_master(rt)
    engine.finish_publish()
    if not load_module_only:
        _restore_counters(engine, index, load_lr_scheduler_states)
        if engine.rank < index["world_size"]:
            _restore_rng(index["ranks"][engine.rank]["rng"])
    _log_world_change(engine, index)
    return directory, client_state


def _apply(rt: Any, tensors: Mapping[str, Any]) -> None:
    """Make a unit's loaded tensors (by kind) its master, state and gradient."""
    for kind, tensor in tensors.items():
        if kind == "grad" and rt.grad.numel():
            rt.grad.copy_(tensor)  # stages 0-1: a view of the bucket buffer
        elif kind == "grad":
            rt.grad = tensor  # NVMe offload: bound, to be swapped out
        elif kind == "optim.init":
            rt.state = tensor
        elif kind == "master" and rt.master._base is not None:
            rt.master.copy_(tensor)  # a view of the parameters' buffer: copy into it
        elif kind == "master":
            rt.master = tensor
        else:
            rt.state = rt.state._replace(**{kind.removeprefix("optim."): tensor})


def _to_next_slot(engine: Engine, rt: Any, tensors: Mapping[str, Any]) -> None:
    """NVMe offload: a unit's loaded tensors go to the other slot of its swap regions."""
    _apply(rt, tensors)
    engine.residency.write_next_slot(rt, with_grad="grad" in tensors)


def _read(
    engine: Engine, directory: str, with_state: bool, sink: Any = None
) -> tuple[dict[str, Any], dict, Any]:
    """Everything this rank needs from the checkpoint, read into new buffers, unit by
    unit; with `sink`, each unit's tensors go to `sink(rt, {kind: tensor})` instead of
    the returned dict."""
    index = read_index(directory)
    old_plan = partition.from_bytes(index["plan"])
    _check_model(engine, old_plan, index, directory)
    if index["mid_accumulation"] and (
        index["world_size"] != engine.world_size or old_plan != engine.plan
    ):
        raise CheckpointError(
            f"{directory} was saved mid gradient-accumulation at world size "
            f"{index['world_size']}, stage {index['stage']}; it loads only into the same world "
            f"size, stage and plan (here world size {engine.world_size}, stage {engine.stage})"
        )
    staged: dict[tuple[int, str], Any] = {}
    with _Reader(directory, index, old_plan) as reader:
        kinds = ["master"]
        if with_state:
            _check_optimizer(engine, index, directory)
            kinds += _state_kinds(engine)
        reads = _reads_by_unit(engine, old_plan)
        for rt in engine.units:
            unit: dict[str, Any] = {}
            for kind in kinds:
                unit[kind] = _new_partition(engine, rt)
                _fill(engine, reader, kind, unit[kind], reads.get(rt.index, []))
            if not with_state:
                unit["optim.init"] = engine.functional_optimizer.init(unit["master"])
            if index["mid_accumulation"]:
                numel = rt.unit.numel if engine.stage < 2 else rt.unit.shard_numel
                unit["grad"] = torch.empty(numel, dtype=torch.float32)
                reader.read_whole(engine.rank, f"grad/unit{rt.index}", unit["grad"])
            if sink is not None:
                sink(rt, unit)
            else:
                staged.update({(rt.index, kind): t for kind, t in unit.items()})
        for key, tensor in _module_tensors(engine).items():
            saved = torch.empty(tensor.shape, dtype=partition.dtype_of(_saved_dtype(index, key)))
            reader.read_whole(0, f"module/{key}", saved)
            staged[(-1, key)] = saved
        client_state = reader.client_state(index)
    return index, staged, client_state


def _new_partition(engine: Engine, rt: Any) -> Tensor:
    """An uninitialised fp32 buffer like the unit's partition, its padding zeroed (the
    reads fill every other element)."""
    ranks = range(engine.world_size) if engine.stage == 0 else [engine.rank]
    covered = []
    for r in ranks:
        for s in partition.local_slices(engine.plan, r):
            if s.unit == rt.index:
                base = rt.unit.shard_range(r)[0] if engine.stage == 0 else 0
                covered.append((base + s.shard_offset, s.numel))
    buffer = torch.empty(engine.partition_numel(rt.unit), dtype=torch.float32)
    hugepage_hint(buffer)
    at = 0
    for start, numel in sorted(covered):
        buffer[at:start].zero_()
        at = start + numel
    buffer[at:].zero_()
    return buffer


def _check_model(engine: Engine, old_plan: Plan, index: Mapping[str, Any], directory: str) -> None:
    try:
        partition.reshard_reads(old_plan, engine.plan, engine.rank)
    except PlanError as error:
        raise CheckpointError(f"{directory} does not fit this model: {error}") from None
    saved = {t["key"]: t for t in index["tensors"] if t["fqn"] is None}
    here = _module_tensors(engine)
    missing = sorted(set(here) - set(saved))
    unexpected = sorted(set(saved) - set(here))
    changed = sorted(
        f"{k}: {tuple(saved[k]['shape'])} -> {tuple(here[k].shape)}"
        for k in set(saved) & set(here)
        if tuple(saved[k]["shape"]) != tuple(here[k].shape)
    )
    if missing or unexpected or changed:
        raise CheckpointError(
            f"{directory} does not fit this model's frozen parameters and buffers: missing "
            f"{missing}, unexpected {unexpected}, shape changed {changed}"
        )


def _check_optimizer(engine: Engine, index: Mapping[str, Any], directory: str) -> None:
    saved = index["optimizer"]
    if saved["name"] != engine.functional_optimizer.name or saved["kinds"] != _state_kinds(engine):
        raise CheckpointError(
            f"{directory} holds {saved['name']} state {saved['kinds']}; this engine runs "
            f"{engine.functional_optimizer.name} with {_state_kinds(engine)}: pass "
            "load_optimizer_states=False to load the weights only"
        )


class _Reader:
    """Open rank files of one checkpoint on demand; slices looked up by old position."""

    def __init__(self, directory: str, index: Mapping[str, Any], old_plan: Plan) -> None:
        self.directory = directory
        self.index = index
        self.old_plan = old_plan
        self._files: dict[int, SafetensorsFile] = {}
        self._crcs = [{r["key"]: r["crc"] for r in rank["slices"]} for rank in index["ranks"]]
        self._slices: dict[tuple[int, int], list[LocalSlice]] = {}
        self._cached: tuple[int, str, Tensor] | None = None

    def file(self, rank: int) -> SafetensorsFile:
        if rank not in self._files:
            info = self.index["ranks"][rank]
            self._files[rank] = SafetensorsFile(
                os.path.join(self.directory, info["file"]), info["size"]
            )
        return self._files[rank]

    def old_slice(self, rank: int, unit: int, offset: int) -> LocalSlice:
        if (rank, unit) not in self._slices:
            for s in partition.local_slices(self.old_plan, rank):
                self._slices.setdefault((rank, s.unit), []).append(s)
        for s in self._slices[(rank, unit)]:
            if s.shard_offset <= offset < s.shard_offset + s.numel:
                return s
        raise CheckpointError(
            f"{self.directory}: no saved slice at rank {rank} unit {unit} offset {offset}"
        )

    def read_range(self, rank: int, key: str, begin: int, out: Tensor) -> None:
        """Elements `[begin, begin + out.numel())` of saved tensor `key` into `out`."""
        crc = self._crcs[rank].get(key)
        if crc is None:
            raise CheckpointError(
                f"tensor {key!r} is not listed for rank {rank} in {self.directory}"
            )
        entry = self.file(rank).entry(key)
        whole = begin == 0 and out.numel() == _numel(entry.shape)
        if whole and out.is_contiguous() and out.device.type == "cpu":
            self.file(rank).read_into(key, out, crc)
            return
        if self._cached is None or self._cached[:2] != (rank, key):
            self._cached = (rank, key, self.file(rank).read(key, crc))
        out.copy_(self._cached[2][begin : begin + out.numel()])

    def read_whole(self, rank: int, key: str, out: Tensor) -> None:
        self.read_range(rank, key, 0, out.view(-1))

    def client_state(self, index: Mapping[str, Any]) -> Any:
        tensors = {}
        info = index["files"].get(CLIENT_FILE)
        if info is not None:
            with SafetensorsFile(os.path.join(self.directory, CLIENT_FILE), info["size"]) as f:
                tensors = {key: f.read(key, crc) for key, crc in info["crcs"].items()}
        return decode_client_state(index["client_state"], tensors)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *_: object) -> None:
        for f in self._files.values():
            f.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _reads_by_unit(engine: Engine, old_plan: Plan) -> dict[int, list[tuple[int, Any]]]:
    """The reshard reads that fill this rank's partitions (stage 0: every rank's part of
    the whole buffers), by new unit: (target rank, read)."""
    targets = range(engine.world_size) if engine.stage == 0 else [engine.rank]
    by_unit: dict[int, list[tuple[int, Any]]] = {}
    for target in targets:
        for read in partition.reshard_reads(old_plan, engine.plan, target):
            by_unit.setdefault(read.new_unit, []).append((target, read))
    return by_unit


def _fill(
    engine: Engine, reader: _Reader, kind: str, out: Tensor, reads: list[tuple[int, Any]]
) -> None:
    """One unit's new partition buffer of `kind`, from whichever old ranks hold it."""
    for target, read in reads:
        rt = engine.units[read.new_unit]
        at = read.new_offset + (rt.unit.shard_range(target)[0] if engine.stage == 0 else 0)
        old = reader.old_slice(read.old_rank, read.old_unit, read.old_offset)
        key = slice_key(kind, old.fqn, old.start, old.stop)
        reader.read_range(
            read.old_rank, key, read.old_offset - old.shard_offset, out[at : at + read.numel]
        )


def _saved_dtype(index: Mapping[str, Any], key: str) -> str:
    return next(t["dtype"] for t in index["tensors"] if t["key"] == key)


def _restore_counters(engine: Engine, index: Mapping[str, Any], with_scheduler: bool) -> None:
    counters = index["counters"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.micro_steps = counters["micro_steps"]
    if not index["mid_accumulation"]:  # at a boundary; the accumulation may have changed
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.skipped_steps = counters["skipped_steps"]
    if index["loss_scale"] is not None and engine.loss_scaler is not None:
        engine.loss_scale_state = LossScaleState(*index["loss_scale"])
    if not with_scheduler:
        return
    scheduler = index["scheduler"]
    engine.lr_steps = scheduler["lr_steps"]
    if engine.client_optimizer is not None and scheduler["client_groups"] is not None:
        for group, saved in zip(engine.client_optimizer.param_groups, scheduler["client_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    if engine.client_scheduler is not None and scheduler["client"] is not None:
        engine.client_scheduler.load_state_dict(scheduler["client"])


def _log_world_change(engine: Engine, index: Mapping[str, Any]) -> None:
    old_world, old_accum = index["world_size"], index["batch"]["gradient_accumulation_steps"]
    if old_world == engine.world_size or engine.rank != 0:
        return
    message = (
        f"fzero: checkpoint saved at world size {old_world} (gradient_accumulation_steps "
        f"{old_accum}) loaded at world size {engine.world_size}: gradient_accumulation_steps "
        f"is now {engine.gradient_accumulation_steps()}"
    )
    if engine.batch is not None:
        message += (
            f" (train_batch_size {engine.batch.train_batch_size} = micro "
            f"{engine.batch.micro_batch_size} x {engine.gradient_accumulation_steps()} x "
            f"{engine.world_size})"
        )
    log.warning(message)
