"""The order check of the collective watch (`fzero._watch`): what the ranks compare
before a collective, so that no collective pairs with a different one.

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

`OrderCheck` is the record (each segment's last run, which segment followed which, the
segment running now); the agreement itself is the watch's, given to it as `agree_next`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OUTSIDE", "OrderCheck", "Signature", "Track", "entry_disagreement", "next_disagreement"]

OUTSIDE = "outside fzero's operations"

Signature = tuple[str, int, str]
"""A collective as the check compares it: its kind, its number of elements, what it is."""


@dataclass(eq=False)
class Track:
    """One segment's collectives (`key`), against its last run's (see the note above)."""

    key: str
    name: str
    expected: tuple[Signature, ...] | None
    outside: bool = False
    done: list[Signature] = field(default_factory=list)
    seen: set[Signature] = field(default_factory=set)  # outside: what it issued


class OrderCheck:
    """The order check's record for one watch: each segment's collectives the last time
    its key ran (`tracks`), which segment followed which (`successor`), the key of the
    last segment that issued a collective (`previous`) and the segment running now
    (`track`). `agree_next(mine, within, group)` is the watch's agreement of what comes
    next (it raises where the ranks differ)."""

    def __init__(self, agree_next: Callable[[str, str, Any], None]) -> None:
        self.agree_next = agree_next
        self.tracks: dict[str, tuple[Signature, ...]] = {}
        self.successor: dict[str, str] = {}
        self.previous = ""  # the key of the last segment that issued a collective
        self.track: Track | None = None
        self.paused = 0  # inside `unchecked()`

    @property
    def within(self) -> str:
        """The name of the segment running now ("" if none)."""
        return self.track.name if self.track is not None else ""

    def check(
        self, signature: Signature, group: Any, issued: int, operation: str, last_operation: str
    ) -> None:
        """Before issuing a collective (`issued` so far, within the named `operation`, ""
        outside them; `last_operation` the last one entered): the same as last time
        here, or agreed."""
        track = self.track
        if track is None:
            if operation:  # a named operation that is not checked (`track=""`)
                return
            track = self.track = self._outside(last_operation)
        if track.outside:  # a run outside the operations ends where it comes back to a
            if signature in track.seen:  # collective it issued (the next forward of a
                self.end(track, issued)  # `generate` loop): runs stay bounded
                track = self.track = self._outside(last_operation)
            track.seen.add(signature)
        self._next(track, signature, group, issued)

    def _outside(self, last_operation: str) -> Track:
        """A segment of collectives outside every named operation, keyed by the last
        segment before it that was not one (and the gradient mode)."""
        previous = self.previous
        if previous.startswith(OUTSIDE):
            after = previous.split("|after ", 1)[1]
        else:
            after = previous.split("|")[0] or "the start of the program"
        key = f"{OUTSIDE}|grad={torch.is_grad_enabled()}|after {after}"
        return Track(key, f"{OUTSIDE} (after {last_operation or 'the start'})",
                     self.tracks.get(key), outside=True)  # fmt: skip

    def _next(self, track: Track, signature: Signature, group: Any, issued: int) -> None:
        """Before issuing a collective in `track`: the same as last time here, or agreed."""
        at = len(track.done)
        track.done.append(signature)
        expected = track.expected
        if at == 0:  # keys, not names, are compared (`join` serves another's operation)
            follows = self.successor.get(self.previous) == track.key
            self.successor[self.previous] = track.key
            previous, self.previous = self.previous, track.key
            if follows and expected and expected[0] == signature:
                return
            mine = f"{_signature(signature)} as collective #{issued + 1}, the first of "
            mine += f"{_readable(track.key)} after {_readable(previous)}"
            self.agree_next(mine, track.name, group)
            return
        if expected is not None and at < len(expected) and expected[at] == signature:
            return
        mine = f"{_signature(signature)} as collective #{issued + 1}"
        self.agree_next(mine, track.name, group)

    def end(self, track: Track, issued: int) -> None:
        """Segment `track` ended: where it ran fewer collectives than last time, or for
        the first time, the ranks agree it ended here; then this run is the next one's.
        (Agreements carry the collectives issued so far: a rank that issued more without
        waiting on them cannot agree with one that did not.)"""
        expected, done = track.expected, len(track.done)
        if (expected is None and done > 0) or (expected is not None and done < len(expected)):
            text = f"the end of {_readable(track.key)} after {done} collective(s), "
            text += f"#{issued} so far"
            self.agree_next(text, track.name, None)
        self.tracks[track.key] = tuple(track.done)

    def finish(self, issued: int) -> None:
        """The segment running now, if any, ends here (a named operation starts, which
        ends a run outside the operations; or one ends)."""
        if self.track is not None:
            track, self.track = self.track, None
            self.end(track, issued)

    def begin(self, key: str, name: str) -> None:
        """The checked named operation `name` starts a segment of key `key`."""
        self.track = Track(key, name, self.tracks.get(key))


def _readable(key: str) -> str:
    """A segment's key for people: "backward of Net (grad=True, False)"."""
    base, *flags = key.split("|")
    return f"{base} ({', '.join(flags)})" if flags else base or "the start of the program"


def _signature(signature: Signature) -> str:
    kind, numel, what = signature
    return f"{kind} of {numel:,} elements" + (f" ({what})" if what else "")


def next_disagreement(within: str, every: Mapping[int, str]) -> str:
    """The error when the ranks said different things about what comes next in `within`
    (`every`: each rank's)."""
    doing = "; ".join(f"rank {r}: {value}" for r, value in sorted(every.items()))
    return (
        f"fzero: the ranks are about to issue different collectives in {within} "
        f"({doing}). A rank took another path: at ZeRO stage 3 a module one rank "
        "skipped (a branch, an unused expert) or a different number of forwards; "
        "otherwise a skipped backward or step, or a different number of batches. "
        "Every rank must run the same fzero operations and stage-3 modules in the "
        "same order (put a module some ranks skip in a unit with one every rank runs, "
        "e.g. deepspeed.utils.set_z3_leaf_modules; uneven data: engine.join())"
    )


def entry_disagreement(every: Mapping[int, str]) -> str:
    """The error when the ranks entered different named operations (`every`: each
    rank's)."""
    doing = "; ".join(f"rank {r}: {value}" for r, value in sorted(every.items()))
    return (
        f"fzero: the ranks entered different operations ({doing}); every rank must "
        "call fzero's collective operations (state_dict, checkpoints, evaluation at "
        "stage 3) in the same order"
    )
