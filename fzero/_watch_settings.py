"""The settings of the collective watch (`fzero._watch`): how long a collective may take,
when a wait asks the other ranks where they are and prints who is where, and whether the
order of collectives is checked. Read once, from the environment, when fzero starts or
adopts the default process group (`WatchSettings.from_environment`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CHECK_COLLECTIVES",
    "DEFAULT_REPORT_S",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WATCH_S",
    "WatchSettings",
]

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_WATCH_S = 1.0
DEFAULT_REPORT_S = 30.0
CHECK_COLLECTIVES = "FZERO_CHECK_COLLECTIVES"


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
