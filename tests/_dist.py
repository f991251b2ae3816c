"""Run a function on N local gloo ranks (spawned processes) and collect rank 0's result."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

_TENSOR = "__tensor__"


def _encode(value: Any) -> Any:
    """Tensors as raw bytes: nothing shares memory with a process that exits."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return (
            _TENSOR,
            str(value.dtype).removeprefix("torch."),
            tuple(value.shape),
            bytes(flat.tolist()),
        )
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _TENSOR:
        _, dtype, shape, data = value
        if not data:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_decode(v) for v in value)
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        FZERO_TIMEOUT_S="120",
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            queue.put(("ok", _encode(result)))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world: int, *args: Any) -> Any:
    """`fn(rank, world, *args)` on `world` processes; returns rank 0's return value."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world, port, fn, args, queue), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    status, payload = queue.get()
    for p in procs:
        p.join(timeout=120)
    if status == "error":
        raise AssertionError(payload)
    return _decode(payload)


# What torch's gloo teardown prints when a rank aborts at interpreter exit after the
# script has finished: seen in about 1 of 14 plain Trainer DDP runs on a loaded 2-core
# machine, with no fzero code in the process, so it is not what these tests test.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_launched(command: list[str], **kwargs: Any) -> Any:
    """`subprocess.run(command, capture_output=True, text=True, **kwargs)` for a launcher
    command, run once more if (and only if) a rank died of `GLOO_EXIT_ABORT`."""
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0 and GLOO_EXIT_ABORT in done.stderr + done.stdout:
        done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return done


def failing_at_write(engine: Any, write: int, action: Callable[[], Any]) -> str:
    """Run `action` with the engine's `write`-th swap-file write (counted from now)
    failing with ENOSPC after it completed; returns the error `action` raised, or "no
    error". The real I/O is back in place afterwards."""
    real_wait, writes = engine.nvme.wait, []

    def wait(ticket: Any, what: str) -> None:
        real_wait(ticket, what)
        writes.append(what)
        if what == "writing" and writes.count("writing") == write:
            raise OSError(28, f"writing {engine.nvme.path} failed: No space left on device")

    engine.nvme.wait = wait
    try:
        action()
        return "no error"
    except OSError as error:
        return str(error)
    finally:
        engine.nvme.wait = real_wait
