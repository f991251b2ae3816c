"""`fzero.partition.comm_volume` predicts the collectives a step issues: the bytes and
calls a real run sends (counted by `fzero.comm.traffic`) equal it at every stage, with
accumulation, fp16, LAMB and stage 3's backward re-gathers."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import comm, partition
from fzero.partition import Manifest, PlanError, TensorSpec, comm_volume
from tests._dist import run_world
from tests.models import Net, global_batch


def plan(manifest, **options):
    """`partition.plan`, sharding every tensor of these tiny models at stage 3 unless a
    test says otherwise (DeepSpeed's default persistence threshold keeps them whole)."""
    built_in = (partition.flat_even, partition.per_tensor_dim0, partition.whole_tensors)
    if options.get("strategy", partition.flat_even) in built_in:
        options.setdefault("persistence_threshold", 0)
    return partition.plan(manifest, **options)


MICRO, ACCUM = 2, 2


def _by_operation(rows) -> dict[str, tuple[int, int]]:
    totals: dict[str, tuple[int, int]] = {}
    for r in rows:
        calls, size = totals.get(r.operation, (0, 0))
        totals[r.operation] = (calls + r.calls, size + r.bytes)
    return totals


def measured_case(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case: the traffic of 3 optimizer steps after 2 warm-up steps, per step, and
    the engine's `comm_volume()` (also recomputed from the pure function)."""
    out = {}
    for stage, precision, reuse, name, *strategy in cases:
        config = {
            "strategy": strategy[0] if strategy else "flat_even",
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "steps_per_print": 0,
            "optimizer": {"type": name, "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 300,
                "stage3_param_persistence_threshold": 100 if stage == 3 else 0,
                "stage3_max_reuse_distance": reuse,
            },
        }
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 8}  # no overflow
        torch.manual_seed(0)
        engine, *_ = fzero.initialize(model=Net(), config=config)

        def steps(count: int, first: int, engine=engine) -> None:
            for i in range(first, first + count):
                for _ in range(ACCUM):
                    x, y = global_batch(i, MICRO * world)
                    rows = slice(rank * MICRO, (rank + 1) * MICRO)
                    engine.backward(F.mse_loss(engine(x[rows]).float(), y[rows]))
                    engine.step()

        steps(2, 0)
        before = comm.traffic()
        steps(3, 2)
        after = comm.traffic()
        sent = {
            op: ((calls - before.get(op, (0, 0))[0]) // 3, (size - before.get(op, (0, 0))[1]) // 3)
            for op, (calls, size) in after.items()
            if (calls, size) != before.get(op, (0, 0))
        }
        predicted = engine.comm_volume()
        pure = comm_volume(
            engine.plan,
            accumulation_steps=ACCUM,
            param_dtype={"fp32": "float32", "fp16": "float16"}[precision],
            bucket_numel=300,
            scatter_as_all_reduce=True,  # gloo
            regathered=engine.gatherer.regathered,
            loss_scaling=precision == "fp16",
            optimizer=name.lower(),
            whole_tensors=_muon_takes(engine.plan) if name == "Muon" else (),
        )
        out[(stage, precision, reuse, name, *strategy)] = {
            "sent": sent,
            "predicted": _by_operation(predicted),
            "same": predicted == pure,
            "whats": {r.what for r in predicted},
            "regathered": sorted(engine.gatherer.regathered),
            "persistent": sum(u.persistent for u in engine.plan.units),
        }
        engine.destroy()
    return out


CASES = [
    (0, "fp32", 0, "AdamW"),
    (0, "fp32", 0, "Lamb"),  # no tensor-norm all-reduce: every rank's sums are whole
    (1, "fp32", 0, "AdamW"),
    (2, "fp16", 0, "AdamW"),
    (3, "fp32", 0, "AdamW"),  # units released after forward are gathered again
    (3, "fp16", 1_000_000_000, "Lamb"),  # every unit kept from forward into backward
    (1, "fp32", 0, "AdamW", "whole_tensors"),  # uneven shards: gathers padded on the wire
    (3, "fp32", 0, "AdamW", "whole_tensors"),
    # Muon's hidden matrices: their directions gathered whole once per step
    (1, "fp32", 0, "Muon"),
    (3, "fp32", 0, "Muon"),
    (2, "fp32", 0, "Muon", "whole_tensors"),  # each matrix on one rank: nothing gathered
]


def _muon_takes(plan) -> set[str]:
    """The tensors Muon updates whole by default: 2-D, not named embed or lm_head."""
    return {
        t.fqn
        for t in plan.manifest.tensors
        if len(t.shape) >= 2 and not any(w in t.fqn for w in ("embed", "lm_head"))
    }


def test_a_step_sends_what_comm_volume_predicts():
    results = run_world(measured_case, 2, CASES)
    for case, result in results.items():
        assert result["sent"] == result["predicted"], case
        assert result["same"], case
    assert results[(3, "fp32", 0, "AdamW")]["regathered"]  # the backward re-gathers counted
    assert results[(3, "fp16", 1_000_000_000, "Lamb")]["regathered"] == []
    assert results[(3, "fp16", 1_000_000_000, "Lamb")]["persistent"]  # persistent units too
    for case in [(1, "fp32", 0, "Muon"), (3, "fp32", 0, "Muon")]:
        assert "whole-tensor directions" in results[case]["whats"], case
    assert (
        "whole-tensor directions" not in results[(2, "fp32", 0, "Muon", "whole_tensors")]["whats"]
    )


def test_comm_volume_rows_by_stage():
    """Pure: which collectives each stage issues, their sizes and wire bytes."""
    manifest = Manifest((TensorSpec("a", (1024,)), TensorSpec("b", (1024,))))

    def rows(stage, **options):
        p = plan(manifest, world_size=4, stage=stage, unit_numel=1024)
        return {(r.operation, r.what): (r.calls, r.bytes) for r in comm_volume(p, **options)}

    assert rows(0) == {
        ("all_reduce", "gradients"): (1, 8192),
        ("all_reduce", "gradient norm"): (1, 8),
        ("all_reduce", "left-over gradients check"): (1, 4),
    }
    # ZeRO-1: once per step, each whole gradient reduced into the shards (half an
    # all-reduce's wire bytes: the ZeRO paper's ZeRO-1), or on gloo the bucket all-reduced
    stage1 = rows(1, accumulation_steps=3)
    assert stage1[("reduce_scatter", "gradients")] == (2, 8192)
    assert ("all_reduce", "gradients") not in stage1
    assert rows(1, scatter_as_all_reduce=True)[("all_reduce", "gradients")] == (1, 8192)
    p1 = plan(manifest, world_size=4, stage=1, unit_numel=1024)
    wire = {r.what: r.wire_bytes for r in comm_volume(p1) if r.operation != "all_reduce"}
    assert wire["gradients"] == wire["parameters after the update"] == 8192 * 3 // 4
    stage2 = rows(2, accumulation_steps=3, param_dtype="bfloat16")
    assert stage2[("reduce_scatter", "gradients")] == (6, 3 * 8192)
    assert stage2[("all_gather", "parameters after the update")] == (2, 4096)
    assert stage2[("all_reduce", "left-over gradients check")] == (3, 12)
    stage3 = rows(3, regathered=[1], param_dtype="bfloat16")
    assert stage3[("all_gather", "parameters for forward")] == (2, 4096)
    assert stage3[("all_gather", "parameters for backward")] == (1, 2048)
    assert ("all_gather", "parameters after the update") not in stage3
    p = plan(manifest, world_size=4, stage=3, unit_numel=1024)
    grads = next(r for r in comm_volume(p) if r.what == "gradients")
    assert grads.wire_bytes == 8192 * 3 // 4
    norm = next(r for r in comm_volume(p) if r.what == "gradient norm")
    assert norm.wire_bytes == 2 * (8 * 3 // 4)
    assert comm_volume(plan(manifest, world_size=1, stage=3)) == []
    with pytest.raises(PlanError, match="accumulation_steps is 0"):
        comm_volume(p, accumulation_steps=0)
    with pytest.raises(PlanError, match="regathered names units stage 3 does not gather"):
        comm_volume(plan(manifest, world_size=4, stage=2), regathered=[0])
    # qgZ: one bucket of 4 x 512 elements (each rank's 256 of both units): 2 blocks a rank,
    # codes (256 bytes in int8, 128 in int4) and a 4-byte scale per block
    assert rows(2, quantized_gradients=True)[("all_to_all", "gradients (int8)")] == (2, 2080)
    int4 = rows(2, quantized_gradients=True, quantized_gradient_bits=4)
    assert int4[("all_to_all", "gradients (int4)")] == (2, 1056)
    with pytest.raises(PlanError, match=r"quantized_gradient_bits is 2; allowed: \[4, 8\]"):
        comm_volume(p, quantized_gradients=True, quantized_gradient_bits=2)


def metrics_case(rank: int, world: int, path: str) -> None:
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1, "metrics_file": path}
    engine = fzero.shard(Net(), stage=2, config=config)
    for i in range(2):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    engine.destroy()


def test_the_metrics_file_has_the_bytes_each_report_moved(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run_world(metrics_case, 2, str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    numel = sum(u.numel for u in plan(fzero.partition.describe(Net()), world_size=2, stage=2).units)
    second = records[1]["comm_bytes"]
    # a step: gradients (all-reduced on gloo), new parameters, the norm and the check,
    # plus the previous report's own two all-reduces (tokens, memory: 8 + 24 bytes)
    assert second["all_gather"] == numel * 4
    assert second["all_reduce"] == numel * 4 + 8 + 4 + 32


def large_gather_case(rank: int, world: int) -> dict[str, Any]:
    staged = []
    dist = torch.distributed
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)  # what `comm.all_gather_into` calls for one all-gather

    def spy(output, shard, **kwargs):
        staged.append(output.numel())
        return real(output, shard, **kwargs)

    def part(r: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype)

    comm.init_distributed()
    setattr(dist, name, spy)
    got: dict[str, Any] = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (comm.UNSTAGED_BYTES // dtype.itemsize, 4):  # a rank's 1 MiB; tiny
                before = comm.traffic().get("all_gather", (0, 0))
                whole = torch.empty(numel * world, dtype=dtype)
                work = comm.all_gather_into(
                    whole, part(rank, numel, dtype), async_op=True, what="a gather"
                )
                work.wait()
                calls, size = comm.traffic()["all_gather"]
                expected = torch.cat([part(r, numel, dtype) for r in range(world)])
                got[f"{dtype} {numel}"] = (
                    bool(torch.equal(whole, expected)),
                    calls - before[0],
                    size - before[1],
                )
        try:  # an output of the wrong size: named, not gathered into part of it
            comm.all_gather_into(torch.empty(2**20), torch.ones(2**18), what="a bad gather")
        except ValueError as error:
            got["wrong size"] = str(error)
    finally:
        setattr(dist, name, real)
        dist.destroy_process_group()
    got["staged"] = staged
    return got


def test_a_large_gather_over_gloo_is_one_counted_all_gather_without_gloos_staged_copy():
    """Gloo's all-gather copies its whole output once more (a 98 MB gather held 196 MB):
    an output of `UNSTAGED_BYTES` or more is one broadcast per rank into its slice, the
    same values, counted as the one all-gather it is; smaller ones stay one all-gather."""
    got = run_world(large_gather_case, 2)
    mib = comm.UNSTAGED_BYTES
    assert got == {
        f"torch.float32 {mib // 4}": (True, 1, 2 * mib),
        "torch.float32 4": (True, 1, 32),
        f"torch.bfloat16 {mib // 2}": (True, 1, 2 * mib),
        "torch.bfloat16 4": (True, 1, 16),
        "staged": [8, 8],  # only the tiny gathers took gloo's all-gather
        "wrong size": "all_gather_into (a bad gather): the output has 1,048,576 elements; "
        "expected the world size 2 x the shard's 262,144 = 524,288",
    }
