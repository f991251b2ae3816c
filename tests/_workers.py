"""Persistent rank processes for `tests._dist.run_world`: a group of `world` spawned
processes (torch, fzero and the test modules imported once) runs case after case, each
case on a new gloo process group, as PyTorch's own `MultiProcContinuousTest` does. A
case costs a process group's start (milliseconds) instead of `world` interpreters
importing torch (seconds each on two loaded cores).

Between cases each rank is put back to what a new process would give:
- before a case: `os.environ` is the caller's at the call (plus the rank's launcher
  variables), the working directory the caller's; torch's and Python's RNG, torch's
  default dtype and device, grad mode, thread count, deterministic and anomaly modes,
  matmul precision, `warnings` filters, `sys.path`, `sys.meta_path` and `sys.argv` as
  when the process started;
- after a case: the ranks meet in a barrier on the case's default group (a rank whose
  collective is still pending never completes it), the process groups are destroyed and
  fzero forgets them (`fzero.comm.forget_process_groups`: side groups, mesh subgroups,
  traffic counts, the watch's numbering and tracks), `import deepspeed` as served by
  `fzero.compat.install()` is removed, loggers get back their handlers and levels,
  torch.compile's caches and Accelerate's/Transformers' process-wide state are reset,
  and the case's objects (engines, their threads and swap files) are collected.

A case that fails on any rank, hangs, kills a rank, leaves a collective pending or
grows a rank past `FZERO_TEST_WORKER_MB` ends its group (output and stacks of each rank
are shown under the test's name); the next case starts a new one, so a failure never
takes other tests down. Groups are keyed by world size and the caller's environment
(a variable fzero reads at import, as FZERO_NATIVE, gets processes started under it).

Cases that must end their processes (a rank killed by a signal, `sys.exit`, a process
group left broken on purpose, what happens at interpreter exit) pass `fresh=True` to
`run_world`; `FZERO_TEST_WORKERS=0` runs every case in new processes (the old way).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import io
import logging
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

# A case running longer than this is taken as hung: each rank's stacks are shown and
# its group ended (the longest slow case runs ~5 minutes on two loaded cores).
CASE_TIMEOUT_S = float(os.environ.get("FZERO_TEST_CASE_TIMEOUT_S", 1800))
# After one rank failed, how long the others get to end (fzero's watch ends their waits
# within seconds; a rank left in a collective times out after FZERO_TIMEOUT_S = 120).
AFTER_FAILURE_S = 150.0
# The end-of-case barrier: every rank has returned, so it completes at once unless a
# collective of the case is still pending.
BARRIER_S = 10.0
# Why a group ends whose ranks hold a collective that never completes: they cannot exit
# cleanly (gloo's teardown waits on it), so they are killed.
PENDING = "a collective of the case was still pending at its end"
# A rank holding more than this (resident MiB) after a case is restarted.
WORKER_MB = float(os.environ.get("FZERO_TEST_WORKER_MB", 3000))
# Groups kept alive at once (the least recently used ends first): 1-, 2- and 4-rank.
KEPT_GROUPS = 3

_LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Groups ended early, and why: listed at the end of the pytest run (conftest.py).
restarts: list[tuple[str, str]] = []
# CPU seconds the ranks spent in completed cases, starts included (conftest.py adds them
# to each test's), and those of ended ranks, which the pytest process's children's
# resource usage counts again once they are reaped.
cpu = [0.0]
reaped = [0.0]


def case_name() -> str:
    """The running test's id (pytest's), or "run_world" outside pytest."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "run_world")
    return current.rsplit(" (", 1)[0]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What a launcher gives each rank (and the collective timeout of these tests)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "FZERO_TIMEOUT_S": "120",
    }


# ---- the rank side ----------------------------------------------------------------------------


