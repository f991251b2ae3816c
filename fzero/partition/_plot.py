"""A picture of a plan: who holds what, per kind of state, with padding shown.

`plot_plan(plan)` returns PNG bytes (it writes no file): one panel per kind of state,
one row per rank, the units' flat buffers end to end along the x axis. A rank's part of
a unit is drawn in the unit's colour where it holds real elements, paler where every
rank keeps the whole unit (the kind is split over no axis), and grey where it is padding.

- A plan of the whole world: parameters, gradients, optimizer state, each titled
  sharded or replicated at the plan's stage; a row holds the rank's shard of each unit
  the stage splits, and each unit it keeps whole drawn pale end to end, padding
  included.
- A plan on a mesh: the same panels, and one for hpZ's secondary copy of the parameters
  when any unit has one; a row is a process, labelled with its mesh coordinate, and
  holds its block `Plan.kind_range(unit, kind, process)` of each unit (a whole block's
  padding grey too); a title names the axes the kind is split and replicated over
  ("mixed" when units differ).

`plot_bars(plan)` is the picture as data, pure and without matplotlib: per kind and
rank, the rectangles. `plot_plan` needs matplotlib (`pip install fzero[bench]`).
"""

from __future__ import annotations

import io
import itertools
from typing import Any, Literal, NamedTuple

from fzero.partition._mesh import KINDS, Sharding
from fzero.partition._plan import Plan, Unit

__all__ = ["Bar", "plot_bars", "plot_plan"]

# Panel titles of the kinds in `_mesh.KINDS`.
LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "params_secondary": "parameters, secondary copy (hpZ)",
}

Fill = Literal["held", "whole", "padding"]
GREY = "0.85"  # padding


class Bar(NamedTuple):
    """One rectangle of a rank's row: elements `[start, stop)` of the unit buffers laid
    end to end, in unit `unit`, drawn as `fill`: "held" in the unit's colour, "whole"
    paler (every rank keeps the whole unit), "padding" grey."""

    unit: int
    start: int
    stop: int
    fill: Fill


def _stage_split(plan: Plan, kind: str, unit: Unit) -> bool:
    """Whether `kind` of `unit` is split over ranks at the unit's stage (`Plan.stage_of`)."""
    stage = plan.stage_of(unit)
    return stage >= {"optimizer": 1, "grads": 2}.get(kind, 3)


def _block_bars(unit: Unit, index: int, base: int, lo: int, hi: int, fill: Fill) -> list[Bar]:
    """Block `[lo, hi)` of unit `index`, whose buffer starts at `base` on the x axis:
    its real elements (the tensors' pieces) as `fill`, the gaps between them as padding."""
    runs = sorted(
        (max(lo, piece.offset), min(hi, piece.offset + piece.numel))
        for placement in unit.placements
        for piece in placement.pieces
    )
    bars, at = [], lo
    for start, stop in runs:
        if start >= stop:
            continue
        if at < start:
            bars.append(Bar(index, base + at, base + start, "padding"))
        bars.append(Bar(index, base + start, base + stop, fill))
        at = stop
    if at < hi:
        bars.append(Bar(index, base + at, base + hi, "padding"))
    return bars


def _unit_bars(plan: Plan, kind: str, index: int, rank: int, base: int) -> list[Bar]:
    """What `rank` (a process on a mesh) holds of `kind` of unit `index` (buffer at
    `base`) as rectangles."""
    unit = plan.units[index]
    if plan.mesh is None:
        if not _stage_split(plan, kind, unit):
            return [Bar(index, base, base + unit.numel, "whole")]
        # the optimizer's shard, or the gradients' and parameters' (a finer optimizer
        # split holds several optimizer shards per gradient shard; a unit on its own
        # axes the shard of its index along them)
        held = plan.shard_range(unit, rank) if kind == "optimizer" else plan.grads_range(unit, rank)
        return _block_bars(unit, index, base, *held, "held")
    split = plan.sharding_of(unit).of(kind)
    if split is None:  # no hpZ secondary copy of this unit
        return []
    lo, hi = plan.kind_range(unit, kind, rank)
    return _block_bars(unit, index, base, lo, hi, "held" if split.shard else "whole")


def _kinds(plan: Plan) -> tuple[str, ...]:
    """The kinds drawn: a world plan's three; on a mesh the kinds some unit has."""
    if plan.mesh is None:
        return KINDS[:3]
    return tuple(k for k in KINDS if any(s.of(k) is not None for s in plan.shardings))


