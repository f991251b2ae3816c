"""The collectives fzero uses, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

fzero adds no transport of its own. The process group comes from `torchrun`'s
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); with none, a one-process
group on an in-memory store, so the same script runs under `python` and
`torchrun`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fzero._traffic import count, labels, mesh_group, traffic, traffic_by_group

__all__ = [
    "RankDisagreement",
    "ReduceOp",
    "Watched",
    "all_gather_into",
    "all_gather_uneven",
    "all_reduce",
    "backend_device",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "mesh_group",
    "named_operation",
    "reduce_scatter_into",
    "side_group",
    "traffic",
    "traffic_by_group",
    "watch_collectives",
]

ReduceOp = dist.ReduceOp

log = logging.getLogger("fzero")

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600.0


def init_distributed(
    *, backend: str | None = None, timeout_s: float | None = None, required: bool | None = None
) -> None:
    """Start the default process group if it is not running.

    `required=False` (DeepSpeed's `dist_init_required=False`) expects the caller
    to have started it. Collectives time out after `timeout_s` seconds
    (default: `FZERO_TIMEOUT_S` or 600), so a rank that dies cannot leave the
    others waiting forever.
    """
    if dist.is_initialized():
        # Started by the caller (Accelerate's CPU path, a test harness): fzero's engines
        # and collectives live on it all the same, so fzero still ends them before
        # interpreter teardown (a Trainer at ZeRO-2 aborted 1 exit in 10 under load
        # without this)
        _end_at_exit()
        return
    if required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group first or pass dist_init_required=None"
        )
    timeout = datetime.timedelta(
        seconds=timeout_s or float(os.environ.get("FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if all(name in os.environ for name in _LAUNCHER_VARIABLES):
        dist.init_process_group(backend, timeout=timeout)
    else:
        # No launcher: a world of one, on an in-memory store (no network).
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _end_at_exit()
    log.info(
        "fzero: process group %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size()
    )


_side_groups: dict[int, Any] = {}


def side_group(key: int) -> Any:
    """The gloo group of all ranks for `key` (collective on first use), e.g. an engine's
    own stream of checkpoint collectives, so an asynchronous save never interleaves with
    training. fzero holds it, not the caller: at exit it is destroyed before the default
    group. Left to be collected with its engine at interpreter teardown, after the
    default group, it aborted the process ("terminate called without an active
    exception", 2 runs in 8 of examples/functional_api.py)."""
    if key not in _side_groups:
        _side_groups[key] = dist.new_group(backend="gloo")
    return _side_groups[key]


_failing = False  # an uncaught exception is ending this process: no goodbye barrier
_ending: list[bool] = []  # `_destroy` is registered to run at exit


def _end_at_exit() -> None:
    """Destroy the process group at exit, before interpreter teardown: gloo aborts the
    process when engines and the group are collected in teardown's order."""
    if not _ending:
        atexit.register(_destroy)
        _note_failures()
        _ending.append(True)


def _note_failures() -> None:
    previous = sys.excepthook

    def hook(*info: Any) -> None:
        global _failing
        _failing = True
        with contextlib.suppress(Exception):
            _post_raised(f"outside fzero's operations: {info[0].__name__}: {info[1]}")
        previous(*info)

    sys.excepthook = hook


def _destroy() -> None:
    # Engines left for the collector (hooks make cycles) go now, while the process group
    # and torch are whole: collected at interpreter teardown, two stage-3 engines aborted
    # the process ("terminate called without an active exception", 4 runs in 12 of a GAN
    # script; 0 in 24 after).
    gc.collect()
    if dist.is_initialized():
        if dist.get_world_size() > 1 and not _failing:
            # No rank closes its connections while a peer's last collective may still be
            # finishing on them (seen once in ~40 runs of a two-engine script under load:
            # the same abort); bounded, so an exit never hangs on a rank that is gone.
            with contextlib.suppress(Exception):
                dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=10))
        for group in _side_groups.values():
            dist.destroy_process_group(group)
        _side_groups.clear()
        dist.destroy_process_group()


def backend_device() -> torch.device:
    """The device collectives run on: the local CUDA device under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- what moves (`fzero._traffic`): bytes by group and operation, mesh subgroups -----------


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """Concatenate every rank's equal-size `shard` into `output` (rank order). `what`
    (here and below): what the collective is for, named if it goes wrong; `group`: a
    subgroup (`mesh_group`) instead of every process."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _issue(
        "all_gather",
        output,
        what,
        async_op,
        lambda a: gather(output, shard, async_op=a, group=group),
        group,
    )


