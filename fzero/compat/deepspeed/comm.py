"""`deepspeed.comm`: fzero's collectives under DeepSpeed's names and signatures."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

from fzero import comm as _comm
from fzero.comm import (
    ReduceOp,
    all_reduce,
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    is_initialized,
)

__all__ = [
    "ReduceOp",
    "all_reduce",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's `init_distributed`: start the process group from the launcher's
    environment (gloo on CPU, NCCL on CUDA, unless `dist_backend` says otherwise)."""
    if init_method is not None or rank != -1 or world_size != -1:
        raise NotImplementedError(
            "init_distributed(init_method=, rank=, world_size=): fzero reads them from the "
            "launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR); launch with fzero run"
        )
    if dist_backend == "ccl" or (dist_backend == "nccl" and not torch.cuda.is_available()):
        # DeepSpeed's CPU backend, or NCCL asked for where no GPU is: gloo is fzero's
        # collective on CPU (the backend changes no result)
        logging.getLogger("fzero").info("fzero: %s asked for on CPU; using gloo", dist_backend)
        dist_backend = "gloo"
    _comm.init_distributed(
        backend=dist_backend,
        timeout_s=timeout.total_seconds() if timeout is not None else None,
        required=None if dist_init_required is None else dist_init_required or None,
    )