def plot_bars(plan: Plan) -> dict[str, tuple[tuple[Bar, ...], ...]]:
    """The picture `plot_plan` draws, as data: for each kind drawn (a name in
    `partition.KINDS`), for each rank (each process, on a mesh), its rectangles in
    buffer order."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan is a {type(plan).__name__}; expected a partition.Plan")
    bases, offset = [], 0
    for unit in plan.units:
        bases.append(offset)
        offset += unit.numel
    return {
        kind: tuple(
            tuple(
                bar
                for index, base in enumerate(bases)
                for bar in _unit_bars(plan, kind, index, rank, base)
            )
            for rank in range(plan.processes)
        )
        for kind in _kinds(plan)
    }


def _axes_text(split: Sharding) -> str:
    """What a kind is split and copied over: "split over local, replicated over node"."""
    parts = [f"split over {' x '.join(split.shard)}" if split.shard else "not split"]
    if split.replicate:
        parts.append(f"replicated over {' x '.join(split.replicate)}")
    return ", ".join(parts)


def _title(plan: Plan, kind: str) -> str:
    """A panel's title: the kind, and how it is split."""
    if plan.mesh is None:
        split = {_stage_split(plan, kind, u) for u in plan.units}
        if len(split) > 1:
            return f"{LABELS[kind]} (mixed: sharded in some units)"
        return f"{LABELS[kind]} ({'sharded' if True in split else 'replicated'})"
    found = {s.of(kind) for s in plan.shardings} - {None}
    if len(found) > 1:
        return f"{LABELS[kind]}: mixed (split differs per unit)"
    return f"{LABELS[kind]}: {_axes_text(found.pop())}"


def _rank_label(plan: Plan, rank: int) -> str:
    """A row's label: the rank, and on a mesh its coordinate ("rank 3 (node=1, local=1)")."""
    if plan.mesh is None:
        return f"rank {rank}"
    where = ", ".join(f"{axis}={c}" for axis, c in plan.mesh.coordinate(rank).items())
    return f"rank {rank} ({where})"


def _draw_block(ax: Any, block: list[Bar], row: tuple[float, float], colour: Any) -> None:
    """One unit's bars in one row: the block painted end to end (pale if kept whole, else
    grey), then the rest over it (real elements, or a whole block's padding), so no seam
    shows between neighbours."""
    styles = {
        "held": {"color": colour},
        "whole": {"color": colour, "alpha": 0.35},
        "padding": {"color": GREY},
    }
    under = "whole" if any(bar.fill == "whole" for bar in block) else "padding"
    ax.broken_barh([(block[0].start, block[-1].stop - block[0].start)], row, **styles[under])
    for fill in ("held", "padding"):
        over = [(bar.start, bar.stop - bar.start) for bar in block if bar.fill == fill != under]
        if over:
            ax.broken_barh(over, row, **styles[fill])


def plot_plan(plan: Plan, *, width: float = 10.0) -> bytes:
    """The plan as a PNG image (bytes): see the module docstring."""
    panels = plot_bars(plan)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "plot_plan needs matplotlib: pip install fzero[bench] (or matplotlib)"
        ) from error
    colours = plt.get_cmap("tab10").colors
    ranks = range(plan.processes)
    height = 1.0 + 0.35 * plan.processes * len(panels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(width, height), sharex=True)
    for ax, (kind, rows) in zip(axes, panels.items()):
        for rank, bars in enumerate(rows):
            for unit, block in itertools.groupby(bars, key=lambda bar: bar.unit):
                colour = colours[unit % len(colours)]
                _draw_block(ax, list(block), (rank - 0.4, 0.8), colour)
        ax.set_yticks(ranks, [_rank_label(plan, rank) for rank in ranks])
        ax.invert_yaxis()
        ax.set_title(_title(plan, kind), fontsize=9)
    if plan.mesh is None:
        layout = f"stage {plan.stage}{' (mixed)' if plan.mixed else ''}; "
    else:  # the mesh makes the line too long for one
        layout = f"preset {plan.preset}, mesh {plan.mesh})\n("
    axes[-1].set_xlabel(
        f"element of the unit buffers (strategy {plan.strategy}, {layout}"
        "pale: kept whole by every rank, grey: padding)"
    )
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out.getvalue()
