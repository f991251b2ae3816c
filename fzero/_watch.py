"""The collective watch of fzero's process group: collectives that say what they are,
ranks that disagree, wait or leave named on every rank within seconds.

One `Watch` per default process group, made when fzero starts or adopts it
(`fzero.comm.init_distributed`) and closed when fzero destroys it (or finds it
destroyed); its settings (`WatchSettings`) are read once, then. `fzero.comm` re-exports
what callers use (`named_operation`, `agree`, `RankDisagreement`, `Watched`, ...) and
starts each of its collectives with `Watch.issue`.

The watch owns its parts, each in a module of its own:

- `fzero._watch_settings`: `WatchSettings`, read from the environment;
- `fzero._order_check`: what the ranks compare before a collective (`OrderCheck`, see
  its [Note: the order check]), agreed through the store by `Watch.agree`;
- `fzero._waits`: a watched wait and what ends or reports it (`Waits`, `Stuck`, see its
  [Note: numbered, watched collectives]), and `RankDisagreement`;
- `fzero._whereabouts`: who is where (the posts of every rank, the thread that answers);
- `fzero._process_hooks`: the exit, exception and SIGTERM hooks, undone by `close`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

from fzero import _whereabouts as whereabouts
from fzero._order_check import OUTSIDE, OrderCheck, entry_disagreement, next_disagreement
from fzero._process_hooks import ProcessHooks, die_of
from fzero._traffic import count, profiled
from fzero._waits import Collective, Failed, RankDisagreement, Stuck, TimedOut, Waits
from fzero._watch_settings import WatchSettings
from fzero._whereabouts import describe_peer, key, read_peers

__all__ = ["Watch", "Watched", "current", "forget", "replace_settings", "start_watch"]

log = logging.getLogger("fzero")

GOODBYE_S = 10.0  # at exit a rank waits at most this long for the others to leave too

# A rank deletes its post of an agreement this many agreements later: a rank of that
# agreement's group may still be about to read it (a subgroup's agreements interleave
# with another's; the previous one alone is not safe).
_KEPT_AGREEMENTS = 64


class Watch:
    """The collective watch of one default process group (see the module's text): its
    settings, the collectives and agreements issued, the order check's record (`order`),
    what this rank waits in (`waits`), the thread that answers the other ranks, and the
    hooks that post an uncaught exception, an exit or a SIGTERM (installed by `start`,
    removed by `close`)."""

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
        self.last: Collective | None = None  # the last collective issued, and when
        self.last_time = time.monotonic()
        self.posted = False  # this rank told the store it raised
        self.failing = False  # an uncaught exception ends the process
        self.leaving = ""  # how it ends, once known
        self.closed = False
        self.order = OrderCheck(self.agree_next)
        self.waits = Waits(self.store, self.rank, self.world, self.post_raised)
        self.stuck = Stuck(self.rank, self.world)  # `monitor`'s record of a stuck collective
        self.noticed: set[int] = set()  # ranks `notice` said left
        self.group_ranks: dict[Any, list[int]] = {}
        self.side_groups: dict[int, Any] = {}  # `fzero.comm.side_group`
        self.local = threading.local()  # `exempt` on a thread whose collectives are not checked
        self._responder: whereabouts.Responder | None = None
        self._hooks = ProcessHooks()  # undone by `close`
        self._terminating = threading.Lock()

    # ---- life ------------------------------------------------------------------------------

    def is_current(self) -> bool:
        """Whether the default process group is still the one this watch was made for."""
        return not self.closed and dist.is_initialized() and dist.group.WORLD is self.group

    def start(self, on_exit: Callable[[], None]) -> None:
        """Post this rank's keys, start the answering thread (several ranks) and install
        the hooks: `on_exit` at interpreter exit (before teardown), the except hook, and a
        SIGTERM handler where SIGTERM has none."""
        self._hooks.at_exit(on_exit)
        self._hooks.on_uncaught(self._uncaught)
        if self.world == 1:
            return
        for kind in ("watch", "raised", "left", "where"):
            self.store.set(key(kind, self.rank), "")
        self.store.set(key("proc", self.rank), f"{socket.gethostname()}|{os.getpid()}")
        wakeup = self._hooks.catch_sigterm(self.terminated)
        clone = getattr(self.store, "clone", None)
        self._responder = whereabouts.Responder(self, clone() if clone else self.store, wakeup)
        self._responder.start()

    def _uncaught(self, *info: Any) -> None:
        if self.is_current():
            self.failing = True
            self.leaving = f"an uncaught {info[0].__name__}: {info[1]}"
            with contextlib.suppress(Exception):
                self.post_raised(f"{OUTSIDE}: {info[0].__name__}: {info[1]}", final=True)

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
        die_of(signum)

    def close(self) -> None:
        """Stop the answering thread and remove the hooks (the group is being destroyed)."""
        if self.closed:
            return
        self.closed = True
        if self._responder is not None:
            self._responder.stop()
        self._hooks.undo()

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
        within = self.operation or self.order.within
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
        if self.checked and not self.order.paused:
            signature = (kind, tensor.numel(), what)
            self.order.check(signature, group, self.issued, self.operation, self.last_operation)
        if counted:
            count(kind, tensor, group)
        self.issued += 1
        if self.posted:
            self.withdraw()
        within = self.operation or self.order.within
        collective = Collective(self.issued, kind, tensor.numel(), what, within)
        self.last, self.last_time = collective, time.monotonic()
        if not self.sliced:
            return start(async_op)
        watched = Watched(self, start(True), collective)
        if async_op:
            return watched
        watched.wait()
        return None

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
            self.order.finish(self.issued)  # a run outside the operations ends here
            if self.world > 1 and (entry == "always" or (entry == "first" and first)):
                self._agree_entry(name)
            if track and self.checked:
                self.order.begin(track, name)
            yield
            self.order.finish(self.issued)
        except RankDisagreement:
            raise
        except BaseException as error:
            self.post_raised(f"{name}: {type(error).__name__}: {error}")
            raise
        finally:
            self.operation = ""
            self.order.track = None

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        self.order.paused += 1
        try:
            yield
        finally:
            self.order.paused -= 1

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
        collective = Collective(
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
                    raise TimedOut()
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
            self._disagree(within, next_disagreement(within, every))

    def _agree_entry(self, name: str) -> None:
        every = self.agree(f"the entry of {name}", name, range(self.world))
        if any(value != name for value in every.values()):
            self._disagree(name, entry_disagreement(every))

    def _disagree(self, within: str, message: str) -> NoReturn:
        self.post_raised(f"{within}: RankDisagreement: {message}", final=True)
        raise RankDisagreement(message)

    def _wait(self, collective: Collective, poll: Callable[[float], bool], every: float) -> None:
        """Wait until `poll(seconds)` is true, watched (`fzero._waits.Waits.wait`)."""
        self.waits.wait(collective, poll, every, self.settings, self.last_time)

    # ---- answers (the thread of `_whereabouts.Responder`) ------------------------------------

    def _doing(self, frame: FrameType | None) -> str:
        waiting = self.waits.waiting
        if waiting is not None:
            seconds = time.monotonic() - self.waits.waiting_since
            return f"waiting in {waiting.describe()} for {seconds:.1f} s"
        return whereabouts.whereabouts(frame).text

    def answer(self, frame: FrameType | None) -> dict[str, Any]:
        """Where this rank is, for the others (a JSON object)."""
        waiting = self.waits.waiting
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
        if self.waits.waiting is not None or not any(v.left for v in views.values()):
            return
        place = whereabouts.whereabouts(frame)
        for r, v in sorted(views.items()):
            if v.left and r not in self.noticed and place.call and r in (place.ranks or ()):
                self.noticed.add(r)
                log.warning("fzero: %s; rank %d is %s", describe_peer(v), self.rank, place.text)

    def monitor(self, store: Any) -> None:
        """Where waits are not sliced (NCCL, `FZERO_WATCH_S=0`): report a collective of
        this rank stuck in flight (`fzero._waits.Stuck.check`)."""
        self.stuck.check(store, self.settings.report_s, self.last, self.last_time, self.issued)


class Watched:
    """A collective in flight (torch's `Work`) whose `wait` asks the other ranks where
    they are when it takes longer than a slice, and raises `RankDisagreement` when they
    are somewhere it can never complete."""

    def __init__(self, watch: Watch, work: Any, collective: Collective) -> None:
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
                raise (TimedOut() if "timed out" in text else Failed()) from error

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
