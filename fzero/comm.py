"""The collectives fzero uses, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

fzero adds no transport of its own. The process group comes from `torchrun`'s
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); with none, a one-process
group on an in-memory store, so the same script runs under `python` and
`torchrun`. Every collective fzero issues starts here, through the watch of the
process group (`fzero._watch.Watch`: numbered, order-checked, watched), which
`init_distributed` makes (or adopts a running group with) and the group's end drops.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import gc
import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from fzero import _traffic, _watch
from fzero._traffic import count, labels, mesh_group, traffic, traffic_by_group
from fzero._waits import RankDisagreement
from fzero._watch import Watch, Watched
from fzero._watch_settings import WatchSettings

__all__ = [
    "UNSTAGED_BYTES",
    "RankDisagreement",
    "ReduceOp",
    "WatchSettings",
    "Watched",
    "Works",
    "agree",
    "all_gather_bytes",
    "all_gather_into",
    "all_reduce",
    "all_to_all_into",
    "backend_device",
    "barrier",
    "broadcast_from",
    "exchange_into",
    "exempt_thread",
    "forget_process_groups",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "mesh_group",
    "named_operation",
    "post_raised",
    "reduce_scatter_into",
    "reduce_to",
    "report_waits_after",
    "side_group",
    "traffic",
    "traffic_by_group",
    "unchecked",
    "watch_collectives",
]

ReduceOp = dist.ReduceOp

log = logging.getLogger("fzero")

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    required: bool | None = None,
    report_s: float | None = None,
) -> None:
    """Start the default process group if it is not running, and fzero's watch of it.

    `required=False` (DeepSpeed's `dist_init_required=False`) expects the caller
    to have started it. Collectives time out after `timeout_s` seconds
    (default: `FZERO_TIMEOUT_S` or 600), so a rank that dies cannot leave the
    others waiting forever. The watch's settings (`WatchSettings`: the timeout,
    `FZERO_WATCH_S`, `FZERO_REPORT_S`, `FZERO_CHECK_COLLECTIVES`) are read here, once;
    `report_s` (a config's `collective_report_s`) sets the report interval over
    `FZERO_REPORT_S` (`report_waits_after`), on a new or a running group.
    """
    if dist.is_initialized():
        # Started by the caller (Accelerate's CPU path, a test harness): fzero's engines
        # and collectives live on it all the same, so fzero watches it and still ends it
        # before interpreter teardown (a Trainer at ZeRO-2 aborted 1 exit in 10 under load
        # without this)
        watch = _adopt(timeout_s)
        if report_s is not None:
            _watch.replace_settings(watch, report_s=float(report_s))
        return
    if required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group first or pass dist_init_required=None"
        )
    settings = WatchSettings.from_environment(timeout_s=timeout_s)
    if report_s is not None:
        settings = dataclasses.replace(settings, report_s=float(report_s))
    timeout = datetime.timedelta(seconds=settings.timeout_s)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if all(name in os.environ for name in _LAUNCHER_VARIABLES):
        dist.init_process_group(backend, timeout=timeout)
    else:
        # No launcher: a world of one, on an in-memory store (no network).
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _watch.start_watch(settings, _destroy)
    log.info(
        "fzero: process group %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size()
    )


def _adopt(timeout_s: float | None = None) -> Watch:
    """The watch of the running default group, started if fzero has not yet."""
    watch = _watch.current()
    if watch is None:
        watch = _watch.start_watch(WatchSettings.from_environment(timeout_s=timeout_s), _destroy)
    return watch


def _group_watch() -> Watch | None:
    """The watch of the default group (adopting it), or None without a process group."""
    watch = _watch.current()
    if watch is None and dist.is_initialized():
        watch = _adopt()
    return watch


def side_group(key: int) -> Any:
    """The gloo group of all ranks for `key` (collective on first use), e.g. an engine's
    own stream of checkpoint collectives, so an asynchronous save never interleaves with
    training. fzero holds it with the default group's watch, not the caller: at exit it is
    destroyed before the default group. Left to be collected with its engine at
    interpreter teardown, after the default group, it aborted the process ("terminate
    called without an active exception", 2 runs in 8 of examples/functional_api.py)."""
    groups = _adopt().side_groups
    if key not in groups:
        groups[key] = dist.new_group(backend="gloo")
    return groups[key]


def _destroy() -> None:
    """At interpreter exit (registered by the watch, removed with it): say this rank
    left, wait briefly for the others, then destroy fzero's groups while torch is whole."""
    # Engines left for the collector (hooks make cycles) go now, while the process group
    # and torch are whole: collected at interpreter teardown, two stage-3 engines aborted
    # the process ("terminate called without an active exception", 4 runs in 12 of a GAN
    # script; 0 in 24 after).
    gc.collect()
    watch = _watch.current()
    if watch is None:
        return
    # No rank closes its connections while a peer's last collective may still be
    # finishing on them (seen once in ~40 runs of a two-engine script under load: the
    # same abort): `leave` waits, bounded, until the others have left too.
    watch.leave()
    for group in watch.side_groups.values():
        dist.destroy_process_group(group)
    watch.side_groups.clear()
    dist.destroy_process_group()
    watch.close()


# ---- the watch (`fzero._watch`): named operations, agreements, settings --------------------


def named_operation(
    name: str, track: str | None = None, *, entry: Literal["never", "always", "first"] = "never"
) -> contextlib.AbstractContextManager[None]:
    """Run fzero operation `name` (its collectives). When one times out or loses a peer,
    the error names the ranks that never arrived and where every rank is. An exception
    raised inside on this rank is told to the other ranks, which end their waits with it
    (see `Watched`). Inside another named operation the outer name is the one given
    (`engine.state_dict` runs `fzero.state_dict`).

    Its collectives are checked against the ones this rank issued the last time an
    operation of key `track` ran (default: `name` up to its first parenthesis, and
    whether gradients are on), and its first one against what followed the previous
    operation last time (`fzero._order_check`, the order check); `track=""`: not checked (a
    rank serving the others' collectives from another operation, as `join` does).
    `entry="always"`: every rank agrees at entry that it entered `name` (an entry point
    users call on every rank: a rank that skipped it is named at once); `"first"`: only
    when the previous operation was another one (evaluation, called per batch)."""
    watch = _group_watch()
    if watch is None:
        return contextlib.nullcontext()
    return watch.named(name, track, entry)


def agree(what: str, value: str, ranks: Sequence[int]) -> dict[int, str]:
    """Every rank of `ranks` posts `value` and gets every rank's, through the process
    group's store: no collective, so a rank that is elsewhere cannot pair it with another
    one. A rank that has not posted within a watch slice is asked where it is, as a slow
    collective's peers are (`Watched`): one waiting in a collective at two asks, one in
    its own torch.distributed collective, or one that raised or left, ends the wait with
    `RankDisagreement` on every rank."""
    watch = _group_watch()
    if watch is None:
        raise RuntimeError(f"fzero.comm.agree({what!r}) needs a process group")
    return watch.agree(what, value, ranks)


def unchecked() -> contextlib.AbstractContextManager[None]:
    """Collectives inside are not checked against the operation's others: for one that
    ranks issue from different operations at the same place by construction (`join`'s
    flag: inside a forward on a rank that trains, between the served steps on one out
    of data)."""
    watch = _group_watch()
    return watch.unchecked() if watch is not None else contextlib.nullcontext()


def exempt_thread() -> None:
    """The calling thread's collectives are neither checked nor numbered (a background
    thread that runs beside the operations of the main one, on a group of its own, as an
    asynchronous checkpoint writer)."""
    watch = _group_watch()
    if watch is not None:
        watch.local.exempt = True


def post_raised(text: str) -> None:
    """Tell the other ranks this one raised (their waits end with it)."""
    watch = _group_watch()
    if watch is not None:
        watch.post_raised(text)


def watch_collectives(seconds: float | None) -> None:
    """Set how long a collective waits before asking the other ranks where they are
    (`FZERO_WATCH_S`); None or 0: never ask (a hang waits for the collective timeout)."""
    _watch.replace_settings(_adopt(), slice_s=float(seconds or 0))


def report_waits_after(seconds: float) -> None:
    """Set how long a wait lasts before it prints who is where (`FZERO_REPORT_S`, config
    `collective_report_s`; default 30; 0: never). It prints again after twice as long."""
    _watch.replace_settings(_adopt(), report_s=float(seconds))


def _issue(
    kind: str,
    tensor: torch.Tensor,
    what: str,
    async_op: bool,
    start: Callable[[bool], Any],
    group: Any = None,
    counted: bool = True,
) -> Any:
    watch = _group_watch()
    if watch is None:  # torch raises its own error: no process group
        return start(async_op)
    return watch.issue(kind, tensor, what, async_op, start, group, counted)


def forget_process_groups() -> None:
    """Forget what fzero holds for process groups the caller has destroyed (all of them:
    `torch.distributed.destroy_process_group()`): side groups, mesh subgroups, traffic
    counts and the watch's numbering, tracks and posts, so that the next process group
    starts as it would in a new process. For a harness that runs many worlds one after
    another in one process (a persistent test worker); a training script never needs it."""
    if dist.is_initialized():
        raise RuntimeError(
            "forget_process_groups: the default process group is still running; "
            "destroy it first (torch.distributed.destroy_process_group())"
        )
    _traffic.forget()
    _watch.forget()


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
    subgroup (`mesh_group`) instead of every process.

    Over gloo an `output` of `UNSTAGED_BYTES` or more on the host is filled by one
    broadcast from each rank straight into its slice: gloo's all-gather gathers into a
    flat buffer of `output`'s size and then copies it out (`ProcessGroupGloo`'s
    allgather), so a 98 MB gather held 196 MB. The same bytes reach each rank, in
    `world` collectives instead of one, counted and checked as the one all-gather.
    NCCL writes `output` in place: one all-gather there."""
    if _unstaged(output, group):
        size, world = shard.numel(), dist.get_world_size(group)
        if output.numel() != size * world:  # before it counts as issued
            raise ValueError(
                f"all_gather_into ({what or 'a gather'}): the output has {output.numel():,} "
                f"elements; expected the world size {world} x the shard's {size:,} = "
                f"{size * world:,}"
            )
        return _issue(
            "all_gather",
            output,
            what,
            async_op,
            lambda a: _broadcast_parts(output, shard, a, group),
            group,
        )
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _issue(
        "all_gather",
        output,
        what,
        async_op,
        lambda a: gather(output, shard, async_op=a, group=group),
        group,
    )


UNSTAGED_BYTES = 1 << 20
"""The size from which `all_gather_into` avoids gloo's staging copy (below it the copy
is small and one collective is quicker than `world`)."""


def _unstaged(output: torch.Tensor, group: Any) -> bool:
    return (
        output.device.type == "cpu"
        and output.numel() * output.element_size() >= UNSTAGED_BYTES
        and dist.get_backend(group) == "gloo"
    )


def _broadcast_parts(output: torch.Tensor, shard: torch.Tensor, async_op: bool, group: Any):
    """Each rank's `shard` broadcast from it into its slice of flat `output`: the work
    of all of them (`Works`) with `async_op`, else None once they landed."""
    size, rank, world = shard.numel(), dist.get_rank(group), dist.get_world_size(group)
    flat = output.view(-1)
    flat[rank * size : (rank + 1) * size].copy_(shard.reshape(-1))
    works = Works(
        [
            dist.broadcast(
                flat[source * size : (source + 1) * size],
                src=_global_rank(group, source),
                async_op=True,
                group=group,
            )
            for source in range(world)
        ]
    )
    if async_op:
        return works
    works.wait()
    return None


class Works:
    """Several collectives in flight as one (torch's `Work`s, or fzero's `Watched`):
    `wait` (with a `timeout`: one deadline for all of them, raising torch's timeout
    error while any is still running), `is_completed` (also once one of them failed:
    `Watched` then reports the failure, not a slice of waiting), `get_future`. `keep`:
    a tensor they read, alive until they landed."""

    def __init__(self, works: list[Any], keep: torch.Tensor | None = None) -> None:
        self.works, self.keep, self.failed = works, keep, False

    def is_completed(self) -> bool:
        return self.failed or all(work.is_completed() for work in self.works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self.works:
            try:
                if deadline is None:
                    work.wait()
                else:  # at least 1 ms: a zero timeout is torch's "no timeout"
                    left = max(deadline - time.monotonic(), 1e-3)
                    work.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError:
                self.failed = self.failed or bool(work.is_completed())
                raise
        self.keep = None
        return True

    def get_future(self) -> Any:
        return torch.futures.collect_all([work.get_future() for work in self.works])


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


def exchange_into(
    output: torch.Tensor,
    input: torch.Tensor,
    send_to: int,
    receive_from: int,
    *,
    what: str = "",
    group: Any = None,
) -> None:
    """Send `input` to process `send_to` and receive `output` from process
    `receive_from` (global ranks, both in `group`), where every rank of `group` sends one
    tensor to one rank and receives one (a permutation): one all-to-all with a part to
    and from one rank each, counted as its input."""
    size = get_world_size(group)
    to, source = _group_rank(group, send_to), _group_rank(group, receive_from)
    ins, outs = [0] * size, [0] * size
    ins[to], outs[source] = input.numel(), output.numel()
    _issue(
        "all_to_all",
        input,
        what,
        False,
        lambda a: dist.all_to_all_single(output, input, outs, ins, async_op=a, group=group),
        group,
    )


def _group_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_group_rank(group, rank)


_OPS = types.MappingProxyType(
    {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }
)


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


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def broadcast_from(
    tensor: torch.Tensor,
    src: int,
    *,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """Rank `src`'s `tensor` (its rank in `group`; every process's without one) into
    every rank's `tensor`: what a part owned by one rank costs to share (its bytes once,
    not padded to the largest part)."""
    root = _global_rank(group, src)
    return _issue(
        "broadcast",
        tensor,
        what,
        async_op,
        lambda a: dist.broadcast(tensor, src=root, async_op=a, group=group),
        group,
    )


def reduce_to(
    tensor: torch.Tensor,
    dst: int,
    *,
    async_op: bool = False,
    what: str = "",
    group: Any = None,
):
    """Sum `tensor` over ranks into rank `dst`'s (its rank in `group`): what a gradient
    owned by one rank costs to reduce (its bytes once; the other ranks' `tensor` is left
    undefined, as torch's `reduce`)."""
    root = _global_rank(group, dst)
    return _issue(
        "reduce",
        tensor,
        what,
        async_op,
        lambda a: dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM, async_op=a, group=group),
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


_NOTHING = torch.empty(0)  # a barrier's "tensor": it moves nothing (and is not counted)


def barrier(group: Any = None, async_op: bool = False, *, what: str = "") -> Any:
    """Wait until every rank of `group` arrives (numbered and watched as fzero's other
    collectives; not counted in `traffic`)."""
    return _issue(
        "barrier",
        _NOTHING,
        what,
        async_op,
        lambda a: dist.barrier(group=group, async_op=a),
        group,
        counted=False,
    )


def all_gather_bytes(
    data: bytes, group: dist.ProcessGroup | None = None, *, what: str = "bytes"
) -> list[bytes]:
    """Every rank's `data`, in rank order, over a CPU (gloo) group (raw bytes, not
    pickled): the lengths, then the bytes padded to the longest (none when all are
    empty)."""
    world = get_world_size(group)
    lengths = torch.zeros(world, dtype=torch.int64)
    all_gather_into(
        lengths, torch.tensor([len(data)], dtype=torch.int64), what=f"{what}: lengths", group=group
    )
    size = int(lengths.max())
    if size == 0:
        return [b""] * world
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = torch.empty(world * size, dtype=torch.uint8)
    all_gather_into(gathered, buffer, what=what, group=group)
    return [
        ctypes.string_at(gathered[r * size :].data_ptr(), int(n)) if int(n) else b""
        for r, n in enumerate(lengths.tolist())
    ]
