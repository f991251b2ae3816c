"""benchmarks/_harness.py: spreads, tables plot.py reads back, rows in their own processes
interleaved over rounds; benchmarks/cpu_adam.py's floor never prints a ratio below 1."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as `import _harness` from a benchmark would find it
    spec.loader.exec_module(module)
    return module


harness = load("_harness")
plot = load("plot")


def test_spread_is_median_min_max():
    assert harness.spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    with pytest.raises(ValueError, match="no samples"):
        harness.spread([])


def test_table_text_reads_back_through_plot():
    table = harness.Table(
        title="step time, 2 ranks",
        name_header="engine",
        columns=(("s/step", ".3f"), ("min", ".3f"), ("max", ".3f"), ("x DDP", ".2f")),
        rows=(("DDP", (0.1, 0.09, 0.12, 1.0)), ("fzero stage 3", (0.2, 0.18, 0.25, None))),
        notes=("(a note)",),
    )
    header, names, values = plot.parse_table(table.text())
    assert header == ["s/step", "min", "max", "x DDP"]
    assert names == ["DDP", "fzero stage 3"]
    assert values[0] == [0.1, 0.09, 0.12, 1.0]
    assert values[1][:3] == [0.2, 0.18, 0.25] and values[1][3] != values[1][3]  # "-": nan
    assert plot.spread_column(header) == (0, True)


def test_table_rejects_a_row_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"row 'DDP' has 1 cells; expected 2 \(s/step, min\)"):
        harness.Table("t", "engine", (("s/step", ".3f"), ("min", ".3f")), (("DDP", (0.1,)),))


def test_rows_run_in_their_own_processes_interleaved(tmp_path, monkeypatch):
    log = tmp_path / "order.log"
    monkeypatch.setenv("RANK", "1")  # an outer launcher's: a row must not see it
    code = (
        "import json, os, sys; open(sys.argv[2], 'a').write(sys.argv[1] + ' ');"
        "json.dump({'pid': os.getpid(), 'rank': os.environ.get('RANK')}, open(sys.argv[3], 'w'))"
    )
    results = harness.run_rows(
        ["A", "B"], lambda name, out: [sys.executable, "-c", code, name, str(log), out], rounds=3
    )
    assert log.read_text().split() == ["A", "B"] * 3
    pids = [r["pid"] for rounds in results.values() for r in rounds]
    assert len(set(pids)) == 6
    assert all(r["rank"] is None for rounds in results.values() for r in rounds)


def test_a_failing_row_stops_with_its_output():
    code = "import sys; print('no such engine', file=sys.stderr); sys.exit(3)"
    with pytest.raises(SystemExit, match=r"row 'A', round 1: exit code 3\n.*no such engine"):
        harness.run_rows(["A"], lambda name, out: [sys.executable, "-c", code], rounds=1)


def test_report_appends_a_table_the_results_reader_finds(tmp_path, capsys):
    results = tmp_path / "results.md"
    table = harness.Table("t", "kernel", (("ms", ".1f"),), (("copy", (1.5,)),))
    harness.report("one", table, str(results))
    harness.report("two", table, str(results))
    assert capsys.readouterr().out.splitlines()[:3] == ["t", "kernel   ms", "copy    1.5"]
    tables = plot.read_results(str(results))
    assert list(tables) == ["one", "two"]
    assert plot.parse_table(tables["two"])[1:] == (["copy"], [[1.5]])


def test_a_kernel_faster_than_every_floor_pattern_is_marked_not_given_a_ratio():
    cpu_adam = load("cpu_adam")
    n = 1_000_000
    rows = [("floor: a", 28, None), ("floor: b", 8, None), ("kernel", 28, None)]
    # best pattern: 'b' at 8 B / 1 ms; 'kernel' moves 28 B in 3 ms, faster than 3.5 ms
    times = {"floor: a": [0.005, 0.004], "floor: b": [0.001, 0.002], "kernel": [0.003, 0.003]}
    args = argparse.Namespace(numel=n, threads=2, rounds=2)
    table = cpu_adam.table(args, rows, times)
    by_name = dict(table.rows)
    assert by_name["floor: a"][4] == pytest.approx(0.0045 / 0.0035)
    assert by_name["kernel (under floor)"][4] is None
    assert any(note.startswith("under floor: kernel moved 9.3 GB/s") for note in table.notes)
    assert "'b'" in table.notes[0]
    assert json.dumps(table.rows)  # plain values: the table can be saved