class _Unpadded:
    """An all-gather of padded parts in flight; `wait()` ends it and moves each rank's
    part to its place in the output."""

    def __init__(self, work: Any, padded: torch.Tensor, output: torch.Tensor, sizes: list[int]):
        self.work, self.padded, self.output, self.sizes = work, padded, output, sizes

    def wait(self) -> None:
        self.work.wait()
        width, at = max(self.sizes), 0
        for rank, size in enumerate(self.sizes):
            self.output[at : at + size].copy_(self.padded[rank * width : rank * width + size])
            at += size


def all_gather_uneven(
    output: torch.Tensor,
    shard: torch.Tensor,
    sizes: list[int],
    *,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """`all_gather_into` for parts of `sizes` elements (rank order; this rank's is
    `shard`): each travels padded to the largest, and lands unpadded in `output`."""
    width = max(sizes)
    part = torch.zeros(width, dtype=shard.dtype, device=shard.device)
    part[: shard.numel()].copy_(shard)
    padded = torch.empty(width * len(sizes), dtype=output.dtype, device=output.device)
    work = all_gather_into(padded, part, async_op=True, what=what, group=group)
    gathered = _Unpadded(work, padded, output, sizes)
    if async_op:
        return gathered
    gathered.wait()
    return None


def reduce_scatter_into(
    shard: torch.Tensor,
    full: torch.Tensor,
    *,
    average: bool = True,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """Sum (or average) `full` over ranks and leave rank r's equal part in `shard`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return _issue(
        "reduce_scatter",
        full,
        what,
        async_op,
        lambda a: scatter(shard, full, op=op, async_op=a, group=group),
        group,
    )


def all_to_all_into(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """Rank r's part i of `input` (equal parts, rank order) lands as rank i's part r of
    `output`."""
    return _issue(
        "all_to_all",
        input,
        what,
        async_op,
        lambda a: dist.all_to_all_single(output, input, async_op=a, group=group),
        group,
    )


_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def all_reduce(
    tensor: torch.Tensor,
    op: str | Any = "sum",
    group: Any = None,
    async_op: bool = False,
    *,
    what: str = "",
):
    """In-place all-reduce; `op` is a name (`sum`, `avg`, `max`, `min`, `product`) or a
    `ReduceOp` (DeepSpeed's `deepspeed.comm.all_reduce` signature). fzero's own
    subgroups (`mesh_group`) are watched as the default group; a caller's are not."""
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(f"all_reduce op is {op!r}; allowed: {sorted(_OPS)} or a ReduceOp")
        op = _OPS[op]
    if group is not None and group not in labels:  # a caller's group: counted, not watched
        count("all_reduce", tensor)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _issue(
        "all_reduce",
        tensor,
        what,
        async_op,
        lambda a: dist.all_reduce(tensor, op=op, async_op=a, group=group),
        group,
    )


def is_initialized() -> bool:
    """Whether the default process group is running."""
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (0 before the process group starts, as DeepSpeed)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks (1 before the process group starts)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (the launcher's LOCAL_RANK; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group: Any = None, async_op: bool = False) -> Any:
    """Wait until every rank of `group` arrives."""
    return dist.barrier(group=group, async_op=async_op)


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order, over a CPU (gloo) group (raw bytes, not pickled)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    size = max(int(n.item()) for n in lengths)
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(size, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, buffer, group=group)
    return [
        ctypes.string_at(t.data_ptr(), int(n.item())) if int(n.item()) else b""
        for t, n in zip(gathered, lengths)
    ]


# ---- a rank that does not arrive is named --------------------------------------------------

_LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
_ARRIVAL_WAIT_S = 10.0
_named_now: list[str] = []  # the named operation running now (outermost), if any


@contextlib.contextmanager
def named_operation(name: str) -> Iterator[None]:
    """Run fzero operation `name` (its collectives). When one times out or loses a peer,
    the ranks that got here meet in the process group's store and the error names the
    ranks that never arrived, and what each rank that did was doing. An exception raised
    inside on this rank is told to the other ranks, which end their waits with it (see
    `Watched`). Inside another named operation the outer name is the one given
    (`engine.state_dict` runs `fzero.state_dict`)."""
    if _named_now:
        yield
        return
    _named_now.append(name)
    _withdraw_raised()
    try:
        yield
    except RankDisagreement:
        raise
    except BaseException as error:
        _post_raised(f"{name}: {type(error).__name__}: {error}")
        text = str(error).lower()
        if not isinstance(error, RuntimeError) or not dist.is_initialized():
            raise
        if not any(s in text for s in _LOST_PEER):
            raise
        raise RuntimeError(f"fzero {name}: {_missing_ranks(name)}") from error
    finally:
        _named_now.pop()


def _missing_ranks(name: str) -> str:
    """Who is not here: each rank that got an error writes its operation to the store,
    then waits (up to the collective timeout, at most 10 s) for the others."""
    store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
    world, rank = dist.get_world_size(), dist.get_rank()
    if store is None:
        return "a collective failed; the other ranks could not be asked where they are"
    wait = min(float(os.environ.get("FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S)), _ARRIVAL_WAIT_S)
    try:
        store.set(f"fzero/lost/{rank}", name)
        keys = [f"fzero/lost/{r}" for r in range(world)]
        deadline = time.monotonic() + wait
        here = [r for r in range(world) if store.check([keys[r]])]
        while len(here) < world and time.monotonic() < deadline:
            time.sleep(0.1)
            here = [r for r in range(world) if store.check([keys[r]])]
        doing = "; ".join(f"rank {r}: {store.get(keys[r]).decode()}" for r in here)
    except Exception as error:  # the store itself is gone (its host rank died)
        return f"a collective failed, and the store could not be reached to ask why ({error})"
    missing = [r for r in range(world) if r not in here]
    if not missing:
        return f"a collective failed on every rank ({doing})"
    return (
        f"rank(s) {missing} did not arrive in this collective (they are elsewhere: in user "
        f"code, a data loader, another engine's call, or dead); ranks that did: {doing}"
    )


# ---- ranks that disagree are named within seconds ------------------------------------------
#
# Every collective fzero issues on the default group is numbered (the same count on every
# rank when the ranks agree) and described (`what`, and the named operation it runs in).
# Its wait is sliced: while it has not completed after `FZERO_WATCH_S` seconds (default
# 1), this rank writes where it waits to the process group's store and reads where the
# others are. A rank that raised inside a named operation (or died of an uncaught
# exception) is named at once; ranks that wait in different collectives twice in a row
# (a branch one rank skipped, a different number of batches) end with one
# `RankDisagreement` naming what each rank waits in. A rank that is not in any fzero
# collective (in user code, a data loader) is waited for up to the collective timeout, as
# before. A wait that never lasts a slice costs nothing but the count; gloo only (NCCL's
# waits return before the collective ends; its watchdog covers it).

DEFAULT_WATCH_S = 1.0


class RankDisagreement(RuntimeError):
    """The ranks are in different collectives, or another rank raised: the step cannot
    complete. The message names what each rank was doing."""


@dataclass(frozen=True)
class _Collective:
    seq: int
    kind: str
    numel: int
    what: str
    within: str

    def describe(self) -> str:
        text = f"collective #{self.seq} {self.kind} of {self.numel:,} elements"
        text += f" ({self.what})" if self.what else ""
        return text + (f" in {self.within}" if self.within else "")


_issued = [0]  # collectives issued on the default group, watched or not
_watch: list[Any] = [None, None]  # [the default group it was decided for, seconds or None]


def watch_collectives(seconds: float | None) -> None:
    """Set how long a collective waits before asking the other ranks where they are
    (`FZERO_WATCH_S`); None or 0: never ask (a hang waits for the collective timeout)."""
    _watch[:] = [dist.group.WORLD, None]
    if seconds and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        _watch[1] = float(seconds)


def _watch_slice() -> float | None:
    """Seconds a collective waits before asking the others, or None (not watched: one
    rank, NCCL, `FZERO_WATCH_S=0`)."""
    group = dist.group.WORLD
    if _watch[0] is not group:
        seconds = float(os.environ.get("FZERO_WATCH_S", DEFAULT_WATCH_S))
        watched = dist.get_world_size() > 1 and dist.get_backend() == "gloo" and seconds > 0
        _watch[:] = [group, seconds if watched else None]
    return _watch[1]


def _issue(
    kind: str,
    tensor: torch.Tensor,
    what: str,
    async_op: bool,
    start: Callable[[bool], Any],
    group: Any = None,
) -> Any:
    """Start one collective (`start(async_op)`), counted, and watched where gloo runs
    (every process issues the same sequence, a subgroup's included: one count)."""
    count(kind, tensor, group)
    seconds = _watch_slice()
    _issued[0] += 1
    if _posted:
        _withdraw_raised()
    if seconds is None:
        return start(async_op)
    within = _named_now[0] if _named_now else ""
    collective = _Collective(_issued[0], kind, tensor.numel(), what, within)
    watched = Watched(start(True), collective, seconds)
    if async_op:
        return watched
    watched.wait()
    return None


class Watched:
    """A collective in flight (torch's `Work`) whose `wait` asks the other ranks where
    they are when it takes longer than a slice, and raises `RankDisagreement` when they
    are somewhere it can never complete."""

    def __init__(self, work: Any, collective: _Collective, seconds: float) -> None:
        self.work, self.collective, self.seconds = work, collective, seconds
        self._done = False

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def get_future(self) -> Any:
        return self.work.get_future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._done:
            return True
        if timeout is not None:
            return bool(self.work.wait(timeout=timeout))
        seen: dict[int, str] | None = None
        try:
            while True:
                try:
                    self.work.wait(timeout=datetime.timedelta(seconds=self.seconds))
                    break
                except RuntimeError as error:
                    if self.work.is_completed() or "timed out" not in str(error).lower():
                        _raise_if_another_raised(self.collective.describe())
                        raise
                seen = _ask_peers(self.collective, seen)
        finally:
            if seen is not None:  # this rank said where it waits: no longer
                _set_status("done")
        self._done = True
        return True


def _store() -> Any:
    return getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()


def _set_status(status: str) -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"fzero/watch/{dist.get_rank()}", status)


def _read(store: Any, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def _ask_peers(collective: _Collective, seen: dict[int, str] | None) -> dict[int, str]:
    """Say where this rank waits; raise if another rank said it raised, or ranks wait
    in different collectives, now and at the previous ask (`seen`: a rank that caught
    its exception and went on withdraws it at its next collective). Returns what was
    seen: rank -> where it waits, -1 - rank -> what it raised."""
    store = _store()
    if store is None:
        return {}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = collective.describe()
    try:
        store.set(f"fzero/watch/{rank}", f"waiting|{mine}")
        raised = {r: _read(store, f"fzero/raised/{r}") for r in range(world) if r != rank}
        places = {r: _read(store, f"fzero/watch/{r}") for r in range(world) if r != rank}
    except Exception:  # the store is gone (its host rank died): the timeout will tell
        return seen or {}
    raised = {r: text for r, text in raised.items() if text}
    for r, text in sorted(raised.items()):  # still so at the previous ask: not a rank
        if seen is not None and seen.get(-1 - r) == text:  # that caught its exception
            raise RankDisagreement(_raised_message(r, text, rank, mine))
    elsewhere = {
        r: p.removeprefix("waiting|")
        for r, p in places.items()
        if p.startswith("waiting|") and p != f"waiting|{mine}"
    }
    if elsewhere and seen is not None and all(seen.get(r) == p for r, p in elsewhere.items()):
        doing = {rank: mine, **elsewhere}
        lines = "; ".join(f"rank {r} waits in {doing[r]}" for r in sorted(doing))
        raise RankDisagreement(
            f"fzero: the ranks are in different collectives and none can complete: {lines}. "
            "A rank took another path (a branch or module skipped, an unused expert, a "
            "different number of batches or forwards); every rank must run the same "
            "fzero operations in the same order"
        )
    return {**elsewhere, **{-1 - r: text for r, text in raised.items()}}


_posted: list[bool] = []  # this rank has told the store it raised


def _raised_message(other: int, text: str, rank: int, doing: str) -> str:
    return f"fzero: rank {other} raised in {text}; rank {rank} was waiting in {doing}"


def _raise_if_another_raised(doing: str) -> None:
    """A collective failed (a peer is gone): if another rank said it raised, that is the
    error to give (it may have ended its process group since)."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    rank = dist.get_rank()
    for r in range(dist.get_world_size()):
        if r == rank:
            continue
        try:
            text = _read(store, f"fzero/raised/{r}")
        except Exception:
            return
        if text:
            raise RankDisagreement(_raised_message(r, text, rank, doing))


def _post_raised(text: str) -> None:
    """Tell the other ranks this one raised (their waits end with it)."""
    store = _store() if dist.is_initialized() and dist.get_world_size() > 1 else None
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"fzero/raised/{dist.get_rank()}", text[:2000])
        _posted.append(True)


def _withdraw_raised() -> None:
    """A new named operation on a rank that raised before (and was caught): the old
    exception no longer stops the others."""
    if _posted:
        _posted.clear()
        store = _store()
        with contextlib.suppress(Exception):
            store.delete_key(f"fzero/raised/{dist.get_rank()}")
