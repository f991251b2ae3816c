"""benchmarks/plot.py reads the tables the benchmarks print and the metrics files;
`partition.plot_plan` draws stage plans and mesh plans (`_plot.plot_bars`: its rectangles)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import fzero
from fzero.partition import (
    HpZ,
    Mesh,
    MiCS,
    _plot,
    describe,
    flat_even,
    format_plan,
    kind_slices,
    mesh_plan,
    per_tensor_dim0,
)
from tests.models import Net

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
    pytest.importorskip("matplotlib")
    manifest = fzero.partition.describe(Net())
    images = [
        fzero.partition.plot_plan(fzero.partition.plan(manifest, world_size=3, stage=stage))
        for stage in (1, 3)
    ]
    for image in images:
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 5000
    assert images[0] != images[1]
    (tmp_path / "plan.png").write_bytes(images[1])


MESH = Mesh({"node": 2, "local": 2})  # ranks 0, 1 on node 0; 2, 3 on node 1


def _mesh_plan(preset, strategy=flat_even):
    # persistent units: MiCS keeps their parameters whole, HpZ gives them no secondary copy
    return mesh_plan(describe(Net()), MESH, preset, strategy=strategy, persistence_threshold=20)


# per_tensor_dim0 leaves padding between a unit's tensors, flat_even only after them
LAYOUTS = pytest.mark.parametrize(
    "preset, strategy",
    [(p, s) for p in (MiCS(("local",)), HpZ()) for s in (flat_even, per_tensor_dim0)],
    ids=["mics", "mics-per-tensor", "hpz", "hpz-per-tensor"],
)


def _bases(plan):
    """Where each unit's buffer starts on the x axis: the buffers end to end."""
    return [sum(unit.numel for unit in plan.units[:index]) for index in range(len(plan.units))]


def test_mesh_plan_bars_are_each_ranks_block():
    """Under MiCS over `local` a rank holds its `local` block of every kind: ranks 0 and 2
    (local=0) the same, ranks 0 and 1 different; under hpZ only the secondary copy is
    split that way, the rest over every rank."""
    mics, hpz = _plot.plot_bars(_mesh_plan(MiCS(("local",)))), _plot.plot_bars(_mesh_plan(HpZ()))
    assert list(mics) == ["params", "grads", "optimizer"]
    assert list(hpz) == ["params", "grads", "optimizer", "params_secondary"]
    for kind in ("grads", "optimizer"):
        assert mics[kind][0] == mics[kind][2] and mics[kind][1] == mics[kind][3]
        assert mics[kind][0] != mics[kind][1]
        assert len(set(hpz[kind])) == 4
    assert hpz["params_secondary"][0] == hpz["params_secondary"][2] != hpz["params_secondary"][1]


@LAYOUTS
def test_mesh_plan_bars_hold_the_real_elements_and_pad_the_rest(preset, strategy):
    """Each rank's row is, per unit, its block `kind_range(unit, kind, rank)` cut into
    no gaps or overlaps: the tensor pieces `kind_slices` lists, pale where the kind is split
    over no axis, and grey padding between and after them."""
    plan = _mesh_plan(preset, strategy)
    bases = _bases(plan)
    for kind, rows in _plot.plot_bars(plan).items():
        for rank, bars in enumerate(rows):
            slices = kind_slices(plan, rank, kind)
            for index, sharding in enumerate(plan.shardings):
                unit_bars = [bar for bar in bars if bar.unit == index]
                if sharding.of(kind) is None:
                    assert unit_bars == []
                    continue
                lo, hi = (bases[index] + x for x in plan.kind_range(index, kind, rank))
                assert [b.start for b in unit_bars] == [lo] + [b.stop for b in unit_bars[:-1]]
                assert unit_bars[-1].stop == hi
                real = "whole" if not sharding.of(kind).shard else "held"
                assert {b.fill for b in unit_bars} <= {real, "padding"}
                assert [(b.start, b.stop) for b in unit_bars if b.fill == real] == [
                    (lo + s.shard_offset, lo + s.shard_offset + s.numel)
                    for s in slices
                    if s.unit == index
                ]


