"""Waiting in a watched collective or agreement (`fzero._watch`), and what ends it or
reports it: the rules that say the ranks can never meet, the errors of a timeout or a
failed collective, who-is-where reports, and, where waits are not sliced, the report of
a collective stuck in flight.

[Note: numbered, watched collectives]
Every collective fzero issues on its groups is numbered (the same count on every rank
while the ranks agree) and described (`what`, and the named operation it runs in). On
gloo its wait is sliced: while it has not completed after `slice_s` seconds, this rank
writes where it waits to the process group's store and reads where the others are
(`_whereabouts.read_peers`). A rank that raised, left the program, or whose process is
gone is named at once; ranks that wait in different collectives twice in a row, or a
rank that sits in its own `torch.distributed` collective while this one waits for it,
end with one `RankDisagreement` naming each (`never_meet`). A wait longer than
`report_s` (30 s) prints who is where, and again after twice as long, and so on; the
timeout's error carries the same picture. A wait that never lasts a slice costs nothing
but the count. NCCL's waits return before the collective ends: there the answering
thread watches this rank's collectives' progress instead (`Stuck`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fzero import _whereabouts as whereabouts
from fzero._watch_settings import WatchSettings
from fzero._whereabouts import PeerView, describe_peer, key, read_peers

__all__ = [
    "Asked",
    "Collective",
    "Failed",
    "RankDisagreement",
    "Stuck",
    "TimedOut",
    "Waits",
    "may_complete",
    "never_meet",
    "remember",
]

log = logging.getLogger("fzero")

FAILED_LOOK_S = 1.0  # a failed collective looks this long for the peer that ended it


class RankDisagreement(RuntimeError):
    """The ranks are in different collectives, another rank raised or left, or a rank
    waits in a call the others never make: the step cannot complete. The message names
    what each rank was doing."""


@dataclass(frozen=True)
class Collective:
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


def may_complete(mine: str, other: str) -> bool:
    """Whether two ranks waiting at `mine` and `other` (`Collective.at`) may both go on:
    a rank in an agreement has issued every collective up to its seq, so one waiting in
    such a collective finishes it (and two in the same agreement wait for a third)."""
    if "a" not in (mine[0], other[0]):
        return False  # two collectives: only the same one completes
    if mine[0] == other[0]:
        return mine == other
    agreement, waiting = (mine, other) if mine[0] == "a" else (other, mine)
    return int(waiting[1:]) <= int(agreement[1:].split(".")[0])


class TimedOut(Exception):
    """Raised by a wait's `poll` at the collective timeout."""


class Failed(Exception):
    """Raised by a wait's `poll` when the collective failed (a peer is gone)."""


class Asked:
    """What one look at the other ranks saw (the next look compares with it)."""

    def __init__(self, views: Mapping[int, PeerView], places: Mapping[int, str]) -> None:
        self.views, self.places = views, places


# ---- a wait -----------------------------------------------------------------------------------


