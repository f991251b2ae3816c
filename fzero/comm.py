"""The collectives fzero uses, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

fzero adds no transport of its own. The process group comes from `torchrun`'s
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); with none, a one-process
group on an in-memory store, so the same script runs under `python` and
`torchrun`.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "all_reduce",
    "backend_device",
    "init_distributed",
    "reduce_scatter_into",
    "side_group",
]

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
    atexit.register(_destroy)  # fzero started it, fzero ends it: gloo aborts if left running
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


def _destroy() -> None:
    if dist.is_initialized():
        for group in _side_groups.values():
            dist.destroy_process_group(group)
        _side_groups.clear()
        dist.destroy_process_group()


def backend_device() -> torch.device:
    """The device collectives run on: the local CUDA device under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False):
    """Concatenate every rank's equal-size `shard` into `output` (rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, async_op=async_op)


def reduce_scatter_into(
    shard: torch.Tensor, full: torch.Tensor, *, average: bool = True, async_op: bool = False
):
    """Sum (or average) `full` over ranks and leave rank r's equal part in `shard`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return scatter(shard, full, op=op, async_op=async_op)


def all_reduce(tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False):
    """In-place all-reduce with op `sum`, `avg` or `max`."""
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}
    return dist.all_reduce(tensor, op=ops[op], async_op=async_op)


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
