"""PNG charts from fzero's metrics files and benchmark tables (needs matplotlib: the
`bench` extra).

    python benchmarks/plot.py loss run1.jsonl [run2.jsonl ...] -o loss.png
    python benchmarks/plot.py table step_time.txt -o step_time.png [--column 2]
    python benchmarks/plot.py results benchmarks/results.md -o results.png

`loss`: the loss (and tokens/s, when present) of each JSON-lines metrics file
(`metrics_file` / `--metrics-file`) against the step. `table`: a bar chart of one
numeric column of a table a benchmark printed (first column: the row's name; the
header line names the columns). `results`: every table of a results file (`make
bench`), one chart each: the median with its min-max over rounds as an error bar.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# a table cell: a number, or "-" / "nan" where a row has none
NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$|^nan$|^-$")


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_table(path: str) -> tuple[list[str], list[str], list[list[float]]]:
    return parse_table(Path(path).read_text(), path)


def parse_table(text: str, where: str = "table") -> tuple[list[str], list[str], list[list[float]]]:
    """(column names, row names, numbers per row) of a benchmark's printed table. The
    header is the first line of fields separated by two or more spaces, one more than
    the next line's trailing numbers ("-" or "nan" for a cell with none; one fewer when
    the row's name ends in a digit, as "fzero stage 3"); the rows are the lines after it
    ending in at least that many numbers. A table with no such header: the rows are the
    lines ending in the most common count of numbers."""
    lines = text.splitlines()
    counts = [_trailing_numbers(line) for line in lines]
    for i, line in enumerate(lines[:-1]):
        header = re.split(r"\s{2,}", line.strip())
        width = len(header) - 1
        if width and counts[i] == 0 and counts[i + 1] in (width, width + 1):
            rows = []
            for row in lines[i + 1 :]:
                if _trailing_numbers(row) < width:
                    break
                rows.append(row)
            return header[1:], *_split_rows(rows, width)
    width = max(set(c for c in counts if c), key=counts.count, default=0)
    if not width:
        raise SystemExit(f"{where}: no table rows (a name followed by numbers) found")
    first = counts.index(next(c for c in counts if c >= width))
    header = re.split(r"\s{2,}", lines[first - 1].strip()) if first else []
    return header[-width:], *_split_rows([ln for ln, c in zip(lines, counts) if c >= width], width)


def _trailing_numbers(line: str) -> int:
    words = line.split()
    count = 0
    while count < len(words) - 1 and NUMBER.match(words[-1 - count]):
        count += 1
    return count


def _split_rows(rows: list[str], width: int) -> tuple[list[str], list[list[float]]]:
    names = [" ".join(line.split()[:-width]) for line in rows]
    return names, [[_number(x) for x in line.split()[-width:]] for line in rows]


def _number(cell: str) -> float:
    return float("nan") if cell == "-" else float(cell)


def read_results(path: str) -> dict[str, str]:
    """Each table of a results file (`make bench`): its `## name` heading to the text of
    the fenced block under it."""
    tables: dict[str, str] = {}
    name = None
    block: list[str] | None = None
    for line in Path(path).read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
        elif line.startswith("```") and block is None:
            block = []
        elif line.startswith("```") and block is not None:
            tables[name or f"table {len(tables) + 1}"] = "\n".join(block)
            block = None
        elif block is not None:
            block.append(line)
    if not tables:
        raise SystemExit(f"{path}: no tables (a '## name' heading, then a ``` block) found")
    return tables


def spread_column(header: list[str]) -> tuple[int, bool]:
    """The column a results chart draws, and whether "min" and "max" (its spread over
    rounds) follow it: the first column that has them, else the first."""
    for i in range(len(header) - 2):
        if header[i + 1 : i + 3] == ["min", "max"]:
            return i, True
    return 0, False


def draw_table(ax, title: str, header: list[str], names: list[str], values: list[list[float]]):
    """One table of a results file: a bar per row, its min-max as an error bar."""
    column, has_spread = spread_column(header)
    error = None
    if has_spread:
        below = [row[column] - row[column + 1] for row in values]
        above = [row[column + 2] - row[column] for row in values]
        error = [below[::-1], above[::-1]]
    ax.barh(names[::-1], [row[column] for row in values][::-1], xerr=error, capsize=3)
    ax.set_title(title, loc="left")
    ax.set_xlabel(header[column] + (" (median, min-max over rounds)" if has_spread else ""))


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
    results = sub.add_parser("results", help="every table of a results file, with spreads")
    results.add_argument("file")
    results.add_argument("-o", "--output", default="results.png")
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
    elif args.kind == "results":
        tables = [(name, parse_table(text, name)) for name, text in read_results(args.file).items()]
        heights = [0.3 * len(names) + 1.2 for _, (_, names, _) in tables]
        fig, axes = plt.subplots(
            len(tables),
            1,
            figsize=(8, sum(heights)),
            gridspec_kw={"height_ratios": heights},
            squeeze=False,
        )
        for ax, (name, (header, names, values)) in zip(axes[:, 0], tables):
            draw_table(ax, name, header, names, values)
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
