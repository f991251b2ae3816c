"""`deepspeed.comm`: fzero's collectives under DeepSpeed's names and signatures, and
DeepSpeed's communication logger (`configure`, `log_summary`, `comms_logger`) on
fzero's attributable collectives (`fzero.monitoring.CommsLogger`)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any

import torch

from fzero import comm as _comm
from fzero import monitoring as _monitoring
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
    "configure",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
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


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed's `deepspeed.comm.configure`: the communication logger set from a
    config's `comms_logger` block (a DeepSpeed config dict or path, an fzero `Config`,
    or an engine's `config`), then from each keyword given."""
    from fzero.config import load_config

    block = None
    if deepspeed_config is not None:
        block = load_config(getattr(deepspeed_config, "config", deepspeed_config)).comms_logger
    _monitoring.comms_logger().configure(
        block, enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug
    )


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's `log_summary`: rank 0 prints the communication logger's table (per
    operation, purpose and mesh axes, beside the plan's `comm_volume`); every rank calls
    it (a barrier before and after, as DeepSpeed's). `return_dict`: this rank's rows in
    DeepSpeed's shape, `{"summary": {operation: {"<purpose> | <axes>": {...}}},
    "straggler_analysis": ..., "metadata": {...}}`, each row's figures as
    `fzero.monitoring.CommRow`'s fields."""
    logger = _monitoring.comms_logger()
    if _comm.is_initialized():
        _comm.barrier()
    rows = logger.rows()
    if show_straggler:
        rows = logger.with_stragglers(rows)
    text = logger.summary(rows=rows)
    if _comm.get_rank() == 0:
        print(text, flush=True)
    if _comm.is_initialized():
        _comm.barrier()
    if not return_dict:
        return None
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        summary.setdefault(row.operation, {})[f"{row.purpose} | {row.axes}"] = dataclasses.asdict(
            row
        )
    stragglers = {
        op: {key: row["straggler_ms"] for key, row in found.items()}
        for op, found in summary.items()
    }
    return {
        "summary": summary,
        "straggler_analysis": stragglers if show_straggler else None,
        "metadata": {
            "world_size": _comm.get_world_size(),
            "rank": _comm.get_rank(),
            "timestamp": datetime.datetime.now().isoformat(),
        },
    }


def __getattr__(name: str) -> Any:
    """`deepspeed.comm.comms_logger`: the process's communication logger."""
    if name == "comms_logger":
        return _monitoring.comms_logger()
    raise AttributeError(f"module 'deepspeed.comm' (served by fzero) has no attribute {name!r}")
