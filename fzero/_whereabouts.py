"""Who is where, for the collective watch (`fzero._watch`).

Every rank of a watched process group (world > 1) runs one thread, `Responder`, that
answers the others through the process group's store: where this rank's main thread is
(in one of fzero's waits, inside fzero, or outside it: user code, a data loader, its own
`torch.distributed` call, from the main thread's Python frames), its last fzero
collective and how long ago. It polls one counter (`NEWS`, bumped by a rank that asks
and by a rank that raises or leaves) twice a second: one store round trip, nothing per
collective. On a backend whose waits fzero does not slice (NCCL) it also watches this
rank's own collectives' progress (torch's flight recorder where it records, the ranks'
collective counts through the store where not) and reports a stuck one.

Each rank posts under `fzero/<kind>/<rank>` (`key`): `watch` (the fzero wait it is in),
`raised` (an exception, withdrawn when it goes on), `left` (it left the program, and
from where), `where` (its last answer), `proc` (host and pid: a rank whose process is
gone is named at once by the ranks on its host). `read_peers` reads all of them in one
round; `describe_peer` makes each rank's line of the picture that reports and errors
print.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import sysconfig
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "NEWS",
    "PeerView",
    "Responder",
    "Whereabouts",
    "describe_peer",
    "key",
    "process_alive",
    "read_peers",
    "whereabouts",
]

NEWS = "fzero/news"  # bumped by a rank that asks where the others are, raises or leaves
KINDS = ("watch", "raised", "left", "where", "proc")
POLL_S = 0.5  # how often a rank's answering thread looks at NEWS

_FZERO = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep
_C10D = os.path.join(_TORCH, "distributed", "distributed_c10d.py")
_DATA = os.path.join(_TORCH, "utils", "data") + os.sep
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep

# `torch.distributed` calls that wait for the other ranks of their group (point-to-point
# calls wait for one peer, which may be elsewhere legitimately: not counted).
COLLECTIVE_CALLS = frozenset(
    {
        "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
        "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
        "gather", "gather_object", "monitored_barrier", "reduce", "reduce_scatter",
        "reduce_scatter_tensor", "scatter", "scatter_object_list", "new_group",
    }
)  # fmt: skip


def key(kind: str, rank: int) -> str:
    """The store key of rank `rank`'s post of `kind` (one of `KINDS`)."""
    return f"fzero/{kind}/{rank}"


# ---- where a thread is ------------------------------------------------------------------------


@dataclass(frozen=True)
class Whereabouts:
    """Where a thread is, from its Python frames. `state`: "fzero" (inside fzero's code,
    not waiting) or "outside"; `call`: the `torch.distributed` collective it is in ("" if
    none) and `ranks` that call's group (None: unknown)."""

    state: str
    text: str
    call: str = ""
    ranks: tuple[int, ...] | None = None