@LAYOUTS
def test_mesh_plan_padding_bars_are_where_format_plan_reports_padding(preset, strategy):
    """format_plan prints each unit's padding and what each rank's optimizer block updates
    ("(padding only)": nothing): the optimizer bars pad the rest of the block, and the
    blocks of one group of ranks (one copy of the unit) carry the unit's padding."""
    plan = _mesh_plan(preset, strategy)
    padding, updated = {}, {}
    for line in format_plan(plan).splitlines():
        if unit := re.match(r"  unit (\d+) .* padding=(\d+)", line):
            index = int(unit[1])
            padding[index] = int(unit[2])
        elif rank := re.match(r"    rank (\d+) .*; updates (.*)$", line):
            spans = re.findall(r"\[(\d+):(\d+)\]", rank[2])
            updated[index, int(rank[1])] = sum(int(b) - int(a) for a, b in spans)
    assert sum(padding.values()) > 0  # the case pads (flat_even: some blocks are all padding)
    rows = _plot.plot_bars(plan)["optimizer"]
    for index, unit in enumerate(plan.units):
        group = plan.mesh.group(0, plan.shardings[index].optimizer.shard)
        padded = 0
        for rank in range(plan.world_size):
            lo, hi = plan.kind_range(index, "optimizer", rank)
            lengths = {"held": 0, "padding": 0}
            for bar in rows[rank]:
                if bar.unit == index:
                    lengths[bar.fill] += bar.stop - bar.start
            assert lengths == {"held": updated[index, rank], "padding": hi - lo - lengths["held"]}
            padded += lengths["padding"] if rank in group else 0
        assert padded == padding[index], unit.name


def test_stage_plan_padding_bars_are_where_format_plan_reports_padding():
    """A stage plan's rows pad what format_plan's "(+N padding)" says (stage 3 without
    persistent units: every kind is split, each rank's row its shards)."""
    plan = fzero.partition.plan(describe(Net()), world_size=3, stage=3, persistence_threshold=0)
    reported = {}
    for line in format_plan(plan).splitlines():
        if unit := re.match(r"  unit (\d+) ", line):
            index = int(unit[1])
        elif rank := re.match(r"    rank (\d+): .*?(?:\(\+(\d+) padding\))?$", line):
            reported[index, int(rank[1])] = int(rank[2] or 0)
    assert any(reported.values())
    for kind, rows in _plot.plot_bars(plan).items():
        for (index, rank), expected in reported.items():
            found = [
                b.stop - b.start for b in rows[rank] if b.unit == index and b.fill == "padding"
            ]
            assert sum(found) == expected, (kind, index, rank)


def test_mesh_plan_titles_and_rank_labels():
    mics, hpz = _mesh_plan(MiCS(("local",))), _mesh_plan(HpZ())
    assert _plot._title(mics, "grads") == "gradients: split over local, replicated over node"
    assert _plot._title(mics, "params") == "parameters: mixed (split differs per unit)"
    assert _plot._title(hpz, "optimizer") == "optimizer state: split over node x local"
    assert _plot._title(hpz, "params_secondary") == (
        "parameters, secondary copy (hpZ): split over local, replicated over node"
    )
    assert _plot._rank_label(mics, 3) == "rank 3 (node=1, local=1)"


def test_plot_plan_draws_a_mesh_plan():
    """A PNG per mesh plan; hpZ's has a fourth panel (its secondary copy), so it differs."""
    pytest.importorskip("matplotlib")
    images = [fzero.partition.plot_plan(_mesh_plan(p)) for p in (MiCS(("local",)), HpZ())]
    for image in images:
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 5000
    assert images[0] != images[1]
