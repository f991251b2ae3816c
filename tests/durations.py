"""tests/DURATIONS.md from the JSON files `FZERO_TEST_DURATIONS=path pytest ...` writes
(conftest.py: each test's seconds, setup and teardown included, and the kinds of process
it used): by job, by kind (in the pytest process, on 1, 2 or 4 rank processes, launching
a subprocess such as `fzero run -n 2 script.py`) and by file; with `--before`, the same
tables for an earlier run beside them.

    python -m tests.durations tests/DURATIONS.md --after fast=a.json slow=b.json \\
        [--before fast=c.json slow=d.json] [--note "conditions of the runs"]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

KINDS = ("single process", "1 rank", "2 ranks", "4 ranks", "subprocess")


def kind_of(kinds: list[str]) -> str:
    """The heaviest kind of process a test used: a launched subprocess, else the largest
    `run_world` (new or persistent processes alike), else the pytest process alone."""
    if "subprocess" in kinds:
        return "subprocess"
    worlds = [int(k.split()[0]) for k in kinds if k[0].isdigit()]
    if not worlds:
        return "single process"
    world = max(worlds)
    return f"{world} rank{'s' if world > 1 else ''}"


def _load(pairs: list[str]) -> dict[str, dict]:
    jobs = {}
    for pair in pairs:
        job, _, path = pair.partition("=")
        jobs[job] = json.loads(Path(path).read_text())
    return jobs


def _sums(runs: dict[str, dict], by) -> dict[str, list[float]]:
    """key -> [tests, seconds, CPU seconds] over every job's tests."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for job, tests in runs.items():
        for nodeid, entry in tests.items():
            key = by(job, nodeid, entry)
            out[key][0] += 1
            out[key][1] += entry["seconds"]
            out[key][2] += entry.get("cpu", 0.0)
    return out


def _table(title: str, header: str, rows: list[str], before: bool) -> list[str]:
    columns = "| tests | seconds | CPU s |"
    columns += " tests before | seconds before | CPU s before |" if before else ""
    line = "|---" * (columns.count("|")) + "|"
    return [f"### {title}", "", f"| {header} {columns}", line, *rows, ""]


def _rows(after: dict, before: dict | None, keys: list[str]) -> list[str]:
    rows = []
    for key in keys:
        n, s, c = after.get(key, (0, 0.0, 0.0))
        row = f"| {key} | {n} | {s:,.0f} | {c:,.0f} |"
        if before is not None:
            bn, bs, bc = before.get(key, (0, 0.0, 0.0))
            row += f" {bn} | {bs:,.0f} | {bc:,.0f} |"
        rows.append(row)
    return rows


def render(after: dict[str, dict], before: dict[str, dict] | None, note: str) -> str:
    lines = ["# Test durations", "", "Written by `make durations` (tests/durations.py).", ""]
    if note:
        lines += [note, ""]

    def job(job: str, nodeid: str, entry: dict) -> str:
        return job

    by_job = _sums(after, job)
    old_job = _sums(before, job) if before is not None else None
    jobs = list(after) + [j for j in (before or {}) if j not in after]
    lines += _table("By job (sums over the tests)", "job", _rows(by_job, old_job, jobs),
                    before is not None)  # fmt: skip

    def kind(job: str, nodeid: str, entry: dict) -> str:
        return kind_of(entry["kinds"])

    kinds_after = _sums(after, kind)
    kinds_before = _sums(before, kind) if before is not None else None
    lines += _table("By kind", "kind", _rows(kinds_after, kinds_before, list(KINDS)),
                    before is not None)  # fmt: skip

    def file(job: str, nodeid: str, entry: dict) -> str:
        return nodeid.split("::")[0]

    files_after = _sums(after, file)
    files_before = _sums(before, file) if before is not None else None
    files = sorted(
        set(files_after) | set(files_before or {}), key=lambda f: -files_after.get(f, (0, 0))[1]
    )
    lines += _table("By file", "file", _rows(files_after, files_before, files), before is not None)
    slowest = sorted(
        (
            (e["seconds"], e.get("cpu", 0.0), n, kind_of(e["kinds"]))
            for t in after.values()
            for n, e in t.items()
        ),
        reverse=True,
    )[:30]
    lines += ["### Slowest tests", "", "| seconds | CPU s | kind | test |", "|---|---|---|---|"]
    lines += [f"| {s:,.1f} | {c:,.1f} | {k} | `{n}` |" for s, c, n, k in slowest]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--after", nargs="+", required=True, metavar="JOB=PATH")
    parser.add_argument("--before", nargs="+", metavar="JOB=PATH")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    before = _load(args.before) if args.before else None
    Path(args.out).write_text(render(_load(args.after), before, args.note))


if __name__ == "__main__":
    main()
