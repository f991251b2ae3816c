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
from typing import Any

import torch
import torch.distributed as dist

from fzero import _traffic, _watch
from fzero._traffic import count, labels, mesh_group, traffic, traffic_by_group
from fzero._watch import (
    DEFAULT_TIMEOUT_S,
    RankDisagreement,
    Watched,
    agree,
    issue,
    named_operation,
    post_raised,
    unchecked,
    watch_collectives,
)

__all__ = [
    "RankDisagreement",
    "ReduceOp",
    "Watched",
    "agree",
    "all_gather_into",
    "all_reduce",
    "backend_device",
    "barrier",
    "broadcast_from",
    "forget_process_groups",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "mesh_group",
    "named_operation",
    "reduce_scatter_into",
    "reduce_to",
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
            post_raised(f"outside fzero's operations: {info[0].__name__}: {info[1]}")
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
    _side_groups.clear()
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
    subgroup (`mesh_group`) instead of every process."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return issue(
        "all_gather",
        output,
        what,
        async_op,
        lambda a: gather(output, shard, async_op=a, group=group),
        group,
    )


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
    return issue(
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
    return issue(
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
    return issue(
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
    return issue(
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
    return issue(
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
