"""Communication time of a plan's step, modelled: `comm_volume`'s collectives over the
bandwidth and latency of the links each mesh axis runs on (pure).

A collective over a group of W ranks is modelled as NCCL and gloo run it
(Thakur et al. 2005; Patarasuk & Yuan 2009):

- ring all-gather / reduce-scatter / all-to-all: W - 1 steps, each rank sending
  (W - 1) / W of the collective's bytes: `t = (W - 1) * latency + (W - 1) / W * B / bw`;
- ring all-reduce: a reduce-scatter then an all-gather: twice both terms;
- tree all-reduce (`algorithm="tree"`, NCCL's double binary tree): `t = 2 * log2(W) *
  latency + 2 * B / bw` — fewer latency terms, for many small reductions;
- an exchange (an all-to-all that is a permutation: the optimizer blocks' exchange,
  `Collective.exchange`): each rank sends its whole buffer to one rank at once:
  `t = latency + B / bw` (the worst rank: one that does not keep its own block);
- a collective over several axes runs at the slowest of their links (its ring crosses
  them all): a group spanning nodes is as fast as the inter-node link.

Every rank sends the same bytes in these algorithms, so the time is every rank's (the
worst rank's); memory per rank may differ (uneven plans), which `fzero estimate`'s
worst-rank column shows. `links` maps each mesh axis to a bandwidth — a number of bytes
per second or a string such as "25Gbps" (bits) or "400GBps" / "400 GB/s" (bytes), with an
optional latency after "@" ("25Gbps@5us"; default 5 µs). A plan of the whole world (no
mesh) runs over the axis "world".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fzero.partition._plan import Plan, PlanError
from fzero.partition._volume import Collective, comm_volume

__all__ = ["AxisTime", "Link", "comm_time", "format_comm_time", "parse_link"]

DEFAULT_LATENCY_S = 5e-6

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_LINK = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bps|b/s|bytes/s|b)?"
    r"\s*(?:@\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|µs|ns))?\s*$",
    re.IGNORECASE,
)
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes per second) and latency (seconds per message)."""

    bandwidth: float
    latency: float = DEFAULT_LATENCY_S


def parse_link(spec: str | float | int | Link) -> Link:
    """A `Link` from a number of bytes per second or a string: "25Gbps" (Gbit/s),
    "400GBps" or "400 GB/s" (Gbyte/s), optionally "@5us" (latency; s, ms, us, ns)."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        if spec <= 0:
            raise PlanError(f"link bandwidth is {spec!r}; it must be > 0 bytes per second")
        return Link(float(spec))
    match = _LINK.match(str(spec)) if isinstance(spec, str) else None
    if match is None:
        raise PlanError(
            f"link {spec!r} is not a bandwidth; give bytes per second (a number) or a "
            "string such as '25Gbps' (bits), '400GBps' or '400 GB/s' (bytes), optionally "
            "with a latency: '25Gbps@5us'"
        )
    number, prefix, unit, latency, latency_unit = match.groups()
    bits = unit is not None and unit[0] == "b" and not unit.lower().startswith("bytes")
    value = float(number) * _UNITS[prefix.lower()] / (8 if bits else 1)
    if value <= 0:
        raise PlanError(f"link {spec!r}: the bandwidth must be > 0")
    seconds = DEFAULT_LATENCY_S if latency is None else float(latency) * _TIME[latency_unit]
    return Link(value, seconds)


@dataclass(frozen=True)
class AxisTime:
    """The modelled time of one kind of collective per step: over `axes` (the group's
    axes; ("world",) for a plan without a mesh), on the slowest of their links."""

    operation: str
    what: str
    axes: tuple[str, ...]
    calls: int
    wire_bytes: int
    seconds: float


def _seconds(row: Collective, link: Link, algorithm: str) -> float:
    world = row.world_size
    if world <= 1 or row.calls == 0:
        return 0.0
    if row.exchange:  # one message per rank, to one rank
        return row.calls * link.latency + row.bytes / link.bandwidth
    if row.operation == "all_reduce" and algorithm == "tree":
        latency = 2 * math.log2(world) * link.latency * row.calls
        return latency + 2 * row.bytes / link.bandwidth
    factor = 2 if row.operation == "all_reduce" else 1
    latency = factor * (world - 1) * link.latency * row.calls
    return latency + factor * (world - 1) / world * row.bytes / link.bandwidth


def comm_time(
    plan: Plan | list[Collective],
    *,
    links: Mapping[str, str | float | Link],
    algorithm: str = "ring",
    **settings: object,
) -> list[AxisTime]:
    """Each collective of one step (`comm_volume(plan, **settings)`, or the rows given)
    with its modelled seconds on `links` (see the module docstring); `algorithm`:
    "ring" (every collective) or "tree" (all-reduces on NCCL's double binary tree)."""
    if algorithm not in ("ring", "tree"):
        raise PlanError(f"algorithm is {algorithm!r}; allowed: 'ring', 'tree'")
    rows = plan if isinstance(plan, list) else comm_volume(plan, **settings)  # type: ignore[arg-type]
    parsed = {axis: parse_link(spec) for axis, spec in links.items()}
    result = []
    for row in rows:
        axes = row.axes or ("world",)
        missing = [axis for axis in axes if axis not in parsed]
        if missing:
            raise PlanError(
                f"links has no entry for axis {missing[0]!r}, which the plan's "
                f"{row.operation} of {row.what} runs over; give links for {sorted(set(axes))}"
                f" (known: {sorted(parsed)})"
            )
        slowest = min((parsed[axis] for axis in axes), key=lambda link: link.bandwidth)
        latency = max(parsed[axis].latency for axis in axes)
        link = Link(slowest.bandwidth, latency)
        seconds = _seconds(row, link, algorithm)
        result.append(AxisTime(row.operation, row.what, axes, row.calls, row.wire_bytes, seconds))
    return result


def format_comm_time(rows: list[AxisTime]) -> str:
    """A table of `comm_time`'s rows, then the seconds per step by axes and in all."""
    lines = [f"{'operation':<15}{'what':<32}{'axes':<16}{'calls':>7}{'wire bytes':>15}{'ms':>10}"]
    for r in rows:
        lines.append(
            f"{r.operation:<15}{r.what:<32}{'+'.join(r.axes):<16}{r.calls:>7}"
            f"{r.wire_bytes:>15,}{1e3 * r.seconds:>10.3f}"
        )
    by_axes: dict[tuple[str, ...], float] = {}
    for r in rows:
        by_axes[r.axes] = by_axes.get(r.axes, 0.0) + r.seconds
    for axes, seconds in by_axes.items():
        lines.append(f"{'  over ' + '+'.join(axes):<70}{1e3 * seconds:>10.3f}")
    total = sum(r.seconds for r in rows)
    label = "total per step (ms, modelled; not overlapped with compute)"
    lines.append(f"{label:<70}{1e3 * total:>10.3f}")
    return "\n".join(lines)