class _Baseline:
    """The process-wide state a rank had when it started, put back before each case."""

    def __init__(self) -> None:
        self.torch_rng = torch.get_rng_state()
        self.random = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.matmul = torch.get_float32_matmul_precision()
        self.warnings = list(warnings.filters)
        self.path, self.meta_path, self.argv = list(sys.path), list(sys.meta_path), sys.argv[:]

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.random)
        if "numpy" in sys.modules:  # seeded at its import in a new process: seed it here
            sys.modules["numpy"].random.seed(0)
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(None)
        torch.set_grad_enabled(self.grad)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_anomaly_enabled(*self.anomaly)
        torch.set_float32_matmul_precision(self.matmul)
        warnings.filters[:] = self.warnings
        getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' cache
        sys.path[:], sys.meta_path[:], sys.argv[:] = self.path, self.meta_path, self.argv


def _loggers() -> dict[str, tuple[int, list[Any], bool, bool]]:
    every = [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
    return {
        name: (log.level, list(log.handlers), log.propagate, log.disabled)
        for name, log in every
        if isinstance(log, logging.Logger)
    }


def _restore_loggers(saved: dict[str, tuple[int, list[Any], bool, bool]]) -> None:
    for name, (level, handlers, propagate, disabled) in saved.items():
        log = logging.getLogger(name or None)
        log.setLevel(level)
        log.handlers[:] = handlers
        log.propagate, log.disabled = propagate, disabled


@contextlib.contextmanager
def output_to(out: str, err: str) -> Iterator[None]:
    """The case's stdout and stderr (this process's and its children's) into files the
    caller shows under the test's name."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def _import_accelerate_beside_the_stand_in() -> None:
    """Import Accelerate's utils and Transformers' DeepSpeed integration once with
    `import deepspeed` served by fzero, then take the stand-in away. Both decide at import
    whether DeepSpeed is installed and only then define what serves it
    (`accelerate.utils.DeepSpeedSchedulerWrapper`, the base of Transformers'
    `HfDeepSpeedConfig`): a case that imported them without the stand-in left every later
    `--as-deepspeed` case in the process without them (the Trainer failed to import, or
    to build its config), which no new process gives. Their presence changes nothing for a
    case without DeepSpeed (used only where DeepSpeed is; availability is asked again at
    run time)."""
    import importlib.util

    import fzero.compat

    wanted = [name for name in ("accelerate", "transformers") if importlib.util.find_spec(name)]
    if "accelerate" not in wanted or fzero.compat.installed():
        return
    loggers = _loggers()  # a new process's: what the stand-in's logging set up goes
    with contextlib.redirect_stderr(io.StringIO()):  # install's note on rank 0
        fzero.compat.install()
    try:
        import accelerate.utils  # noqa: F401

        if "transformers" in wanted:
            import transformers.integrations.deepspeed  # noqa: F401
    finally:
        fzero.compat.uninstall()
        _restore_loggers(loggers)


def _reset_libraries(compat_before: bool) -> None:
    """Process-wide state of the libraries a case may have used, as a new process has it."""
    compat = sys.modules.get("fzero.compat")
    if compat is not None and compat.installed() and not compat_before:
        compat.uninstall()  # the finder and every `deepspeed[.x]` module it served
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        hf_deepspeed.unset_hf_deepspeed_config()


def _forget_script_modules(before: set[str], path: list[str]) -> None:
    """Modules a case imported from directories it put on sys.path (a script's own
    modules, beside it): the next case's script may have others of the same names."""
    added = [os.path.abspath(p) + os.sep for p in sys.path if p and p not in path]
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if any(os.path.abspath(file).startswith(p) for p in added):
            del sys.modules[name]


def _end_process_group(world: int) -> str:
    """Meet the other ranks, destroy the case's process groups, forget them: "" or why
    this rank cannot start another case."""
    import torch.distributed as dist

    if dist.is_initialized():
        if world > 1:
            try:
                dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=BARRIER_S))
            except Exception as error:
                return f"{PENDING} ({error})"
        dist.destroy_process_group()
    comm = sys.modules.get("fzero.comm")
    if comm is not None:
        comm.forget_process_groups()
    return ""


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _send(conn: Any, message: Any) -> None:
    conn.send_bytes(bytes(ForkingPickler.dumps(message)))


