"""PNG charts from fzero's metrics files and benchmark tables (needs matplotlib: the
`bench` extra).

    python benchmarks/plot.py loss run1.jsonl [run2.jsonl ...] -o loss.png
    python benchmarks/plot.py table step_time.txt -o step_time.png [--column 2]

`loss`: the loss (and tokens/s, when present) of each JSON-lines metrics file
(`metrics_file` / `--metrics-file`) against the step. `table`: a bar chart of one
numeric column of a table a benchmark printed (first column: the row's name; the
header line names the columns).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_table(path: str) -> tuple[list[str], list[str], list[list[float]]]:
    """(column names, row names, numbers per row) of a benchmark's printed table. Rows
    are lines ending in numbers; their count of trailing numbers is the table's most
    common one (so a name may end in a digit, as "fzero stage 3"); the header is the
    line above the first row, its columns separated by two or more spaces."""
    lines = Path(path).read_text().splitlines()
    token = re.compile(r"^-?\d+(?:\.\d+)?$|^nan$")

    def trailing(line: str) -> int:
        words = line.split()
        count = 0
        while count < len(words) - 1 and token.match(words[-1 - count]):
            count += 1
        return count

    counts = [trailing(line) for line in lines]
    width = max(set(c for c in counts if c), key=counts.count, default=0)
    if not width:
        raise SystemExit(f"{path}: no table rows (a name followed by numbers) found")
    rows = [(i, line) for i, line in enumerate(lines) if counts[i] >= width]
    header = re.split(r"\s{2,}", lines[rows[0][0] - 1].strip()) if rows[0][0] else []
    names = [" ".join(line.split()[:-width]) for _, line in rows]
    values = [[float(x) for x in line.split()[-width:]] for _, line in rows]
    return header[-width:], names, values


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="kind", required=True)
    loss = sub.add_parser("loss", help="loss curves from metrics files")
    loss.add_argument("files", nargs="+")
    loss.add_argument("-o", "--output", default="loss.png")
    table = sub.add_parser("table", help="a bar chart of a benchmark table")
    table.add_argument("file")
    table.add_argument("-o", "--output", default="table.png")
    table.add_argument("--column", type=int, default=0, help="which numeric column (from 0)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.kind == "loss":
        fig, ax = plt.subplots(figsize=(7, 4))
        for path in args.files:
            records = [r for r in read_metrics(path) if r.get("loss") is not None]
            ax.plot(
                [r["step"] for r in records], [r["loss"] for r in records], label=Path(path).stem
            )
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    else:
        header, names, values = read_table(args.file)
        column = [row[args.column] for row in values]
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
        ax.barh(names[::-1], column[::-1])
        ax.set_xlabel(header[args.column] if len(header) > args.column else "")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(args.output)


if __name__ == "__main__":
    main()