class Waits:
    """This rank's watched waits on its process group's `store`: what it waits in now
    (`waiting`, since `waiting_since`), the sliced wait, its looks at the other ranks and
    the errors that end it. `post_raised(text, final)` is the watch's: a wait that ends
    in an error tells the other ranks with it."""

    def __init__(
        self, store: Any, rank: int, world: int, post_raised: Callable[[str, bool], None]
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.post_raised = post_raised
        self.waiting: Collective | None = None  # what the main thread waits in now
        self.waiting_since = 0.0

    def wait(
        self,
        collective: Collective,
        poll: Callable[[float], bool],
        every: float,
        settings: WatchSettings,
        last_time: float,
    ) -> None:
        """Wait until `poll(seconds)` is true, looking at the other ranks after each
        `every` seconds (`_look`), reporting after `settings.report_s` and twice as long
        each time after; `poll` raises `TimedOut` at the collective timeout, `Failed` when
        the collective failed (a peer is gone): both become errors that say who is where
        (`last_time`: when this rank issued its last collective)."""
        asked: Asked | None = None
        start = time.monotonic()
        report = settings.report_s
        try:
            while not poll(every):
                if asked is None:
                    self.waiting, self.waiting_since = collective, start
                waited = time.monotonic() - start
                asked = self._look(collective, asked, waited)
                if report and waited >= report:
                    self._report(collective, asked, waited)
                    report *= 2
        except (TimedOut, Failed) as stopped:
            cause = stopped.__cause__
            if isinstance(stopped, TimedOut):
                error = self._timed_out(collective, start, cause, settings.timeout_s)
            else:
                error = self._failed(collective, cause, last_time)
            self.post_raised(f"{collective.within or collective.describe()}: {error}", True)
            raise error from cause
        finally:
            if asked is not None:  # this rank said where it waits: no longer
                self.waiting = None
                with contextlib.suppress(Exception):
                    self.store.set(key("watch", self.rank), "done")

    def _look(self, collective: Collective, asked: Asked | None, waited: float) -> Asked:
        """Say where this rank waits and read where the others are; raise when they can
        never meet (see the note above). The raise is posted, so the others end with it."""
        mine = collective.describe()
        try:
            self.store.set(key("watch", self.rank), f"waiting|{collective.at}|{mine}|{waited:.0f}")
            self.store.add(whereabouts.NEWS, 1)
            views = read_peers(self.store, self.rank, self.world)
        except Exception as error:  # the store's host is gone
            if collective.kind == "agreement":  # nothing else can end this wait
                raise RankDisagreement(self.store_lost(mine, error)) from error
            return asked or Asked({}, {})  # the collective's own error will tell
        message = never_meet(self.rank, collective, asked, views)
        if message:
            self.post_raised(f"{collective.within or mine}: RankDisagreement: {message}", True)
            raise RankDisagreement(message)
        return remember(self.rank, views, asked)

    def _picture(self, collective: Collective, views: Mapping[int, PeerView], waited: float) -> str:
        lines = [f"rank {self.rank} waits in {collective.describe()} (for {waited:.0f} s)"]
        lines += [describe_peer(v) for _, v in sorted(views.items())]
        return "; ".join(lines)

    def _report(self, collective: Collective, asked: Asked, waited: float) -> None:
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
        self, collective: Collective, start: float, error: BaseException | None, timeout_s: float
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
            f"within the collective timeout ({timeout_s:g} s; they are "
            "elsewhere: in user code, a data loader, another engine's call, or dead). Who is "
            f"where: {self._picture(collective, views, waited)}"
            + (f" ({error})" if error is not None else "")
        )

    def _failed(
        self, collective: Collective, error: BaseException | None, last_time: float
    ) -> BaseException:
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
                self.store_lost(collective.describe(), views)
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
            f"{self._picture(collective, views, time.monotonic() - last_time)}"
        )

    def store_lost(self, mine: str, error: BaseException | None) -> str:
        """The error when the store cannot be reached while this rank waits in `mine`."""
        return (
            f"fzero: the process group's store cannot be reached ({error}): the process that "
            "hosts it (rank 0, unless a launcher's agent does) is gone; rank "
            f"{self.rank} waits in {mine}"
        )


# ---- the rules that end a wait --------------------------------------------------------------


def remember(rank: int, views: Mapping[int, PeerView], asked: Asked | None) -> Asked:
    """What the next look of rank `rank` compares with (`never_meet`): where each rank
    waits, what it raised, and how many answers in a row put it in its own collective
    that needs this rank."""
    places = {r: v.place for r, v in views.items() if v.waiting is not None}
    places.update({-1 - r: v.raised for r, v in views.items() if v.raised})
    for r, v in views.items():  # in its own collective that needs this rank: how many
        answer = v.answer or {}  # answers in a row said so (`never_meet`)
        if answer.get("call") and rank in (answer.get("ranks") or ()):
            before = asked.places.get(-1000 - r, "||") if asked else "||"
            number, times, where = before.split("|", 2)
            if where != answer["where"]:
                times = "0"
            if number != str(answer["n"]):
                times = str(int(times or 0) + 1)
            places[-1000 - r] = f"{answer['n']}|{times}|{answer['where']}"
    return Asked(views, places)


def never_meet(
    rank: int, collective: Collective, asked: Asked | None, views: Mapping[int, PeerView]
) -> str:
    """Why the wait of rank `rank` in `collective` can never end, or "" (see the note
    above): `views` what the others posted now, `asked` what the previous look saw."""
    mine, here = collective.describe(), collective.at
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
        if v.waiting is not None and v.waiting[0] != here and not may_complete(here, v.waiting[0])
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


# ---- where waits are not sliced ---------------------------------------------------------------


class Stuck:
    """Where waits are not sliced (NCCL, `FZERO_WATCH_S=0`), the answering thread's check
    of this rank's collectives in flight: the stuck one it last reported (`since`: the
    collective, since when, and the wait that reports it next)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.since: list[Any] | None = None

    def check(
        self, store: Any, report_s: float, last: Collective | None, last_time: float, issued: int
    ) -> None:
        """A collective of this rank (`issued` so far, the last one `last`, issued at
        `last_time`) that has not completed after `report_s` (torch's flight recorder
        where it records, else: this rank's last collective issued that long ago while
        another rank has issued fewer, through the store) prints who is where, then after
        twice as long."""
        if not report_s or last is None:
            return
        pending = _flight_recorder_pending()
        if pending is None:  # no record: compare collective counts through the store
            store.set(key("issued", self.rank), str(issued))
            counts = {}
            for r in range(self.world):
                if r != self.rank and store.check([key("issued", r)]):
                    counts[r] = int(store.get(key("issued", r)).decode())
            pending = bool(counts) and min(counts.values()) < issued
        if not pending:
            self.since = None
            return
        since = self.since
        if since is None or since[0] is not last:
            self.since = since = [last, last_time, report_s]
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
