"""`partition.comm_time`: a step's collectives over link bandwidths (pure), and
`fzero estimate`'s worst rank and modelled time."""

from __future__ import annotations

import math

import pytest

from fzero import partition
from fzero.cli.estimate import estimate, estimate_mesh, format_estimate, worst_rank
from fzero.partition import Collective, Link, Manifest, Mesh, PlanError, TensorSpec, parse_link


def test_links_parse_bits_bytes_and_latency():
    assert parse_link("25Gbps") == Link(25e9 / 8)
    assert parse_link("25 Gb/s") == Link(25e9 / 8)
    assert parse_link("400GBps") == Link(400e9)
    assert parse_link("400 GB/s@2us") == Link(400e9, 2e-6)
    assert parse_link("1.5e9") == Link(1.5e9)
    assert parse_link(12.5e9) == Link(12.5e9)
    assert parse_link("100Mbps@1ms").latency == pytest.approx(1e-3)
    for bad in ("fast", "-3GBps", 0, "25Gbps@soon"):
        with pytest.raises(PlanError, match="link"):
            parse_link(bad)


def _row(operation: str, world: int, size: int, axes: tuple[str, ...] = ()) -> Collective:
    return Collective(operation, "x", 1, size, world, axes)


def test_ring_and_tree_times_follow_the_stated_formulas():
    links = {"world": Link(1000.0, 0.5)}
    (gather,) = partition.comm_time([_row("all_gather", 4, 4000)], links=links)
    assert gather.seconds == pytest.approx(3 * 0.5 + 3 / 4 * 4000 / 1000)
    (ring,) = partition.comm_time([_row("all_reduce", 4, 4000)], links=links)
    assert ring.seconds == pytest.approx(2 * (3 * 0.5 + 3 / 4 * 4000 / 1000))
    (tree,) = partition.comm_time([_row("all_reduce", 4, 4000)], links=links, algorithm="tree")
    assert tree.seconds == pytest.approx(2 * math.log2(4) * 0.5 + 2 * 4000 / 1000)
    (one,) = partition.comm_time([_row("all_reduce", 1, 4000)], links=links)
    assert one.seconds == 0.0
    exchange = Collective("all_to_all", "x", 2, 4000, 4, exchange=True)  # a permutation
    (moved,) = partition.comm_time([exchange], links=links)
    assert exchange.wire_bytes == 4000 and moved.seconds == pytest.approx(2 * 0.5 + 4000 / 1000)
    with pytest.raises(PlanError, match="algorithm is 'mesh'"):
        partition.comm_time([], links=links, algorithm="mesh")


def test_a_collective_over_several_axes_runs_at_the_slowest_link():
    links = {"node": "8GBps", "local": "800GBps"}
    (row,) = partition.comm_time(
        [_row("reduce_scatter", 16, 16_000, ("node", "local"))], links=links
    )
    assert row.seconds == pytest.approx(15 * 5e-6 + 15 / 16 * 16_000 / 8e9)
    with pytest.raises(PlanError, match=r"no entry for axis 'node'.*known: \['local'\]"):
        partition.comm_time([_row("all_gather", 2, 8, ("node",))], links={"local": 1.0})


def _model(layers: int = 8, width: int = 256) -> Manifest:
    specs = []
    for i in range(layers):
        specs += [
            TensorSpec(f"layers.{i}.w", (4 * width, width), "float32"),
            TensorSpec(f"layers.{i}.b", (width,), "float32"),
        ]
    return Manifest(tuple(specs))


def test_a_plan_times_by_axes_and_mics_beats_zero3_on_a_slow_node_link():
    manifest, mesh = _model(), Mesh({"node": 4, "local": 8})
    links = {"node": "25Gbps", "local": "400GBps"}
    totals = {}
    for preset in ("zero3", "mics"):
        plan = partition.mesh_plan(manifest, mesh, preset)
        rows = partition.comm_time(plan, links=links, param_dtype="bfloat16")
        assert all(r.seconds >= 0 for r in rows)
        assert {r.axes for r in rows} <= {("node", "local"), ("local",), ("node",)}
        totals[preset] = sum(r.seconds for r in rows)
    assert totals["mics"] < totals["zero3"]
    text = partition.format_comm_time(rows)
    assert "total per step" in text and "over local" in text


def test_estimate_reports_the_worst_rank_of_an_uneven_plan_and_times():
    manifest = Manifest(
        (
            TensorSpec("big", (1000, 10), "float32"),
            TensorSpec("small", (10,), "float32"),
        )
    )
    uneven = partition.plan(manifest, world_size=2, stage=3, strategy=partition.whole_tensors)
    rank, memory = worst_rank(uneven, param_dtype="float32")
    other = partition.memory_per_rank(uneven, 1 - rank, param_dtype="float32")
    assert memory.device > other.device
    rows = estimate(
        manifest,
        [2],
        strategy=partition.whole_tensors,
        persistence_threshold=0,
        links={"world": "10GBps"},
    )
    stage3 = next(r for r in rows if r.stage == 3 and not r.offload_optimizer)
    assert stage3.rank == rank and stage3.comm_seconds and stage3.comm_seconds > 0
    assert "worst rank" in format_estimate(rows, manifest.numel)
    mesh_rows = estimate_mesh(
        _model(), Mesh({"node": 2, "local": 2}), ["mics"], links={"node": 1e9, "local": 1e11}
    )
    assert mesh_rows[0].seconds and set(mesh_rows[0].seconds) >= {("local",)}


def test_the_command_prints_the_modelled_time(capsys):
    from fzero.cli import main

    args = ["estimate", "--params", "7.5e9", "--mesh", "node=8,local=8", "--preset", "mics"]
    assert main([*args, "--links", "node=25Gbps,local=400GBps"]) == 0
    out = capsys.readouterr().out
    assert "modelled communication per step" in out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert any(line.startswith("mics total ") for line in lines)
    assert main([*args, "--links", "node"]) == 1
    assert "--links item 'node' is not axis=bandwidth" in capsys.readouterr().err
    assert main([*args, "--links", "node=25Gbps"]) == 1
    assert "no entry for axis 'local'" in capsys.readouterr().err