def serve(rank: int, world: int, conn: Any, directory: str) -> None:
    """A rank's loop: run each case sent, report, clean up, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pytest process ends the groups
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, on a hang
    torch.set_num_threads(1)
    import fzero.compat  # fzero's loggers exist before any case adds a handler

    _import_accelerate_beside_the_stand_in()
    baseline, reported = _Baseline(), 0.0
    out, err = f"{directory}/rank{rank}.out", f"{directory}/rank{rank}.err"
    while True:
        message = pickle.loads(conn.recv_bytes())
        if message[0] == "stop":
            return
        _, env, cwd, port, blob = message
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(rank_environment(rank, world, port))
        os.chdir(cwd)
        baseline.restore()
        loggers, compat_before, modules = _loggers(), fzero.compat.installed(), set(sys.modules)
        with output_to(out, err):
            try:
                fn, args = pickle.loads(blob)
                from tests._dist import _decode, _encode

                result = fn(rank, world, *_decode(args))
                reply = ("done", "", _encode(result) if rank == 0 else None)
                data = ForkingPickler.dumps(reply)
            except BaseException:  # SystemExit too: reported, and this group ends
                data = ForkingPickler.dumps(("done", f"rank {rank}:\n{traceback.format_exc()}"))
            result = args = fn = None
            conn.send_bytes(bytes(data))
            pickle.loads(conn.recv_bytes())  # "finish": every rank has returned
            try:
                why = _end_process_group(world)
                if not why:
                    _forget_script_modules(modules, baseline.path)
                    _reset_libraries(compat_before)
                    _restore_loggers(loggers)
                    gc.collect()
                    if _resident_mb() > WORKER_MB:
                        why = f"rank {rank} holds {_resident_mb():,.0f} MiB"
            except BaseException:
                why = f"cleaning up failed:\n{traceback.format_exc()}"
        spent, reported = time.process_time() - reported, time.process_time()
        _send(conn, ("clean", why, spent))  # the first case's includes the start


# ---- the pytest side --------------------------------------------------------------------------


class CaseFailed(AssertionError):
    """A case failed on a rank, or a rank died or hung in it."""

    def __init__(self, name: str, problems: list[str]) -> None:
        super().__init__(f"{name}:\n" + "\n".join(problems))
        lasts = [p.strip().splitlines()[-1] for p in problems if p.strip()]
        self.summary = "; ".join(line[:160] for line in lasts)


class _Group:
    """`world` rank processes serving cases."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.directory = tempfile.mkdtemp(prefix="fzero-ranks-")
        self.conns, self.procs = [], []
        for rank in range(world):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(rank, world, there, self.directory),
                daemon=True,
                name=f"fzero-test-rank-{rank}",
            )
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    def run(self, name: str, fn: Callable, args: tuple, port: int) -> tuple[Any, str]:
        """Run one case; returns (rank 0's encoded result, why this group must end or "")
        or raises `CaseFailed` (the group is then ended)."""
        blob = bytes(ForkingPickler.dumps((fn, args)))  # unpicklable: raises here, as spawn
        message = ("run", dict(os.environ), os.getcwd(), port, blob)
        for conn in self.conns:
            _send(conn, message)
        replies, lost = self._collect(name)
        errors = [replies[r][1] for r in sorted(replies) if replies[r][1]]
        if errors or lost:
            self._show_output(name, stacks=bool(lost))
            self.close(kill=True)
            raise CaseFailed(name, errors + lost)
        for conn in self.conns:
            _send(conn, ("finish",))
        cleaned, lost = self._collect(name, timeout=BARRIER_S + 60)
        cpu[0] += sum(reply[2] for reply in cleaned.values())
        self._show_output(name, stacks=bool(lost))
        why = "; ".join([cleaned[r][1] for r in sorted(cleaned) if cleaned[r][1]] + lost)
        return replies[0][2], why

    def _collect(self, name: str, timeout: float | None = None) -> tuple[dict, list[str]]:
        """Each rank's reply; and, for a rank that died or did not answer in time (or
        within AFTER_FAILURE_S of another rank's failure), why not."""
        in_case = timeout is None
        timeout = CASE_TIMEOUT_S if timeout is None else timeout
        replies: dict[int, tuple] = {}
        lost: list[str] = []
        deadline = time.monotonic() + timeout
        dead: set[int] = set()
        while len(replies) + len(lost) < self.world:
            waiting = [r for r in range(self.world) if r not in replies and r not in dead]
            left = deadline - time.monotonic()
            if left <= 0:
                for r in waiting:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.procs[r].pid, signal.SIGUSR1)  # its stacks, to its err
                time.sleep(2)
                failed = dead or any(v[1] for v in replies.values())
                seconds = AFTER_FAILURE_S if failed and in_case else timeout
                lost += [f"rank {r}: no answer within {seconds:.0f} s (hung?)" for r in waiting]
                break
            ready = wait([self.conns[r] for r in waiting], timeout=min(left, 1.0))
            for r in waiting:
                if self.conns[r] in ready:
                    try:
                        replies[r] = pickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        self.procs[r].join(5)
                        code = self.procs[r].exitcode
                        how = f"signal {-code}" if code is not None and code < 0 else code
                        lost.append(f"rank {r}: the process ended (exit {how})")
                        dead.add(r)
                    if (r in dead or replies[r][1]) and in_case:
                        deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
        return replies, lost

    def _show_output(self, name: str, stacks: bool) -> None:
        """What each rank printed in the case, into this process's (captured) output."""
        for rank in range(self.world):
            for suffix, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = f"{self.directory}/rank{rank}.{suffix}"
                text = ""
                with contextlib.suppress(OSError), open(path, errors="replace") as f:
                    text = f.read()
                if text:
                    stream.write(f"---- rank {rank} {suffix} ({name}) ----\n{text}")
                    if not text.endswith("\n"):
                        stream.write("\n")
        sys.stdout.flush()

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (they exit as processes do, saving coverage data); kill those
        that do not within a few seconds."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._end(kill)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        reaped[0] += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.procs = []

    def _end(self, kill: bool) -> None:
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):
                    _send(conn, ("stop",))
            for proc in self.procs:
                proc.join(30)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


_groups: OrderedDict[tuple, _Group] = OrderedDict()


def _key(world: int) -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if not k.startswith("PYTEST_")))
    return world, env


def run_case(fn: Callable, world: int, args: tuple, port: int) -> Any:
    """`fn(rank, world, *args)` on the persistent group for `world` and this environment;
    returns rank 0's encoded result."""
    key, name = _key(world), case_name()
    group = _groups.pop(key, None)
    if group is None:
        while len(_groups) >= KEPT_GROUPS:
            _groups.popitem(last=False)[1].close()
        group = _Group(world)
    try:
        result, why = group.run(name, fn, args, port)
    except BaseException as error:
        if group.procs:
            group.close(kill=True)
        if isinstance(error, CaseFailed):
            restarts.append((name, f"failed: {error.summary}"))
        raise
    if why:
        restarts.append((name, why))
        print(f"fzero test ranks: a new group after this case: {why}", file=sys.stderr)
        group.close(kill=PENDING in why)
    else:
        _groups[key] = group
    return result


def close_all() -> None:
    """End every group (at the end of the pytest run; at exit otherwise)."""
    while _groups:
        _groups.popitem()[1].close()


atexit.register(close_all)
