"""Collectives that say what they are, and ranks that disagree named within seconds
(`fzero.comm` re-exports what a caller uses: `named_operation`, `RankDisagreement`,
`Watched`, `watch_collectives`; `issue` starts each of comm's collectives)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fzero._traffic import count, profiled

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WATCH_S",
    "RankDisagreement",
    "Watched",
    "agree",
    "exempt_thread",
    "issue",
    "named_operation",
    "post_raised",
    "unchecked",
    "watch_collectives",
]

DEFAULT_TIMEOUT_S = 600.0


# ---- a rank that does not arrive is named --------------------------------------------------

_LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
_ARRIVAL_WAIT_S = 10.0
_named_now: list[str] = []  # the named operation running now (outermost), if any


@contextlib.contextmanager
def named_operation(name: str, track: str | None = None) -> Iterator[None]:
    """Run fzero operation `name` (its collectives). When one times out or loses a peer,
    the ranks that got here meet in the process group's store and the error names the
    ranks that never arrived, and what each rank that did was doing. An exception raised
    inside on this rank is told to the other ranks, which end their waits with it (see
    `Watched`). Inside another named operation the outer name is the one given
    (`engine.state_dict` runs `fzero.state_dict`).

    Its collectives are checked against the ones this rank issued the last time an
    operation of key `track` ran (default: `name` up to its first parenthesis, and
    whether gradients are on): see `_Track`. `track=""`: not checked (a rank serving
    the others' collectives from another operation, as `join` does)."""
    if _named_now:
        yield
        return
    _named_now.append(name)
    _withdraw_raised()
    if track is None:
        track = f"{name.split(' (')[0]}|grad={torch.is_grad_enabled()}"
    _tracking[:] = [_Track(track, _tracks.get(track))] if track and _checked() else []
    try:
        yield
        if _tracking:
            _tracking[0].end()
    except RankDisagreement:
        raise
    except BaseException as error:
        post_raised(f"{name}: {type(error).__name__}: {error}")
        text = str(error).lower()
        if not isinstance(error, RuntimeError) or not dist.is_initialized():
            raise
        if not any(s in text for s in _LOST_PEER):
            raise
        raise RuntimeError(f"fzero {name}: {_missing_ranks(name)}") from error
    finally:
        _named_now.pop()
        _tracking.clear()


def _missing_ranks(name: str) -> str:
    """Who is not here: each rank that got an error writes its operation to the store,
    then waits (up to the collective timeout, at most 10 s) for the others."""
    store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
    world, rank = dist.get_world_size(), dist.get_rank()
    if store is None:
        return "a collective failed; the other ranks could not be asked where they are"
    wait = min(float(os.environ.get("FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S)), _ARRIVAL_WAIT_S)
    try:
        store.set(f"fzero/lost/{rank}", name)
        keys = [f"fzero/lost/{r}" for r in range(world)]
        deadline = time.monotonic() + wait
        here = [r for r in range(world) if store.check([keys[r]])]
        while len(here) < world and time.monotonic() < deadline:
            time.sleep(0.1)
            here = [r for r in range(world) if store.check([keys[r]])]
        doing = "; ".join(f"rank {r}: {store.get(keys[r]).decode()}" for r in here)
    except Exception as error:  # the store itself is gone (its host rank died)
        return f"a collective failed, and the store could not be reached to ask why ({error})"
    missing = [r for r in range(world) if r not in here]
    if not missing:
        return f"a collective failed on every rank ({doing})"
    return (
        f"rank(s) {missing} did not arrive in this collective (they are elsewhere: in user "
        f"code, a data loader, another engine's call, or dead); ranks that did: {doing}"
    )


# ---- ranks that disagree are named within seconds ------------------------------------------
#
# Every collective fzero issues on the default group is numbered (the same count on every
# rank when the ranks agree) and described (`what`, and the named operation it runs in).
# Its wait is sliced: while it has not completed after `FZERO_WATCH_S` seconds (default
# 1), this rank writes where it waits to the process group's store and reads where the
# others are. A rank that raised inside a named operation (or died of an uncaught
# exception) is named at once; ranks that wait in different collectives twice in a row
# (a branch one rank skipped, a different number of batches) end with one
# `RankDisagreement` naming what each rank waits in. A rank that is not in any fzero
# collective (in user code, a data loader) is waited for up to the collective timeout, as
# before. A wait that never lasts a slice costs nothing but the count; gloo only (NCCL's
# waits return before the collective ends; its watchdog covers it).

DEFAULT_WATCH_S = 1.0


class RankDisagreement(RuntimeError):
    """The ranks are in different collectives, or another rank raised: the step cannot
    complete. The message names what each rank was doing."""


@dataclass(frozen=True)
class _Collective:
    seq: int
    kind: str
    numel: int
    what: str
    within: str

    def describe(self) -> str:
        text = f"collective #{self.seq} {self.kind} of {self.numel:,} elements"
        if self.kind == "agreement":  # through the store, among `numel` ranks
            text = f"an agreement of {self.numel} ranks after collective #{self.seq}"
        text += f" ({self.what})" if self.what else ""
        return text + (f" in {self.within}" if self.within else "")


_issued = [0]  # collectives issued on the default group, watched or not
_watch: list[Any] = [None, None]  # [the default group it was decided for, seconds or None]


def watch_collectives(seconds: float | None) -> None:
    """Set how long a collective waits before asking the other ranks where they are
    (`FZERO_WATCH_S`); None or 0: never ask (a hang waits for the collective timeout)."""
    _watch[:] = [dist.group.WORLD, None]
    if seconds and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        _watch[1] = float(seconds)


def _watch_slice() -> float | None:
    """Seconds a collective waits before asking the others, or None (not watched: one
    rank, NCCL, `FZERO_WATCH_S=0`)."""
    group = dist.group.WORLD
    if _watch[0] is not group:
        seconds = float(os.environ.get("FZERO_WATCH_S", DEFAULT_WATCH_S))
        watched = dist.get_world_size() > 1 and dist.get_backend() == "gloo" and seconds > 0
        _watch[:] = [group, seconds if watched else None]
    return _watch[1]


def issue(
    kind: str,
    tensor: torch.Tensor,
    what: str,
    async_op: bool,
    start: Callable[[bool], Any],
    group: Any = None,
) -> Any:
    """Start one collective (`start(async_op)`), counted, and watched where gloo runs
    (every process issues the same sequence, a subgroup's included: one count); timed
    while a comms logger is on (`fzero._traffic.profiled`)."""
    within = _named_now[0] if _named_now else ""
    run = functools.partial(_issue, kind, tensor, what, start=start, group=group)
    return profiled(kind, tensor, group, what, within, run, async_op)


def _issue(
    kind: str,
    tensor: torch.Tensor,
    what: str,
    async_op: bool,
    *,
    start: Callable[[bool], Any],
    group: Any,
) -> Any:
    if _tracking:
        _tracking[0].next(kind, tensor.numel(), what, group)
    count(kind, tensor, group)
    seconds = _watch_slice()
    _issued[0] += 1
    if _posted:
        _withdraw_raised()
    if seconds is None:
        return start(async_op)
    within = _named_now[0] if _named_now else ""
    collective = _Collective(_issued[0], kind, tensor.numel(), what, within)
    watched = Watched(start(True), collective, seconds)
    if async_op:
        return watched
    watched.wait()
    return None


class Watched:
    """A collective in flight (torch's `Work`) whose `wait` asks the other ranks where
    they are when it takes longer than a slice, and raises `RankDisagreement` when they
    are somewhere it can never complete."""

    def __init__(self, work: Any, collective: _Collective, seconds: float) -> None:
        self.work, self.collective, self.seconds = work, collective, seconds
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
        seen: dict[int, str] | None = None
        try:
            while True:
                try:
                    self.work.wait(timeout=datetime.timedelta(seconds=self.seconds))
                    break
                except RuntimeError as error:
                    if self.work.is_completed() or "timed out" not in str(error).lower():
                        _raise_if_another_raised(self.collective.describe())
                        raise
                seen = _ask_peers(self.collective, seen)
        finally:
            if seen is not None:  # this rank said where it waits: no longer
                _set_status("done")
        self._done = True
        return True


def _store() -> Any:
    return getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()


def _set_status(status: str) -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"fzero/watch/{dist.get_rank()}", status)


def _read(store: Any, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def _ask_peers(collective: _Collective, seen: dict[int, str] | None) -> dict[int, str]:
    """Say where this rank waits; raise if another rank said it raised, or ranks wait
    in different collectives, now and at the previous ask (`seen`: a rank that caught
    its exception and went on withdraws it at its next collective). Returns what was
    seen: rank -> where it waits, -1 - rank -> what it raised."""
    store = _store()
    if store is None:
        return {}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = collective.describe()
    here = f"{'a' if collective.kind == 'agreement' else 'c'}{collective.seq}"
    try:
        store.set(f"fzero/watch/{rank}", f"waiting|{here}|{mine}")
        raised = {r: _read(store, f"fzero/raised/{r}") for r in range(world) if r != rank}
        places = {r: _read(store, f"fzero/watch/{r}") for r in range(world) if r != rank}
    except Exception:  # the store is gone (its host rank died): the timeout will tell
        return seen or {}
    raised = {r: text for r, text in raised.items() if text}
    for r, text in sorted(raised.items()):  # still so at the previous ask: not a rank
        if seen is not None and seen.get(-1 - r) == text:  # that caught its exception
            raise RankDisagreement(_raised_message(r, text, rank, mine))
    elsewhere = {
        r: p.split("|", 2)[2]
        for r, p in places.items()
        if p.startswith("waiting|")
        and p != f"waiting|{here}|{mine}"
        and not _may_complete(here, p.split("|", 2)[1])
    }
    if elsewhere and seen is not None and all(seen.get(r) == p for r, p in elsewhere.items()):
        doing = {rank: mine, **elsewhere}
        lines = "; ".join(f"rank {r} waits in {doing[r]}" for r in sorted(doing))
        message = (
            f"fzero: the ranks are in different collectives and none can complete: {lines}. "
            "A rank took another path (a branch or module skipped, an unused expert, a "
            "different number of batches or forwards); every rank must run the same "
            "fzero operations in the same order"
        )
        post_raised(f"{collective.within or mine}: RankDisagreement: {message}")  # the
        raise RankDisagreement(message)  # others end with it, whoever saw it first
    return {**elsewhere, **{-1 - r: text for r, text in raised.items()}}


def _may_complete(mine: str, other: str) -> bool:
    """Whether two ranks waiting at `mine` and `other` ("c<seq>": in collective #seq,
    "a<seq>": in an agreement after collective #seq) may both go on: a rank in an
    agreement has issued every collective up to its seq, so one waiting in such a
    collective finishes it (and two in an agreement after the same one wait for a third)."""
    if "a" not in (mine[0], other[0]):
        return False  # two collectives: only the same one completes
    if mine[0] == other[0]:
        return mine == other
    agreement, waiting = (mine, other) if mine[0] == "a" else (other, mine)
    return int(waiting[1:]) <= int(agreement[1:])


_posted: list[bool] = []  # this rank has told the store it raised


def _raised_message(other: int, text: str, rank: int, doing: str) -> str:
    return f"fzero: rank {other} raised in {text}; rank {rank} was waiting in {doing}"


def _raise_if_another_raised(doing: str) -> None:
    """A collective failed (a peer is gone): if another rank said it raised, that is the
    error to give (it may have ended its process group since)."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    rank = dist.get_rank()
    for r in range(dist.get_world_size()):
        if r == rank:
            continue
        try:
            text = _read(store, f"fzero/raised/{r}")
        except Exception:
            return
        if text:
            raise RankDisagreement(_raised_message(r, text, rank, doing))


def post_raised(text: str) -> None:
    """Tell the other ranks this one raised (their waits end with it)."""
    store = _store() if dist.is_initialized() and dist.get_world_size() > 1 else None
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"fzero/raised/{dist.get_rank()}", text[:2000])
        _posted.append(True)


def _withdraw_raised() -> None:
    """A new named operation on a rank that raised before (and was caught): the old
    exception no longer stops the others."""
    if _posted:
        _posted.clear()
        store = _store()
        with contextlib.suppress(Exception):
            store.delete_key(f"fzero/raised/{dist.get_rank()}")


_agreed = [0]  # agreements this process took part in (their store keys carry the count)


def agree(what: str, value: str, ranks: Sequence[int]) -> dict[int, str]:
    """Every rank of `ranks` posts `value` and gets every rank's, through the process
    group's store: no collective, so a rank that is elsewhere cannot pair it with another
    one. A rank that has not posted within a watch slice is asked where it is, as a slow
    collective's peers are (`Watched`): one waiting in a collective at two asks, or one
    that raised, ends the wait with `RankDisagreement` on every rank."""
    store = _store()
    rank = dist.get_rank()
    _agreed[0] += 1
    keys = {r: f"fzero/agree/{_agreed[0]}/{r}" for r in ranks}
    store.set(keys[rank], value)
    within = _named_now[0] if _named_now else ""
    collective = _Collective(_issued[0], "agreement", len(ranks), what, within)
    seconds, seen = _watch_slice() or 1.0, None
    timeout = float(os.environ.get("FZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    deadline, limit = time.monotonic() + seconds, time.monotonic() + timeout
    posts, pause = list(keys.values()), 5e-5
    try:  # polled, the pause doubling to 5 ms (the store's own wait logs each timeout)
        while not store.check(posts):
            if time.monotonic() > deadline:  # a rank is elsewhere: ask where
                if time.monotonic() > limit:  # as a collective's timeout
                    missing = [r for r, key in keys.items() if not store.check([key])]
                    raise RankDisagreement(
                        f"fzero {within or what}: rank(s) {missing} did not arrive in "
                        f"{collective.describe()} within the collective timeout (they are "
                        "elsewhere: in user code, a data loader, another engine's call, or "
                        "dead)"
                    )
                seen, deadline = _ask_peers(collective, seen), time.monotonic() + seconds
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
    finally:
        if seen is not None:
            _set_status("done")
    values = dict(zip(keys, (v.decode() for v in store.multi_get(posts))))
    if _agreed[0] > _KEPT_AGREEMENTS:  # the ranks that read this rank's older posts have
        with contextlib.suppress(Exception):  # posted (and so read) many since
            store.delete_key(f"fzero/agree/{_agreed[0] - _KEPT_AGREEMENTS}/{rank}")
    return values


# A rank deletes its post of an agreement this many agreements later: a rank of that
# agreement's group may still be about to read it (a subgroup's agreements interleave
# with another's; the previous one alone is not safe).
_KEPT_AGREEMENTS = 64


# ---- every rank issues the collective the others issue --------------------------------------
#
# gloo and NCCL pair collectives by order: a stage-3 module one rank skips pairs its
# neighbours' all-gathers with the wrong units (silently, for units of one size) or
# aborts the process inside gloo (sizes differ). So inside a named operation each
# collective is compared with the one this rank issued at the same place the last time
# an operation of the same key ran. Where it is the same it is issued at once (the
# steady state: a tuple compare). Where it is not, where the key runs for the first
# time, or where the operation ends earlier than last time (or after its first run),
# the ranks first agree through the store what comes next (`agree`, no collective): a
# rank that differs gets the others' answers, a rank that still follows its last run
# waits in the collective meanwhile and the watch names both. By induction a collective
# issued without agreeing is the one every other rank issues there: the ranks raise
# `RankDisagreement` naming what each was about to do instead of pairing the wrong
# collectives. `FZERO_CHECK_COLLECTIVES=0` turns the check off.

CHECK_COLLECTIVES = "FZERO_CHECK_COLLECTIVES"


@dataclass
class _Track:
    """The collectives of one run of a named operation (`key`), against the last run's."""

    key: str
    expected: tuple[tuple[str, int, str], ...] | None
    done: list[tuple[str, int, str]] = field(default_factory=list)

    def next(self, kind: str, numel: int, what: str, group: Any) -> None:
        """Before issuing a collective: the same as last time here, or agreed (also from
        autograd's device threads, which run a CUDA backward; not from a thread that
        `exempt_thread` marked, as a background checkpoint writer)."""
        if getattr(_thread, "exempt", False):
            return
        at, signature = len(self.done), (kind, numel, what)
        self.done.append(signature)
        if self.expected is not None and at < len(self.expected) and self.expected[at] == signature:
            return
        mine = f"{kind} of {numel:,} elements" + (f" ({what})" if what else "")
        self._agree(f"{mine} as collective #{_issued[0] + 1}", group)

    def end(self) -> None:
        """The operation returned: where it ran fewer collectives than last time, or for
        the first time, the ranks agree it ended here; then this run is the next one's.
        (Agreements carry the collectives issued so far: a rank that issued more without
        waiting on them cannot agree with one that did not.)"""
        expected, done = self.expected, len(self.done)
        first = expected is None and done > 0
        if first or (expected is not None and done < len(expected)):
            text = f"the end of the operation after {done} collective(s), #{_issued[0]} so far"
            self._agree(text, None)
        _tracks[self.key] = tuple(self.done)

    def _agree(self, mine: str, group: Any) -> None:
        ranks = _ranks_of(group)
        within = _named_now[0] if _named_now else self.key
        every = agree(f"what comes next in {within}: {mine}", mine, ranks)
        if any(value != mine for value in every.values()):
            doing = "; ".join(f"rank {r}: {value}" for r, value in sorted(every.items()))
            message = (
                f"fzero: the ranks are about to issue different collectives in {within} "
                f"({doing}). A rank took another path: at ZeRO stage 3 a module one rank "
                "skipped (a branch, an unused expert) or a different number of forwards; "
                "otherwise a different number of batches. Every rank must run the same "
                "fzero operations and stage-3 modules in the same order (put a module some "
                "ranks skip in a unit with one every rank runs, e.g. "
                "deepspeed.utils.set_z3_leaf_modules; uneven data: engine.join())"
            )
            post_raised(f"{within}: RankDisagreement: {message}")
            raise RankDisagreement(message)


_thread = threading.local()


def exempt_thread() -> None:
    """The calling thread's collectives are never checked (a background thread that runs
    beside the operations of the main one, as an asynchronous checkpoint writer)."""
    _thread.exempt = True


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Collectives inside are not checked against the operation's others: for one that
    ranks issue from different operations at the same place by construction (`join`'s
    flag: inside a forward on a rank that trains, between the served steps on one out
    of data)."""
    saved = _tracking[:]
    _tracking.clear()
    try:
        yield
    finally:
        _tracking[:] = saved


_tracks: dict[str, tuple[tuple[str, int, str], ...]] = {}  # key -> its last run's collectives
_tracking: list[_Track] = []  # the run of the outermost named operation now, if checked
_checking: list[Any] = [None, False]  # [the default group it was decided for, checked]
_group_ranks: dict[Any, list[int]] = {}


def _checked() -> bool:
    """Whether collectives are checked: several ranks, `FZERO_CHECK_COLLECTIVES` not 0."""
    if not dist.is_initialized():
        return False
    group = dist.group.WORLD
    if _checking[0] is not group:
        on = os.environ.get(CHECK_COLLECTIVES, "1") not in ("0", "")
        _checking[:] = [group, on and dist.get_world_size() > 1]
        _tracks.clear()
        _group_ranks.clear()
    return bool(_checking[1])


def _ranks_of(group: Any) -> list[int]:
    if group not in _group_ranks:
        every = range(dist.get_world_size())
        _group_ranks[group] = list(every if group is None else dist.get_process_group_ranks(group))
    return _group_ranks[group]


def forget() -> None:
    """Start over as in a new process, the process groups being destroyed
    (`comm.forget_process_groups`): no named operation, collective or agreement counted,
    no track, no post."""
    _named_now.clear()
    _issued[0] = _agreed[0] = 0
    _watch[:] = [None, None]
    _posted.clear()
    _tracks.clear()
    _tracking.clear()
    _checking[:] = [None, False]
    _group_ranks.clear()
