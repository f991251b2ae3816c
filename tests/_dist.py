"""Run a function on N local gloo ranks and collect rank 0's result: on persistent rank
processes shared by the run's cases (`tests._workers`), or on new ones (`fresh=True`)."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_TENSOR = "__tensor__"


def _encode(value: Any) -> Any:
    """Tensors as raw bytes: nothing shares memory with a process that exits."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(_encode(v) for v in value))
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
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_decode(v) for v in value))
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
    from tests._workers import rank_environment

    os.environ.update(rank_environment(rank, world, port))
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


def run_world(fn: Callable, world: int, *args: Any, fresh: bool = False) -> Any:
    """`fn(rank, world, *args)` on `world` gloo ranks; returns rank 0's return value and
    raises AssertionError naming the test and the rank where a rank raised, died or hung.

    The ranks are the run's persistent ones for `world` (`tests._workers`: each case on a
    new process group, the processes' state put back between cases). `fresh=True`: new
    processes that end with the case, for a case that kills or exits a rank, leaves its
    process group broken on purpose, or tests what happens at interpreter exit (also
    every case under `FZERO_TEST_WORKERS=0`)."""
    from tests import _workers

    _record(world, fresh)
    if not fresh and os.environ.get("FZERO_TEST_WORKERS", "1") != "0":
        return _decode(_workers.run_case(fn, world, _encode(args), _free_port()))
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
        raise AssertionError(f"{_workers.case_name()}: {payload}")
    return _decode(payload)


# The kinds of process each test used ("2 ranks", "subprocess"), for tests/DURATIONS.md
# (conftest.py reads and clears it after each test).
used: set[str] = set()


def _record(world: int, fresh: bool) -> None:
    used.add(f"{world} rank{'s' if world > 1 else ''}" + (" (fresh)" if fresh else ""))


def _used_script() -> None:
    used.add("script on ranks")


def _script_case(
    rank: int, world: int, script: str, args: list[str], variables: dict, directory: str
) -> None:
    """One process of `fzero run`: what `fzero.cli.launch_entry` does before and while
    it runs the script, its stdout and stderr into `directory` (run_script reads them)."""
    from fzero.cli import launch_entry
    from tests._workers import output_to

    os.environ.update(variables)
    with output_to(f"{directory}/rank{rank}.out", f"{directory}/rank{rank}.err"):
        try:
            launch_entry.main([script, *args])
        except SystemExit as done:  # a script's sys.exit(0) ends it as a process would
            if done.code not in (None, 0):
                raise


def run_script(
    *command: str, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> Any:
    """`fzero run <command>` (e.g. `"--as-deepspeed", "-n", "2", "train.py", "--x"`) with
    its processes on `run_world`'s ranks: each runs what a process `fzero run` starts
    runs (`fzero.cli.launch_entry`, given the same environment as the launcher gives it:
    the DeepSpeed stand-in, `--local_rank`, LOCAL_WORLD_SIZE; and `env`). Returns a
    `subprocess.CompletedProcess` whose stdout and stderr are every rank's, in rank
    order; a rank that raises (or exits non-zero) fails as in `run_world`. What the
    launcher itself does (torchrun, exit codes, hosts, cores) is tested by launching it."""
    import subprocess
    import tempfile

    from fzero.cli.launcher import script_environment
    from fzero_cli import parser

    args = parser().parse_args(["run", *command])
    world = args.nproc_per_node or 1
    if args.num_nodes != 1 or args.hostfile or args.launcher != "torchrun" or args.dry_run:
        raise ValueError(f"run_script runs one node's processes; launch {command} instead")
    variables = {**script_environment(args, world), "LOCAL_WORLD_SIZE": str(world), **(env or {})}
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="fzero-script-") as directory:
        try:
            if cwd is not None:
                os.chdir(cwd)
            run_world(_script_case, world, args.script, args.script_args, variables, directory)
        finally:
            os.chdir(here)
        streams = []
        for suffix in ("out", "err"):
            paths = [f"{directory}/rank{r}.{suffix}" for r in range(world)]
            streams.append("".join(Path(path).read_text() for path in paths))
    _used_script()
    return subprocess.CompletedProcess(["fzero", "run", *command], 0, *streams)


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
