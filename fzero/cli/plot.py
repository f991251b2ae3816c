"""`fzero plot RUN [RUN ...] -o run.png` (its arguments parsed in `fzero_cli`): one PNG
of loss, learning rate, throughput, TFLOP/s and MFU, model-state memory against the plan
and communication per mesh axis of one run or several to compare. A RUN is a metrics
file (`metrics_file`), a TensorBoard directory or a CSV monitor's directory (fzero's or
DeepSpeed's); `NAME=RUN` names it in the legend."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(args: argparse.Namespace) -> int:
    """Read each run and draw them; errors name the run and what it lacks."""
    from fzero.monitoring._plot import plot_runs
    from fzero.monitoring._runs import read_run

    try:
        runs = []
        for spec in args.runs:
            name, _, path = spec.rpartition("=")
            runs.append(read_run(path, name or None))
        drawn = plot_runs(runs, args.output)
    except (OSError, ValueError, ImportError) as error:
        print(f"fzero plot: {error}", file=sys.stderr)
        return 2
    empty = [panel for panel, lines in drawn.items() if not lines]
    print(args.output)
    if empty:
        print(f"(no data for: {', '.join(empty)})", file=sys.stderr)
    return 0
