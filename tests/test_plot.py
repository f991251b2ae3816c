"""benchmarks/plot.py reads the tables the benchmarks print and the metrics files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("plot", ROOT / "benchmarks" / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

TABLE = """step time, 8.4M params, micro batch 8, 2 ranks, 1 threads/rank
engine                               s/step   x DDP  peak RSS MB
DDP                                   0.094    1.00          496
fzero stage 3                         0.107    1.13         1002
fzero stage 3 max_reuse_distance=0    0.112    1.18         1118
(peak RSS is the process high-water mark so far)
"""


def test_table_rows_keep_names_ending_in_digits(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TABLE)
    header, names, values = plot.read_table(str(path))
    assert header == ["s/step", "x DDP", "peak RSS MB"]
    assert names == ["DDP", "fzero stage 3", "fzero stage 3 max_reuse_distance=0"]
    assert values[1] == [0.107, 1.13, 1002.0]


def test_most_row_names_may_end_in_digits():
    # the header, not the commonest count of trailing numbers, says how many columns
    table = "\n".join(
        ["step time, 2 ranks", "engine                 s/step  min  x DDP", "DDP   0.1  0.1  1.00"]
        + [f"fzero stage {stage}   0.2  0.1  2.00" for stage in range(4)]
    )
    header, names, values = plot.parse_table(table)
    assert header == ["s/step", "min", "x DDP"]
    assert names == ["DDP", *(f"fzero stage {stage}" for stage in range(4))]
    assert values[4] == [0.2, 0.1, 2.0]


def test_metrics_and_a_table_become_pngs(tmp_path):
    import subprocess
    import sys

    (tmp_path / "t.txt").write_text(TABLE)
    # a plain loss.backward() hands the engine no loss: such lines have none
    (tmp_path / "m.jsonl").write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": null}\n{"step": 3, "loss": 2.0}\n'
    )
    for args in (["table", "t.txt", "-o", "t.png"], ["loss", "m.jsonl", "-o", "l.png"]):
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "plot.py"), *args], cwd=tmp_path, check=True
        )
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


RESULTS = """# make bench

## step_time

```
step time, 2 ranks, 3 interleaved rounds
engine           s/step    min    max  x DDP  peak RSS MB
DDP               0.094  0.090  0.101   1.00          496
fzero stage 3     0.107  0.100  0.130   1.13          402
```

## cpu_adam

```
AdamW step
kernel                          B/elem    ms   min   max  x floor  GB/s
floor: C stream p,m,v += g          28   4.7   4.0   4.9     1.18  29.9
fzero native AdamW (under floor)    28   3.8   3.6   4.6        -  36.8
(floor: ...)
```
"""


def test_a_results_file_becomes_one_png_of_medians_and_spreads(tmp_path):
    import subprocess
    import sys

    (tmp_path / "results.md").write_text(RESULTS)
    tables = plot.read_results(str(tmp_path / "results.md"))
    assert list(tables) == ["step_time", "cpu_adam"]
    header, names, values = plot.parse_table(tables["cpu_adam"])
    assert plot.spread_column(header) == (1, True)
    assert names[1] == "fzero native AdamW (under floor)"
    assert values[1][:3] == [28.0, 3.8, 3.6] and values[1][4] != values[1][4]  # "-": nan
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot.py"), "results", "results.md"],
        cwd=tmp_path,
        check=True,
    )
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_plan_draws_each_kind_per_rank(tmp_path):
    """`partition.plot_plan` returns a PNG; a stage-1 plan and a stage-3 plan of the same
    model differ (parameters sharded or kept whole)."""
    import fzero
    from tests.models import Net

    manifest = fzero.partition.describe(Net())
    images = [
        fzero.partition.plot_plan(fzero.partition.plan(manifest, world_size=3, stage=stage))
        for stage in (1, 3)
    ]
    for image in images:
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 5000
    assert images[0] != images[1]
    (tmp_path / "plan.png").write_bytes(images[1])
