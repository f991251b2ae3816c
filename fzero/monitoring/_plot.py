"""One PNG of one or more runs (`fzero plot`): loss, learning rate, throughput, TFLOP/s
and MFU, model-state memory against the plan, and communication per mesh axis, each run
in one colour across the panels (needs matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fzero.monitoring._runs import Run

__all__ = ["PANELS", "plot_runs"]

PANELS = (
    "loss",
    "learning rate",
    "throughput",
    "model FLOPs",
    "model-state memory vs plan",
    "communication per mesh axis",
)
"""The panels' titles, in order (left to right, top to bottom)."""

_DASHES = ("-", "--", ":", "-.")


def _lines(panel: str, run: Run) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(label, line style, points) of what `panel` draws of `run`."""
    s = run.series
    if panel == "loss":
        return [("train_loss", "-", s["train_loss"])] if "train_loss" in s else []
    if panel == "learning rate":
        return [("lr", "-", s["lr"])] if "lr" in s else []
    if panel == "throughput":
        for name in ("tokens_per_second", "samples_per_second"):
            if name in s:
                return [(name.replace("_per_second", "/s"), "-", s[name])]
        return []
    if panel == "model FLOPs":
        found = [("TFLOP/s", "-", s["tflops"])] if "tflops" in s else []
        if "mfu" in s:
            found.append(("MFU %", "--", [(x, 100 * y) for x, y in s["mfu"]]))
        return found
    if panel == "model-state memory vs plan":
        return [
            (label, style, s[name])
            for name, label, style in (
                ("model_state_MB", "held MB", "-"),
                ("model_state_plan_MB", "plan MB", "--"),
            )
            if name in s
        ]
    prefix = "comm_MB_per_step_"
    axes = sorted(name for name in s if name.startswith(prefix))
    return [
        (f"{name[len(prefix) :]} MB/step", _DASHES[i % len(_DASHES)], s[name])
        for i, name in enumerate(axes)
    ]


def plot_runs(runs: Sequence[Run], output: str | Path) -> dict[str, list[str]]:
    """Draw `runs` into the PNG `output`; returns, per panel title, the lines drawn
    (`run: label`), empty where no run has that figure (the panel says so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("plot_runs needs at least one run")
    x_labels = {run.x_label for run in runs}
    x_label = (
        x_labels.pop() if len(x_labels) == 1 else "samples, or step where a run has no samples"
    )
    fig, axes = plt.subplots(3, 2, figsize=(12, 10.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: dict[str, list[str]] = {}
    for ax, panel in zip(axes.flat, PANELS):
        drawn[panel] = []
        twin = ax.twinx() if panel == "model FLOPs" else None  # MFU % on its own scale
        handles = []
        for i, run in enumerate(runs):
            width = 1.2 + 1.5 * (len(runs) - 1 - i) / max(1, len(runs) - 1)  # overlaps show
            for label, style, points in _lines(panel, run):
                xs, ys = zip(*points)
                target = twin if twin is not None and label.startswith("MFU") else ax
                name = f"{run.name}: {label}"
                handles += target.plot(
                    xs, ys, style, color=colours[i % len(colours)], linewidth=width, label=name
                )
                drawn[panel].append(name)
        ax.set_title(panel, loc="left")
        ax.set_xlabel(x_label)
        if twin is not None:
            ax.set_ylabel("TFLOP/s (all ranks)")
            twin.set_ylabel("MFU % (per rank, of its peak)")
        if drawn[panel]:
            ax.legend(handles=handles, fontsize="small")
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "not in these runs", ha="center", va="center", transform=ax.transAxes)
    names = ", ".join(run.name for run in runs)
    fig.suptitle(f"fzero plot: {names}  (MB = 10^6 bytes)")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return drawn
