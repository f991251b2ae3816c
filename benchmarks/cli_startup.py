"""How long the `fzero` command takes to answer `--help` and `--version`, against the
interpreter's own start-up and an `import torch` measured in the same run.

    python benchmarks/cli_startup.py [--rounds 10] [--old PATH] [--results FILE]

Each row is a fresh process (the command as a user types it), the rows interleaved over
rounds; a row's time is the median over rounds with its min-max. `--old PATH` adds rows
for another `fzero` executable (e.g. an install of an older version) for comparison.
The target: `fzero --help` and `fzero --version` under 1.5 s, which only holds while the
command's entry imports neither torch nor the `fzero` package for them. `fzero run
--dry-run` is the launcher's own share of every launch (torchrun and the ranks import
torch; the launcher need not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import _harness


def _command(argv: list[str]) -> None:
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--old", default=None, help="another fzero executable to compare")
    parser.add_argument("--results", default=None, help="append the table to this file")
    args = parser.parse_args()
    here = os.path.dirname(sys.executable)
    fzero = os.path.join(here, "fzero") if os.path.exists(os.path.join(here, "fzero")) else None
    fzero = fzero or shutil.which("fzero")
    if fzero is None:
        raise SystemExit("cli_startup: no `fzero` executable beside this Python or on PATH")
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
        ("fzero --help", [fzero, "--help"]),
        ("fzero --version", [fzero, "--version"]),
        ("fzero checkpoint inspect --help", [fzero, "checkpoint", "inspect", "--help"]),
        # the launcher's own part of every `fzero run`: it builds torchrun's command
        ("fzero run --dry-run -n 2", [fzero, "run", "--dry-run", "-n", "2", "train.py"]),
        ("python -c 'import fzero'", [sys.executable, "-c", "import fzero"]),
    ]
    if args.old:
        rows += [
            ("old fzero --help", [args.old, "--help"]),
            ("old fzero run --dry-run -n 2", [args.old, "run", "--dry-run", "-n", "2", "train.py"]),
        ]
    calls = [(name, lambda argv=argv: _command(argv)) for name, argv in rows]
    times = _harness.interleave(calls, args.rounds)
    base = times["python -c pass"]
    table = _harness.Table(
        title=f"fzero command start-up, {args.rounds} interleaved rounds, one process each",
        name_header="command",
        columns=(("s", ".3f"), ("min", ".3f"), ("max", ".3f"), ("x python", ".2f")),
        rows=tuple(
            (name, (*_harness.spread(t), _harness.paired_ratio(t, base)))
            for name, t in times.items()
        ),
        notes=("target: fzero --help and --version under 1.5 s",),
    )
    _harness.report("cli start-up", table, args.results)


if __name__ == "__main__":
    main()
