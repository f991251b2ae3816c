"""A picture of a plan: who holds what, per kind of state, with padding shown.

`plot_plan(plan)` returns PNG bytes (it writes no file): one panel per kind —
parameters, gradients, optimizer state — one row per rank, the units' flat buffers end to
end along the x axis. A rank's own shard of a unit is drawn in the unit's colour, a
whole unit every rank keeps (not sharded for that kind at this stage) paler, and
padding grey. Needs matplotlib (`pip install fzero[bench]`).
"""

from __future__ import annotations

import io

from fzero.partition._plan import Plan

__all__ = ["plot_plan"]

KINDS = ("parameters", "gradients", "optimizer state")


def _sharded(plan: Plan, kind: str, persistent: bool) -> bool:
    """Whether `kind` of a unit is split over ranks at the plan's stage."""
    if kind == "optimizer state":
        return plan.stage >= 1
    if kind == "gradients":
        return plan.stage >= 2
    return plan.stage == 3 and not persistent


def _owned_runs(plan: Plan, unit_index: int, rank: int) -> list[tuple[int, int]]:
    """(start, stop) offsets in the unit buffer of the real elements in `rank`'s shard."""
    unit = plan.units[unit_index]
    lo, hi = unit.shard_range(rank)
    runs = []
    for placement in unit.placements:
        for piece in placement.pieces:
            start, stop = max(lo, piece.offset), min(hi, piece.offset + piece.numel)
            if start < stop:
                runs.append((start, stop))
    return sorted(runs)


def plot_plan(plan: Plan, *, width: float = 10.0) -> bytes:
    """The plan as a PNG image (bytes): see the module docstring."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "plot_plan needs matplotlib: pip install fzero[bench] (or matplotlib)"
        ) from error
    starts, offset = [], 0
    for unit in plan.units:
        starts.append(offset)
        offset += unit.numel
    colours = plt.get_cmap("tab10").colors
    height = 1.0 + 0.35 * plan.world_size * len(KINDS)
    figure, axes = plt.subplots(len(KINDS), 1, figsize=(width, height), sharex=True)
    for ax, kind in zip(axes, KINDS):
        for rank in range(plan.world_size):
            row = (rank - 0.4, 0.8)
            for index, unit in enumerate(plan.units):
                colour = colours[index % len(colours)]
                base = starts[index]
                if not _sharded(plan, kind, unit.persistent):
                    ax.broken_barh([(base, unit.numel)], row, color=colour, alpha=0.35)
                    continue
                lo, hi = unit.shard_range(rank)
                ax.broken_barh([(base + lo, hi - lo)], row, color="0.85")
                runs = [(base + a, b - a) for a, b in _owned_runs(plan, index, rank)]
                ax.broken_barh(runs, row, color=colour)
        ax.set_yticks(range(plan.world_size), [f"rank {r}" for r in range(plan.world_size)])
        ax.invert_yaxis()
        split = any(_sharded(plan, kind, u.persistent) for u in plan.units)
        ax.set_title(f"{kind} ({'sharded' if split else 'replicated'})", fontsize=9)
    axes[-1].set_xlabel(
        f"element of the unit buffers (strategy {plan.strategy}, stage {plan.stage}; "
        "pale: kept whole by every rank, grey: padding)"
    )
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out.getvalue()
