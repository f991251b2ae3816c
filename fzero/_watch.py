"""The collective watch of fzero's process group: collectives that say what they are,
ranks that disagree, wait or leave named on every rank within seconds.

One `Watch` per default process group, made when fzero starts or adopts it
(`fzero.comm.init_distributed`) and closed when fzero destroys it (or finds it
destroyed); its settings (`WatchSettings`) are read once, then. `fzero.comm` re-exports
what callers use (`named_operation`, `agree`, `RankDisagreement`, `Watched`, ...) and
starts each of its collectives with `Watch.issue`.

[Note: numbered, watched collectives]
Every collective fzero issues on its groups is numbered (the same count on every rank
while the ranks agree) and described (`what`, and the named operation it runs in). On
gloo its wait is sliced: while it has not completed after `slice_s` seconds, this rank
writes where it waits to the process group's store and reads where the others are
(`_whereabouts.read_peers`). A rank that raised, left the program, or whose process is
gone is named at once; ranks that wait in different collectives twice in a row, or a
rank that sits in its own `torch.distributed` collective while this one waits for it,
end with one `RankDisagreement` naming each. A wait longer than `report_s` (30 s) prints
who is where, and again after twice as long, and so on; the timeout's error carries the
same picture. A wait that never lasts a slice costs nothing but the count. NCCL's waits
return before the collective ends: there the answering thread watches this rank's
collectives' progress instead (`Watch.monitor`).

[Note: the order check]
gloo and NCCL pair collectives by order: a stage-3 module one rank skips pairs its
neighbours' all-gathers with the wrong units (silently, for units of one size) or aborts
the process inside gloo (sizes differ). So the collectives are cut into segments — one
per outermost named operation (`named_operation`), and the runs of collectives issued
outside any (a plain `loss.backward()`, `generate` on the module at stage 3), cut where
such a run comes back to a collective it issued — and each collective is compared with
the one this rank issued at the same place the last time a segment of its key ran; a
segment's first collective is also compared with what followed the previous segment
last time (which operation follows which), and an operation's end with the last run's.
Where all is the same the collective is issued at once (the steady state: a tuple
compare). Where it is not — a segment's first run, another program, another path — the
ranks first agree through the store what comes next (`Watch.agree`, no collective): a
rank that differs gets the others' answers, and a rank that still follows its last run
waits in its collective meanwhile, where the watch names both. By induction a
collective issued without agreeing is the one every rank that issues anything there
issues. fzero's entry points that users call on every rank (`fzero.state_dict`,
checkpoints, evaluation) also agree at entry, so a rank that skipped one is named
before any collective of it. `FZERO_CHECK_COLLECTIVES=0` turns the check off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal

import torch
import torch.distributed as dist

from fzero import _whereabouts as whereabouts
from fzero._traffic import count, profiled
from fzero._whereabouts import PeerView, describe_peer, key, read_peers

__all__ = [
    "CHECK_COLLECTIVES",
    "DEFAULT_REPORT_S",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WATCH_S",
    "RankDisagreement",
    "Watch",
    "WatchSettings",
    "Watched",
    "current",
    "start_watch",
]

log = logging.getLogger("fzero")

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_WATCH_S = 1.0
DEFAULT_REPORT_S = 30.0
CHECK_COLLECTIVES = "FZERO_CHECK_COLLECTIVES"
GOODBYE_S = 10.0  # at exit a rank waits at most this long for the others to leave too
OUTSIDE = "outside fzero's operations"
FAILED_LOOK_S = 1.0  # a failed collective looks this long for the peer that ended it


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "")
    if text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{name} is {text!r}; expected a number of seconds >= 0")
    return value


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    """How a process group's collectives are watched; read once, when fzero starts or
    adopts the group (`from_environment`)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Collectives and agreements fail after this many seconds (`FZERO_TIMEOUT_S`)."""
    slice_s: float = DEFAULT_WATCH_S
    """On gloo, a wait longer than this asks the other ranks where they are
    (`FZERO_WATCH_S`; 0: waits are not sliced, as on NCCL)."""
    report_s: float = DEFAULT_REPORT_S
    """A wait longer than this prints who is where, then again after twice as long, ...
    (`FZERO_REPORT_S`, config `collective_report_s`; 0: never)."""
    check: bool = True
    """Check the order of collectives and operations across ranks
    (`FZERO_CHECK_COLLECTIVES`, "0" turns it off)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "slice_s", "report_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"WatchSettings.{name} is {value!r}; expected seconds >= 0")
        if self.timeout_s == 0:
            raise ValueError("WatchSettings.timeout_s is 0; expected seconds > 0")

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, *, timeout_s: float | None = None
    ) -> WatchSettings:
        """The settings the environment gives (`timeout_s` given wins over
        `FZERO_TIMEOUT_S`); an unparsable variable is an error naming it."""
        env = os.environ if environ is None else environ
        if not timeout_s and _seconds(env, "FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S) == 0:
            raise ValueError("FZERO_TIMEOUT_S is '0'; expected a number of seconds > 0")
        return cls(
            timeout_s=timeout_s or _seconds(env, "FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S),
            slice_s=_seconds(env, "FZERO_WATCH_S", DEFAULT_WATCH_S),
            report_s=_seconds(env, "FZERO_REPORT_S", DEFAULT_REPORT_S),
            check=env.get(CHECK_COLLECTIVES, "1") not in ("0", ""),
        )


class RankDisagreement(RuntimeError):
    """The ranks are in different collectives, another rank raised or left, or a rank
    waits in a call the others never make: the step cannot complete. The message names
    what each rank was doing."""


@dataclass(frozen=True)
class _Collective:
    seq: int
    kind: str
    numel: int
    what: str
    within: str
    agreement: int = 0  # an agreement's number (its store keys carry it)

    @property
    def at(self) -> str:
        """Where a rank waits, as the watch compares it: "c<seq>", "a<seq>.<number>"."""
        return f"a{self.seq}.{self.agreement}" if self.kind == "agreement" else f"c{self.seq}"

    def describe(self) -> str:
        text = f"collective #{self.seq} {self.kind} of {self.numel:,} elements"
        if self.kind == "agreement":  # through the store, among `numel` ranks
            text = f"an agreement of {self.numel} ranks after collective #{self.seq}"
        text += f" ({self.what})" if self.what else ""
        return text + (f" in {self.within}" if self.within else "")


def _may_complete(mine: str, other: str) -> bool:
    """Whether two ranks waiting at `mine` and `other` (`_Collective.at`) may both go on:
    a rank in an agreement has issued every collective up to its seq, so one waiting in
    such a collective finishes it (and two in the same agreement wait for a third)."""
    if "a" not in (mine[0], other[0]):
        return False  # two collectives: only the same one completes
    if mine[0] == other[0]:
        return mine == other
    agreement, waiting = (mine, other) if mine[0] == "a" else (other, mine)
    return int(waiting[1:]) <= int(agreement[1:].split(".")[0])


class _TimedOut(Exception):
    pass


class _Failed(Exception):
    pass


class _Asked:
    """What one look at the other ranks saw (the next look compares with it)."""

    def __init__(self, views: Mapping[int, PeerView], places: Mapping[int, str]) -> None:
        self.views, self.places = views, places


# ---- the order check ------------------------------------------------------------------------


@dataclass(eq=False)
class _Track:
    """One segment's collectives (`key`), against its last run's (see the note above)."""

    watch: Watch
    key: str
    name: str
    expected: tuple[tuple[str, int, str], ...] | None
    outside: bool = False
    done: list[tuple[str, int, str]] = field(default_factory=list)
    seen: set[tuple[str, int, str]] = field(default_factory=set)  # outside: what it issued

    def next(self, kind: str, numel: int, what: str, group: Any) -> None:
        """Before issuing a collective: the same as last time here, or agreed."""
        at, signature = len(self.done), (kind, numel, what)
        self.done.append(signature)
        expected, watch = self.expected, self.watch
        if at == 0:  # keys, not names, are compared (`join` serves another's operation)
            follows = watch.successor.get(watch.previous) == self.key
            watch.successor[watch.previous] = self.key
            previous, watch.previous = watch.previous, self.key
            if follows and expected and expected[0] == signature:
                return
            mine = f"{_signature(signature)} as collective #{watch.issued + 1}, the first of "
            mine += f"{_readable(self.key)} after {_readable(previous)}"
            watch.agree_next(mine, self.name, group)
            return
        if expected is not None and at < len(expected) and expected[at] == signature:
            return
        mine = f"{_signature(signature)} as collective #{watch.issued + 1}"
        watch.agree_next(mine, self.name, group)

    def end(self) -> None:
        """The segment ended: where it ran fewer collectives than last time, or for the
        first time, the ranks agree it ended here; then this run is the next one's.
        (Agreements carry the collectives issued so far: a rank that issued more without
        waiting on them cannot agree with one that did not.)"""
        expected, done, watch = self.expected, len(self.done), self.watch
        if (expected is None and done > 0) or (expected is not None and done < len(expected)):
            text = f"the end of {_readable(self.key)} after {done} collective(s), "
            text += f"#{watch.issued} so far"
            watch.agree_next(text, self.name, None)
        watch.tracks[self.key] = tuple(self.done)


def _readable(key: str) -> str:
    """A segment's key for people: "backward of Net (grad=True, False)"."""
    base, *flags = key.split("|")
    return f"{base} ({', '.join(flags)})" if flags else base or "the start of the program"


def _signature(signature: tuple[str, int, str]) -> str:
    kind, numel, what = signature
    return f"{kind} of {numel:,} elements" + (f" ({what})" if what else "")


# ---- the watch ------------------------------------------------------------------------------


class Watch:
    """The collective watch of one default process group (see the notes above): its
    settings, the collectives and agreements issued, the order check's record, what this
    rank waits in, the thread that answers the other ranks, and the hooks that post an
    uncaught exception, an exit or a SIGTERM (installed by `start`, removed by `close`)."""

    def __init__(self, group: Any, settings: WatchSettings) -> None:
        self.group, self.settings = group, settings
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()
        self.store = dist.distributed_c10d._get_default_store()
        self.sliced = self.world > 1 and self.backend == "gloo" and settings.slice_s > 0
        self.checked = self.world > 1 and settings.check
        self.issued = 0  # collectives issued on fzero's groups (exempt threads' aside)
        self.agreed = 0  # agreements this process took part in (their keys carry it)
        self.operation = ""  # the outermost named operation running now
        self.last_operation = ""  # the last one entered
        self.last_key = ""
        self.last: _Collective | None = None  # the last collective issued, and when
        self.last_time = time.monotonic()
        self.waiting: _Collective | None = None  # what the main thread waits in now
        self.waiting_since = 0.0
        self.posted = False  # this rank told the store it raised
        self.failing = False  # an uncaught exception ends the process
        self.leaving = ""  # how it ends, once known
        self.closed = False
        # the order check (see the note above)
        self.tracks: dict[str, tuple[tuple[str, int, str], ...]] = {}
        self.successor: dict[str, str] = {}
        self.previous = ""  # the key of the last segment that issued a collective
        self.track: _Track | None = None
        self.paused = 0  # inside `unchecked()`
        self.group_ranks: dict[Any, list[int]] = {}
        self.side_groups: dict[int, Any] = {}  # `fzero.comm.side_group`
        self.local = threading.local()  # `exempt` on a thread whose collectives are not checked
        self.monitored: dict[str, Any] = {}  # `monitor`'s record of a stuck collective
        self._responder: whereabouts.Responder | None = None
        self._hooks: list[Callable[[], None]] = []  # undo, by `close`
        self._terminating = threading.Lock()

    # ---- life ------------------------------------------------------------------------------

    def is_current(self) -> bool:
        """Whether the default process group is still the one this watch was made for."""
        return not self.closed and dist.is_initialized() and dist.group.WORLD is self.group

    def start(self, on_exit: Callable[[], None]) -> None:
        """Post this rank's keys, start the answering thread (several ranks) and install
        the hooks: `on_exit` at interpreter exit (before teardown), the except hook, and a
        SIGTERM handler where SIGTERM has none."""
        atexit.register(on_exit)
        self._hooks.append(lambda: atexit.unregister(on_exit))
        previous = sys.excepthook

        def hook(*info: Any) -> None:
            if self.is_current():
                self.failing = True
                self.leaving = f"an uncaught {info[0].__name__}: {info[1]}"
                with contextlib.suppress(Exception):
                    self.post_raised(f"{OUTSIDE}: {info[0].__name__}: {info[1]}", final=True)
            previous(*info)

        sys.excepthook = hook
        self._hooks.append(lambda: _restore_excepthook(hook, previous))
        if self.world == 1:
            return
        for kind in ("watch", "raised", "left", "where"):
            self.store.set(key(kind, self.rank), "")
        self.store.set(key("proc", self.rank), f"{socket.gethostname()}|{os.getpid()}")
        wakeup = self._catch_sigterm()
        clone = getattr(self.store, "clone", None)
        self._responder = whereabouts.Responder(self, clone() if clone else self.store, wakeup)
        self._responder.start()

    def _catch_sigterm(self) -> int | None:
        """Post "left" on SIGTERM, then die of it as before. Python runs a handler only
        between bytecodes of the main thread, which may sit in native code for the whole
        wait: so the signal also wakes the answering thread (`signal.set_wakeup_fd`),
        which acts at once. Only where SIGTERM is untouched (the default action) and no
        one else uses the wakeup fd (asyncio); only from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            old = None
        if old != -1:
            if old is not None:
                signal.set_wakeup_fd(old)
            os.close(read)
            os.close(write)
            return None

        def handler(signum: int, frame: FrameType | None) -> None:
            self.terminated(signum, frame)

        signal.signal(signal.SIGTERM, handler)

        def undo() -> None:
            if threading.current_thread() is threading.main_thread():
                if signal.getsignal(signal.SIGTERM) is handler:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                mine = signal.set_wakeup_fd(-1)
                if mine != write:
                    signal.set_wakeup_fd(mine)
            for fd in (read, write):
                with contextlib.suppress(OSError):
                    os.close(fd)

        self._hooks.append(undo)
        return read

    def terminated(self, signum: int, frame: FrameType | None, store: Any = None) -> None:
        """SIGTERM (from the main thread's handler, or the answering thread with its own
        `store` connection: the main thread may hold the shared one in a wait): say so,
        then end the process by the signal's default action, as without fzero."""
        if not self._terminating.acquire(blocking=False):
            return
        name = signal.Signals(signum).name
        with contextlib.suppress(Exception):
            self.leaving = f"terminated by {name} while {self._doing(frame)}"
            self.post_left(store)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
        else:  # only the main thread may call signal.signal: set the action below it
            setsig = ctypes.pythonapi.PyOS_setsig
            setsig.argtypes, setsig.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
            setsig(signum, None)
        os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Stop the answering thread and remove the hooks (the group is being destroyed)."""
        if self.closed:
            return
        self.closed = True
        if self._responder is not None:
            self._responder.stop()
        for undo in reversed(self._hooks):
            with contextlib.suppress(Exception):
                undo()
        self._hooks.clear()

    def leave(self) -> None:
        """At exit, before the group is destroyed: post that this rank left (and how),
        then wait, at most `GOODBYE_S`, until every other rank has left, or has read it
        while outside fzero's operations, so that no rank closes its connections while a
        peer's last collective may still be finishing on them (after an uncaught
        exception: until each has read it). Through the store: a rank that leaves early
        never pairs a collective with the others'."""
        if self.world == 1 or self.closed:
            return
        news = self.post_left()
        wait = min(GOODBYE_S, self.settings.timeout_s)
        if self.failing:  # the others only need to read it
            wait = min(wait, 4 * whereabouts.POLL_S)
        deadline = time.monotonic() + wait
        with contextlib.suppress(Exception):
            while news >= 0 and time.monotonic() < deadline:
                views = read_peers(self.store, self.rank, self.world).values()
                staying = [v for v in views if not v.left and v.alive is not False]
                told = [v for v in staying if v.answer is not None and v.answer["n"] >= news]
                if len(told) == len(staying) and (
                    self.failing or all(v.answer["state"] == "outside" for v in told)
                ):  # each live rank has read that this one left, and none can be in the
                    return  # middle of an fzero collective with it
                time.sleep(0.05)

    # ---- posts -----------------------------------------------------------------------------

    def post_raised(self, text: str, final: bool = False) -> None:
        """Tell the other ranks this one raised (their waits end with it: at once when
        `final`, an error no one goes on from; else when still so at their next look)."""
        if self.world == 1:
            return
        with contextlib.suppress(Exception):
            self.store.set(key("raised", self.rank), ("!" if final else "") + text[:2000])
            self.store.add(whereabouts.NEWS, 1)
            self.posted = True

    def withdraw(self) -> None:
        """This rank goes on after an exception it caught: the old one no longer stops
        the others."""
        if self.posted:
            self.posted = False
            with contextlib.suppress(Exception):
                self.store.set(key("raised", self.rank), "")

    def post_left(self, store: Any = None) -> int:
        """Post that this rank left the program, how and after what; returns the news
        count after it (-1: the store is gone)."""
        store = self.store if store is None else store
        how = self.leaving or "its script ended or called sys.exit"
        after = f"after {self.last_operation}" if self.last_operation else "before any operation"
        text = f"{self.issued}|{how}, {after}, collective #{self.issued}"
        try:
            store.set(key("left", self.rank), text[:2000])
            return int(store.add(whereabouts.NEWS, 1))
        except Exception:
            return -1

    # ---- collectives -----------------------------------------------------------------------

    def issue(
        self,
        kind: str,
        tensor: torch.Tensor,
        what: str,
        async_op: bool,
        start: Callable[[bool], Any],
        group: Any = None,
        counted: bool = True,
    ) -> Any:
        """Start one collective (`start(async_op)`): checked, counted (unless not
        `counted`), numbered, and watched where waits are sliced (every process issues the
        same sequence, a subgroup's included: one count); timed while a comms logger is
        on (`fzero._traffic.profiled`). From a thread marked by `exempt_thread` (an
        asynchronous checkpoint writer, on its own group): only counted."""
        within = self.operation or (self.track.name if self.track is not None else "")
        run = functools.partial(
            self._issue, kind, tensor, what, start=start, group=group, counted=counted
        )
        return profiled(kind, tensor, group, what, within, run, async_op)

    def _issue(
        self,
        kind: str,
        tensor: torch.Tensor,
        what: str,
        async_op: bool,
        *,
        start: Callable[[bool], Any],
        group: Any,
        counted: bool,
    ) -> Any:
        if getattr(self.local, "exempt", False):
            if counted:
                count(kind, tensor, group)
            return start(async_op)
        if self.checked and not self.paused:
            self._check(kind, tensor.numel(), what, group)
        if counted:
            count(kind, tensor, group)
        self.issued += 1
        if self.posted:
            self.withdraw()
        within = self.operation or (self.track.name if self.track is not None else "")
        collective = _Collective(self.issued, kind, tensor.numel(), what, within)
        self.last, self.last_time = collective, time.monotonic()
        if not self.sliced:
            return start(async_op)
        watched = Watched(self, start(True), collective)
        if async_op:
            return watched
        watched.wait()
        return None

    def _check(self, kind: str, numel: int, what: str, group: Any) -> None:
        track = self.track
        if track is None:
            if self.operation:  # a named operation that is not checked (`track=""`)
                return
            track = self.track = self._outside()
        if track.outside:  # a run outside the operations ends where it comes back to a
            signature = (kind, numel, what)  # collective it issued (the next forward of
            if signature in track.seen:  # a `generate` loop): runs stay bounded
                track.end()
                track = self.track = self._outside()
            track.seen.add(signature)
        track.next(kind, numel, what, group)

    def _outside(self) -> _Track:
        """A segment of collectives outside every named operation, keyed by the last
        segment before it that was not one (and the gradient mode)."""
        previous = self.previous
        if previous.startswith(OUTSIDE):
            after = previous.split("|after ", 1)[1]
        else:
            after = previous.split("|")[0] or "the start of the program"
        key = f"{OUTSIDE}|grad={torch.is_grad_enabled()}|after {after}"
        return _Track(self, key, f"{OUTSIDE} (after {self.last_operation or 'the start'})",
                      self.tracks.get(key), outside=True)  # fmt: skip

    @contextlib.contextmanager
    def named(
        self, name: str, track: str | None, entry: Literal["never", "always", "first"]
    ) -> Iterator[None]:
        """`fzero.comm.named_operation` on this watch."""
        if self.operation:
            yield
            return
        self.operation = name
        if self.posted:
            self.withdraw()
        if track is None:
            track = f"{name.split(' (')[0]}|grad={torch.is_grad_enabled()}"
        first = self.last_key != track
        self.last_operation, self.last_key = name, track
        try:
            if self.track is not None:  # a run outside the operations ends here
                outside, self.track = self.track, None
                outside.end()
            if self.world > 1 and (entry == "always" or (entry == "first" and first)):
                self._agree_entry(name)
            if track and self.checked:
                self.track = _Track(self, track, name, self.tracks.get(track))
            yield
            if self.track is not None:
                self.track.end()
        except RankDisagreement:
            raise
        except BaseException as error:
            self.post_raised(f"{name}: {type(error).__name__}: {error}")
            raise
        finally:
            self.operation = ""
            self.track = None

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def ranks_of(self, group: Any) -> list[int]:
        if group not in self.group_ranks:
            every = range(self.world)
            ranks = every if group is None else dist.get_process_group_ranks(group)
            self.group_ranks[group] = list(ranks)
        return self.group_ranks[group]

    # ---- agreements ------------------------------------------------------------------------

    def agree(self, what: str, value: str, ranks: Sequence[int]) -> dict[int, str]:
        """Every rank of `ranks` posts `value` and gets every rank's, through the store:
        no collective, so a rank that is elsewhere cannot pair it with another one. The
        wait is watched as a collective's (`_wait`)."""
        store, rank = self.store, self.rank
        self.agreed += 1
        keys = {r: f"fzero/agree/{self.agreed}/{r}" for r in ranks}
        store.set(keys[rank], value)
        collective = _Collective(
            self.issued, "agreement", len(ranks), what, self.operation, self.agreed
        )
        posts = list(keys.values())
        deadline = time.monotonic() + self.settings.timeout_s
        pause = [5e-5]

        def poll(seconds: float) -> bool:  # the pause doubling to 5 ms (the store's own
            until = time.monotonic() + seconds  # wait logs each timeout it reaches)
            while not store.check(posts):
                now = time.monotonic()
                if now > deadline:
                    raise _TimedOut()
                if now > until:
                    return False
                time.sleep(pause[0])
                pause[0] = min(2 * pause[0], 0.005)
            return True

        self._wait(collective, poll, self.settings.slice_s or 1.0)
        values = dict(zip(keys, (v.decode() for v in store.multi_get(posts))))
        if self.agreed > _KEPT_AGREEMENTS:  # the ranks that read this rank's older posts
            with contextlib.suppress(Exception):  # have posted (and so read) many since
                store.delete_key(f"fzero/agree/{self.agreed - _KEPT_AGREEMENTS}/{rank}")
        return values

    def agree_next(self, mine: str, within: str, group: Any) -> None:
        """The order check's agreement: every rank of `group` says what it is about to
        do; unless all say the same, every one raises naming each rank's."""
        every = self.agree(f"what comes next in {within}: {mine}", mine, self.ranks_of(group))
        if any(value != mine for value in every.values()):
            doing = "; ".join(f"rank {r}: {value}" for r, value in sorted(every.items()))
            message = (
                f"fzero: the ranks are about to issue different collectives in {within} "
                f"({doing}). A rank took another path: at ZeRO stage 3 a module one rank "
                "skipped (a branch, an unused expert) or a different number of forwards; "
                "otherwise a skipped backward or step, or a different number of batches. "
                "Every rank must run the same fzero operations and stage-3 modules in the "
                "same order (put a module some ranks skip in a unit with one every rank runs, "
                "e.g. deepspeed.utils.set_z3_leaf_modules; uneven data: engine.join())"
            )
            self.post_raised(f"{within}: RankDisagreement: {message}", final=True)
            raise RankDisagreement(message)

    def _agree_entry(self, name: str) -> None:
        every = self.agree(f"the entry of {name}", name, range(self.world))
        if any(value != name for value in every.values()):
            doing = "; ".join(f"rank {r}: {value}" for r, value in sorted(every.items()))
            message = (
                f"fzero: the ranks entered different operations ({doing}); every rank must "
                "call fzero's collective operations (state_dict, checkpoints, evaluation at "
                "stage 3) in the same order"
            )
            self.post_raised(f"{name}: RankDisagreement: {message}", final=True)
            raise RankDisagreement(message)

    # ---- waits -----------------------------------------------------------------------------

    def _wait(self, collective: _Collective, poll: Callable[[float], bool], every: float) -> None:
        """Wait until `poll(seconds)` is true, looking at the other ranks after each
        `every` seconds (`_look`), reporting after `report_s` and twice as long each time
        after; `poll` raises `_TimedOut` at the collective timeout, `_Failed` when the
        collective failed (a peer is gone): both become errors that say who is where."""
        asked: _Asked | None = None
        start = time.monotonic()
        report = self.settings.report_s
        try:
            while not poll(every):
                if asked is None:
                    self.waiting, self.waiting_since = collective, start
                waited = time.monotonic() - start
                asked = self._look(collective, asked, waited)
                if report and waited >= report:
                    self._report(collective, asked, waited)
                    report *= 2
        except (_TimedOut, _Failed) as stopped:
            cause = stopped.__cause__
            if isinstance(stopped, _TimedOut):
                error = self._timed_out(collective, start, cause)
            else:
                error = self._failed(collective, cause)
            self.post_raised(f"{collective.within or collective.describe()}: {error}", True)
            raise error from cause
        finally:
            if asked is not None:  # this rank said where it waits: no longer
                self.waiting = None
                with contextlib.suppress(Exception):
                    self.store.set(key("watch", self.rank), "done")

    def _look(self, collective: _Collective, asked: _Asked | None, waited: float) -> _Asked:
        """Say where this rank waits and read where the others are; raise when they can
        never meet (see the note above). The raise is posted, so the others end with it."""
        mine = collective.describe()
        try:
            self.store.set(key("watch", self.rank), f"waiting|{collective.at}|{mine}|{waited:.0f}")
            self.store.add(whereabouts.NEWS, 1)
            views = read_peers(self.store, self.rank, self.world)
        except Exception as error:  # the store's host is gone
            if collective.kind == "agreement":  # nothing else can end this wait
                raise RankDisagreement(self._store_lost(mine, error)) from error
            return asked or _Asked({}, {})  # the collective's own error will tell
        message = self._never_meet(collective, asked, views)
        if message:
            self.post_raised(f"{collective.within or mine}: RankDisagreement: {message}", True)
            raise RankDisagreement(message)
        return self._remember(views, asked)

    def _remember(self, views: Mapping[int, PeerView], asked: _Asked | None) -> _Asked:
        """What the next look compares with (`_never_meet`): where each rank waits,
        what it raised, and how many answers in a row put it in its own collective that
        needs this rank."""
        places = {r: v.place for r, v in views.items() if v.waiting is not None}
        places.update({-1 - r: v.raised for r, v in views.items() if v.raised})
        for r, v in views.items():  # in its own collective that needs this rank: how many
            answer = v.answer or {}  # answers in a row said so (`_never_meet`)
            if answer.get("call") and self.rank in (answer.get("ranks") or ()):
                before = asked.places.get(-1000 - r, "||") if asked else "||"
                number, times, where = before.split("|", 2)
                if where != answer["where"]:
                    times = "0"
                if number != str(answer["n"]):
                    times = str(int(times or 0) + 1)
                places[-1000 - r] = f"{answer['n']}|{times}|{answer['where']}"
        return _Asked(views, places)

    def _never_meet(
        self, collective: _Collective, asked: _Asked | None, views: Mapping[int, PeerView]
    ) -> str:
        """Why this rank's wait can never end, or "" (see the note above)."""
        rank, mine, here = self.rank, collective.describe(), collective.at
        for r, v in sorted(views.items()):
            gone = v.left or v.alive is False
            if gone and v.raised:  # what it raised says most
                return f"fzero: rank {r} raised in {v.raised}; rank {rank} was waiting in {mine}"
            if v.left and (collective.kind == "agreement" or v.left_after < collective.seq):
                return f"fzero: {describe_peer(v)}; rank {rank} waits in {mine}"
            if v.alive is False and not v.left:
                return f"fzero: {describe_peer(v)}; rank {rank} waits in {mine}"
        for r, v in sorted(views.items()):  # final, or still so at the previous look: not
            seen = asked is not None and asked.places.get(-1 - r) == v.raised  # a rank that
            if v.raised and (v.final or seen):  # caught its error and went on
                return f"fzero: rank {r} raised in {v.raised}; rank {rank} was waiting in {mine}"
        if asked is None:
            return ""
        elsewhere = {  # where each waits, not for how long: the same place twice
            r: v.place
            for r, v in views.items()
            if v.waiting is not None
            and v.waiting[0] != here
            and not _may_complete(here, v.waiting[0])
        }
        if elsewhere and all(asked.places.get(r) == s for r, s in elsewhere.items()):
            doing = {rank: mine, **{r: s.split("|", 1)[1] for r, s in elsewhere.items()}}
            lines = "; ".join(f"rank {r} waits in {doing[r]}" for r in sorted(doing))
            return (
                f"fzero: the ranks are in different collectives and none can complete: "
                f"{lines}. A rank took another path (a branch or module skipped, an unused "
                "expert, a skipped backward or step, a different number of batches or "
                "forwards); every rank must run the same fzero operations in the same order"
            )
        for r, v in sorted(views.items()):  # three answers in a row (a rank descheduled
            answer = v.answer or {}  # for a moment inside a quick one is not stuck there)
            if not answer.get("call") or rank not in (answer.get("ranks") or ()):
                continue
            number, times, where = asked.places.get(-1000 - r, "||").split("|", 2)
            if where == answer["where"] and int(times or 0) + (number != str(answer["n"])) >= 3:
                return (
                    f"fzero: rank {r} is {answer['where']}, outside fzero, while rank {rank} "
                    f"waits in {mine}: neither can go on. A rank skipped one of fzero's "
                    "collective calls (state_dict, a checkpoint, a step) or called a "
                    "collective the others do not; every rank must make the same calls"
                )
        return ""

    def _picture(
        self, collective: _Collective, views: Mapping[int, PeerView], waited: float
    ) -> str:
        lines = [f"rank {self.rank} waits in {collective.describe()} (for {waited:.0f} s)"]
        lines += [describe_peer(v) for _, v in sorted(views.items())]
        return "; ".join(lines)

    def _report(self, collective: _Collective, asked: _Asked, waited: float) -> None:
        log.warning(
            "fzero: rank %d has waited %.0f s. Who is where: %s",
            self.rank,
            waited,
            self._picture(collective, asked.views, waited),
        )

    def _views(self) -> Mapping[int, PeerView] | Exception:
        try:
            return read_peers(self.store, self.rank, self.world)
        except Exception as error:  # the store's host is gone
            return error

    def _timed_out(
        self, collective: _Collective, start: float, error: BaseException | None
    ) -> RankDisagreement:
        """The collective timeout: who did not arrive, and the picture of who is where."""
        waited = time.monotonic() - start
        views = self._views()
        within = collective.within or collective.what or "fzero"
        if isinstance(views, Exception):
            return RankDisagreement(
                f"fzero {within}: {collective.describe()} timed out after {waited:.0f} s, "
                "and the store could not be reached to ask the other ranks why"
            )
        missing = [r for r, v in sorted(views.items()) if (v.waiting or ("",))[0] != collective.at]
        return RankDisagreement(
            f"fzero {within}: rank(s) {missing} did not arrive in {collective.describe()} "
            f"within the collective timeout ({self.settings.timeout_s:g} s; they are "
            "elsewhere: in user code, a data loader, another engine's call, or dead). Who is "
            f"where: {self._picture(collective, views, waited)}"
            + (f" ({error})" if error is not None else "")
        )

    def _failed(self, collective: _Collective, error: BaseException | None) -> BaseException:
        """A collective failed (a peer closed its connections): whoever raised, left or
        is gone is the error to give, else the failure with the picture. A killed peer's
        connections close while its process is still ending (not yet a zombie): its end
        is looked for again, for up to `FAILED_LOOK_S`."""
        views = self._views()
        deadline = time.monotonic() + FAILED_LOOK_S
        while not isinstance(views, Exception) and time.monotonic() < deadline:
            if any(v.raised or v.left or v.alive is False for v in views.values()):
                break
            time.sleep(0.05)
            views = self._views()
        if isinstance(views, Exception):
            return RankDisagreement(
                self._store_lost(collective.describe(), views)
                + f" (the collective's error: {error})"
            )
        for r, v in sorted(views.items()):
            if v.raised:
                return RankDisagreement(
                    f"fzero: rank {r} raised in {v.raised}; rank {self.rank} was waiting in "
                    f"{collective.describe()}"
                )
        gone = [v for _, v in sorted(views.items()) if v.left or v.alive is False]
        if gone:
            lines = "; ".join(describe_peer(v) for v in gone)
            return RankDisagreement(
                f"fzero: {lines}; rank {self.rank} waits in {collective.describe()} ({error})"
            )
        within = collective.within or "fzero"
        return RankDisagreement(
            f"fzero {within}: {collective.describe()} failed ({error}). Who is where: "
            f"{self._picture(collective, views, time.monotonic() - self.last_time)}"
        )

    def _store_lost(self, mine: str, error: BaseException | None) -> str:
        return (
            f"fzero: the process group's store cannot be reached ({error}): the process that "
            "hosts it (rank 0, unless a launcher's agent does) is gone; rank "
            f"{self.rank} waits in {mine}"
        )

    # ---- answers (the thread of `_whereabouts.Responder`) ------------------------------------

    def _doing(self, frame: FrameType | None) -> str:
        waiting = self.waiting
        if waiting is not None:
            seconds = time.monotonic() - self.waiting_since
            return f"waiting in {waiting.describe()} for {seconds:.1f} s"
        return whereabouts.whereabouts(frame).text

    def answer(self, frame: FrameType | None) -> dict[str, Any]:
        """Where this rank is, for the others (a JSON object)."""
        waiting = self.waiting
        place = whereabouts.whereabouts(frame) if waiting is None else None
        last = self.last
        return {
            "state": "waiting" if place is None else place.state,
            "where": self._doing(frame) if place is None else place.text,
            "call": place.call if place is not None else "",
            "ranks": list(place.ranks) if place is not None and place.ranks else None,
            "operation": self.operation,
            "last": last.describe() if last is not None else "",
            "ago": time.monotonic() - self.last_time,
        }

    def notice(self, store: Any, frame: FrameType | None) -> None:
        """A rank left while this one sits in its own torch.distributed collective that
        needs it (no fzero wait to raise here): say so, once."""
        views = read_peers(store, self.rank, self.world)
        if self.waiting is not None or not any(v.left for v in views.values()):
            return
        place = whereabouts.whereabouts(frame)
        seen = self.monitored.setdefault("noticed", set())
        for r, v in sorted(views.items()):
            if v.left and r not in seen and place.call and r in (place.ranks or ()):
                seen.add(r)
                log.warning("fzero: %s; rank %d is %s", describe_peer(v), self.rank, place.text)

    def monitor(self, store: Any) -> None:
        """Where waits are not sliced (NCCL, `FZERO_WATCH_S=0`): a collective of this rank
        that has not completed after `report_s` (torch's flight recorder where it records,
        else: this rank's last collective issued that long ago while another rank has
        issued fewer, through the store) prints who is where, then after twice as long."""
        report = self.settings.report_s
        if not report or self.last is None:
            return
        pending = _flight_recorder_pending()
        if pending is None:  # no record: compare collective counts through the store
            store.set(key("issued", self.rank), str(self.issued))
            counts = {}
            for r in range(self.world):
                if r != self.rank and store.check([key("issued", r)]):
                    counts[r] = int(store.get(key("issued", r)).decode())
            pending = bool(counts) and min(counts.values()) < self.issued
        if not pending:
            self.monitored.pop("since", None)
            return
        last = self.last
        since = self.monitored.get("since")
        if since is None or since[0] is not last:
            self.monitored["since"] = since = [last, self.last_time, report]
        waited = time.monotonic() - since[1]
        if waited < since[2]:
            return
        since[2] *= 2
        store.add(whereabouts.NEWS, 1)
        time.sleep(2 * whereabouts.POLL_S)  # the others answer the news
        views = read_peers(store, self.rank, self.world)
        log.warning(
            "fzero: rank %d's last collective has not completed after %.0f s. Who is where: %s",
            self.rank,
            waited,
            "; ".join(
                [f"rank {self.rank} waits in {last.describe()}"]
                + [describe_peer(v) for _, v in sorted(views.items())]
            ),
        )


def _flight_recorder_pending() -> bool | None:
    """Whether torch's flight recorder has a collective of the default group enqueued and
    not completed (None: it records nothing, `TORCH_FR_BUFFER_SIZE` /
    `TORCH_NCCL_TRACE_BUFFER_SIZE` unset)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        trace = json.loads(dump(False, True))
    except Exception:
        return None
    status = (trace.get("pg_status") or {}).get("0")
    if not status:
        return None
    enqueued = int(status.get("last_enqueued_collective", -1))
    return enqueued > int(status.get("last_completed_collective", -1))


def _restore_excepthook(hook: Any, previous: Any) -> None:
    if sys.excepthook is hook:
        sys.excepthook = previous


# A rank deletes its post of an agreement this many agreements later: a rank of that
# agreement's group may still be about to read it (a subgroup's agreements interleave
# with another's; the previous one alone is not safe).
_KEPT_AGREEMENTS = 64


class Watched:
    """A collective in flight (torch's `Work`) whose `wait` asks the other ranks where
    they are when it takes longer than a slice, and raises `RankDisagreement` when they
    are somewhere it can never complete."""

    def __init__(self, watch: Watch, work: Any, collective: _Collective) -> None:
        self.watch, self.work, self.collective = watch, work, collective
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
        work = self.work

        def poll(seconds: float) -> bool:
            try:
                work.wait(timeout=datetime.timedelta(seconds=seconds))
                return True
            except RuntimeError as error:
                text = str(error).lower()
                if not work.is_completed() and "timed out" in text:
                    return False  # a slice: still running
                raise (_TimedOut() if "timed out" in text else _Failed()) from error

        self.watch._wait(self.collective, poll, self.watch.settings.slice_s)
        self._done = True
        return True


# ---- the watch of the process group now -------------------------------------------------------

_active: list[Watch] = []  # the watch of the default group fzero started or adopted


def current() -> Watch | None:
    """The watch of the default process group, if fzero started or adopted it (a group
    destroyed under the watch closes it)."""
    if not _active:
        return None
    watch = _active[0]
    if dist.is_initialized() and dist.group.WORLD is watch.group and not watch.closed:
        return watch
    watch.close()
    _active.clear()
    return None


def start_watch(settings: WatchSettings, on_exit: Callable[[], None]) -> Watch:
    """The watch of the default process group (started now if it has none)."""
    watch = current()
    if watch is None:
        watch = Watch(dist.group.WORLD, settings)
        watch.start(on_exit)
        _active.append(watch)
    return watch


def replace_settings(watch: Watch, **changes: Any) -> None:
    """Change a running watch's settings (`fzero.comm.watch_collectives`, an engine's
    `collective_report_s`)."""
    watch.settings = dataclasses.replace(watch.settings, **changes)
    slice_s = watch.settings.slice_s
    watch.sliced = watch.world > 1 and watch.backend == "gloo" and slice_s > 0


def forget() -> None:
    """Start over as in a new process, the process groups being destroyed
    (`comm.forget_process_groups`): the old default group's watch is closed (its answering
    thread stopped; its exit, exception and SIGTERM hooks removed) and dropped, so the
    next group gets a new one (numbering, order-check tracks, posts and settings afresh)."""
    for watch in _active:
        watch.side_groups.clear()  # destroyed with the default group
        watch.close()
    _active.clear()