def _place(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _call_ranks(frame: FrameType) -> tuple[int, ...] | None:
    """The ranks of the group a `distributed_c10d` function was called with."""
    try:
        group = frame.f_locals.get("group")
        if group is None or group is dist.group.WORLD:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # a group being destroyed, a frame gone: unknown
        return None


def whereabouts(frame: FrameType | None) -> Whereabouts:
    """Where the thread whose innermost frame is `frame` is."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        return Whereabouts("outside", "nowhere (the thread has ended)")
    files = [f.f_code.co_filename for f in frames]
    mine = [i for i, name in enumerate(files) if name.startswith(_FZERO)]
    user = next(
        (
            i
            for i, name in enumerate(files)
            if not name.startswith((_TORCH, _STDLIB, _FZERO)) and not name.startswith("<frozen")
        ),
        None,
    )
    c10d = next((i for i, name in enumerate(files) if name == _C10D), None)
    in_call = c10d is not None and frames[c10d].f_code.co_name in COLLECTIVE_CALLS
    if in_call and (not mine or (user is not None and user < mine[0])):
        assert c10d is not None
        call = frames[c10d].f_code.co_name
        caller = next(
            (i for i in range(c10d, len(frames)) if not files[i].startswith(_DISTRIBUTED)),
            None,
        )
        where = _place(frames[caller]) if caller is not None else "?"
        text = f"in its own torch.distributed.{call} (called at {where})"
        return Whereabouts("outside", text, call, _call_ranks(frames[c10d]))
    if any(name.startswith(_DATA) for name in files):
        where = _place(frames[user]) if user is not None else _place(frames[0])
        return Whereabouts("outside", f"in a data loader ({where})")
    if mine and (user is None or user > mine[0]):
        return Whereabouts("fzero", f"in fzero, not waiting ({_place(frames[mine[0]])})")
    where = _place(frames[user]) if user is not None else _place(frames[0])
    return Whereabouts("outside", f"in its own code at {where}")


# ---- what a rank reads of the others ----------------------------------------------------------


@dataclass(frozen=True)
class PeerView:
    """What another rank has posted: its fzero wait (`status`, "waiting|<at>|<what>|<s>"
    while it waits in one), what it raised, that it left ("<collectives>|<how>"), its last
    answer (decoded, or None), and whether its process is alive (None: not on this host).
    A raise posted as `final` cannot have been caught and gone on from."""

    rank: int
    status: str = ""
    raised: str = ""
    final: bool = False  # what it raised ends its run (an uncaught error, a disagreement)
    left: str = ""
    answer: Mapping[str, Any] | None = None
    alive: bool | None = None

    @property
    def waiting(self) -> tuple[str, str, str] | None:
        """(where: "c<seq>" or "a<seq>.<n>", what, seconds) while it waits in fzero."""
        if not self.status.startswith("waiting|"):
            return None
        parts = self.status.split("|", 3)
        return parts[1], parts[2], parts[3] if len(parts) > 3 else ""

    @property
    def place(self) -> str:
        """Where it waits, as two looks compare it: its status without the seconds ("" while
        it does not wait in fzero)."""
        waiting = self.waiting
        return f"{waiting[0]}|{waiting[1]}" if waiting is not None else ""

    @property
    def left_after(self) -> int:
        """The collectives it had issued when it left (-1: it did not leave)."""
        return int(self.left.split("|", 1)[0]) if self.left else -1


def process_alive(host: str, pid: int) -> bool | None:
    """Whether process `pid` on `host` runs (a zombie does not); None for another host."""
    if host != socket.gethostname() or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def read_peers(store: Any, rank: int, world: int) -> dict[int, PeerView]:
    """Every other rank's posts, in one store round (each rank creates its keys when its
    watch starts; a rank whose keys are not there yet reads as empty)."""
    others = [r for r in range(world) if r != rank]
    keys = [key(kind, r) for r in others for kind in KINDS]
    if store.check(keys):
        values = [v.decode() for v in store.multi_get(keys)]
    else:
        values = [store.get(k).decode() if store.check([k]) else "" for k in keys]
    views = {}
    for i, r in enumerate(others):
        status, raised, left, where, proc = values[i * len(KINDS) : (i + 1) * len(KINDS)]
        answer = None
        if where:
            with contextlib.suppress(ValueError):
                number, _, text = where.partition("|")
                answer = {**json.loads(text), "n": int(number)}
        alive = None
        if proc:
            host, _, pid = proc.rpartition("|")
            alive = process_alive(host, int(pid))
        final = raised.startswith("!")
        views[r] = PeerView(r, status, raised[final:], final, left, answer, alive)
    return views


def describe_peer(view: PeerView) -> str:
    """One rank's line of a picture of who is where."""
    r = view.rank
    if view.left:
        raised = f"raised in {view.raised}, then " if view.raised else ""
        return f"rank {r} {raised}left the program ({view.left.split('|', 1)[1]})"
    if view.alive is False:
        text = (
            f"rank {r}'s process has ended without a word (killed by a signal it cannot "
            "catch — SIGKILL, the OOM killer — or crashed in native code)"
        )
        if view.answer and view.answer.get("last"):
            text += f"; when it last answered, its last collective was {view.answer['last']}"
        return text
    if view.raised:
        return f"rank {r} raised in {view.raised}"
    waiting = view.waiting
    if waiting is not None:
        return f"rank {r} waits in {waiting[1]} (for {waiting[2]} s at its last look)"
    answer = view.answer
    if answer is None:
        return f"rank {r} has not answered yet (busy holding the interpreter, stopped, or gone)"
    text = f"rank {r} is {answer['where']}"
    if answer.get("operation"):
        text += f", within {answer['operation']}"
    if answer.get("last"):
        text += (
            f"; its last fzero collective was {answer['last']}, {answer['ago']:.1f} s before "
            "it answered"
        )
    else:
        text += "; it has issued no fzero collective yet"
    return text


# ---- the thread that answers --------------------------------------------------------------


class Subject(Protocol):
    """What the answering thread reads of its watch (`fzero._watch.Watch`)."""

    rank: int
    world: int
    closed: bool
    sliced: bool

    def is_current(self) -> bool: ...

    def answer(self, frame: FrameType | None) -> dict[str, Any]: ...

    def notice(self, store: Any, frame: FrameType | None) -> None: ...

    def monitor(self, store: Any) -> None: ...

    def terminated(self, signum: int, frame: FrameType | None, store: Any = None) -> None: ...


class Responder:
    """The thread that answers the other ranks (see the module's text). `wakeup`: the
    read end of the pipe given to `signal.set_wakeup_fd`, if any: a SIGTERM that arrives
    while the main thread is blocked in native code is acted on here at once."""

    def __init__(self, watch: Subject, store: Any, wakeup: int | None) -> None:
        self.watch, self.store, self.wakeup = watch, store, wakeup
        self.stopping = threading.Event()
        self.answered = -1
        self.thread = threading.Thread(target=self._run, name="fzero-watch", daemon=True)
        self.main = threading.main_thread().ident

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the thread (from any thread but itself: it is joined)."""
        self.stopping.set()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout=2 * POLL_S)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._sleep()
                if self.stopping.is_set() or self.watch.closed:
                    return
                if not self.watch.is_current():  # the group was destroyed under the watch:
                    return  # the main thread closes it (only it may restore SIGTERM)
                news = int(self.store.add(NEWS, 0))
                if news != self.answered:
                    self._answer(news)
                if not self.watch.sliced:
                    self.watch.monitor(self.store)
        except Exception:  # the store is gone (its host ended) or the interpreter ends:
            return  # the waits of the main thread say so where it matters

    def _sleep(self) -> None:
        if self.wakeup is None:
            self.stopping.wait(POLL_S)
            return
        ready, _, _ = select.select([self.wakeup], [], [], POLL_S)
        if not ready:
            return
        with contextlib.suppress(BlockingIOError):
            received = os.read(self.wakeup, 64)
            if signal.SIGTERM in received:
                self.watch.terminated(signal.SIGTERM, self._main_frame(), self.store)

    def _main_frame(self) -> FrameType | None:
        return sys._current_frames().get(self.main) if self.main is not None else None

    def _answer(self, news: int) -> None:
        frame = self._main_frame()
        answer = self.watch.answer(frame)
        self.store.set(key("where", self.watch.rank), f"{news}|{json.dumps(answer)}")
        self.answered = news
        if answer["call"]:  # in its own collective: a rank it needs may have left
            self.watch.notice(self.store, frame)
