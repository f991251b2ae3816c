"""Uneven and whole-tensor shards (`Unit.bounds`, `partition.whole_tensors`): every tensor
whole on one rank, no padding, some ranks holding nothing of a unit; both doors train it
as torch.optim does, Muon runs Newton-Schulz on the matrices a rank owns without a
gather, and its checkpoints move to even plans exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero.core.whole_tensors
from fzero import partition
from fzero.partition import Plan, PlanError
from fzero.partition._mesh_plan import as_kind_plan
from tests._dist import run_world
from tests.models import Net, global_batch
from tests.test_muon import HP, reference_run

MICRO, STEPS, LR = 2, 4, 1e-2


def test_whole_tensors_splits_no_tensor_pads_nothing_and_reports_the_imbalance():
    manifest = partition.describe(Net())
    plan = partition.plan(manifest, world_size=4, stage=3, strategy=partition.whole_tensors)
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    for unit in plan.units:
        assert unit.bounds[0] == 0 and unit.bounds[-1] == unit.numel  # no padding
        assert unit.numel == sum(pc.numel for pl in unit.placements for pc in pl.pieces)
        for pl in unit.placements:
            owners = {unit.owner(pc.offset) for pc in pl.pieces}
            owners |= {unit.owner(pc.offset + pc.numel - 1) for pc in pl.pieces}
            assert len(owners) == 1, pl.fqn  # whole on one rank
            spec = plan.manifest[pl.fqn]
            assert partition.owner_of(plan, pl.fqn, spec.numel - 1) == owners.pop()
    # the biggest tensor of a block first, to rank 0; the others to the emptiest rank
    block = plan.units[1]
    assert [block.shard_size(r) for r in range(4)] == [169, 13, 13, 13]
    head = plan.units[3]
    assert [head.shard_size(r) for r in range(4)] == [39, 3, 0, 0]
    memory = [partition.memory_per_rank(plan, r).optimizer_state for r in range(4)]
    assert sum(memory) == 8 * manifest.numel  # Adam's two fp32 moments, each element once
    text = partition.format_plan(plan)
    assert "shard=uneven, at most 39" in text and "rank 3: (none)" in text
    assert "padding: 0 elements" in text and "imbalance 3.33x" in text


def test_uneven_units_on_a_mesh_hold_their_bounds_per_process():
    """Owners within the node, replicas across it: each process holds its plan rank's
    uneven part, as the same plan of the node alone says."""
    world = partition.plan(
        partition.describe(Net()), world_size=2, stage=3, strategy=partition.whole_tensors
    )
    on = partition.OnMesh((("node", 2), ("local", 2)), ("local",))
    plan = partition.validate(dataclasses.replace(world, mesh=on))
    held = [partition.memory_per_rank(plan, process) for process in range(4)]
    assert held == [partition.memory_per_rank(world, process % 2) for process in range(4)]
    assert held[0] != held[1]  # uneven: the owners hold different amounts
    for process, unit in zip(range(4), plan.units):
        assert plan.kind_range(unit, "optimizer", process) == unit.shard_range(process % 2)


def test_bad_bounds_are_refused_by_name():
    manifest = partition.describe(Net())
    plan = partition.plan(manifest, world_size=2, stage=2, strategy=partition.whole_tensors)
    unit = plan.units[0]
    broken = [unit.__class__(**{**unit.__dict__, "bounds": (0, 200, 104)})]
    with pytest.raises(PlanError, match="unit 'embed': bounds \\[0, 200, 104\\] are not 3"):
        partition.validate(Plan(manifest, 2, 2, 16, (*broken, *plan.units[1:]), "x"))
    with pytest.raises(PlanError, match="uneven shards"):  # no equal blocks per kind
        as_kind_plan(plan)


def _config(stage: int) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "zero_optimization": zero,
    }


def _doors(rank: int, world: int, stage: int, optimizer, strategy: str):
    """Both doors under `strategy`, the same micro-batches; (losses, states)."""
    config = {**_config(stage), "strategy": strategy}
    torch.manual_seed(0)
    engine = fzero.shard(Net(), optimizer=optimizer, config=config)
    torch.manual_seed(0)
    model = Net()
    plan = partition.plan(
        partition.describe(model),
        world_size=world,
        stage=stage,
        strategy=partition.strategy_from_name(strategy),
        persistence_threshold=0,
    )
    assert plan == engine.plan
    state = fzero.init(model, plan, optimizer, config=config)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    losses = []
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        state, metrics = step(state, (x[rows], y[rows]))
        losses.append((loss.item(), metrics["loss"].item()))
    return losses, engine.state_dict(dtype=torch.float32), fzero.state_dict(state)


def _adamw_cases(rank: int, world: int) -> dict:
    return {
        stage: _doors(
            rank, world, stage, fzero.optim.adamw(lr=LR, weight_decay=0.01), "whole_tensors"
        )
        for stage in (1, 2, 3)
    }


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * WORLD)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


WORLD = 4


def test_whole_tensors_at_stages_1_to_3_match_torch_optim_through_both_doors():
    """World 4 (ranks that hold nothing of a unit): engine and train_step bitwise alike,
    both equal to torch.optim within fp32 rounding."""
    results = run_world(_adamw_cases, WORLD)
    reference = _reference()
    for stage, (losses, engine, functional) in results.items():
        assert all(a == b for a, b in losses), stage
        for name, expected in reference.items():
            assert torch.equal(engine[name], functional[name]), (stage, name)
            error = ((engine[name] - expected).abs().max() / expected.abs().max()).item()
            assert error <= 1e-6, (stage, name, error)


def _muon_case(rank: int, world: int, strategy: str) -> dict:
    gathers = []
    original = fzero.core.whole_tensors.gather_optimizer_shards

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    fzero.core.whole_tensors.gather_optimizer_shards = counting
    try:
        optimizer = fzero.optim.muon(ns_dtype="fp32", **HP)
        config = {**_config(2), "strategy": strategy}
        torch.manual_seed(0)
        engine = fzero.shard(Net(), optimizer=optimizer, config=config)
        for i in range(3):
            x, y = global_batch(i, MICRO * world)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    finally:
        fzero.core.whole_tensors.gather_optimizer_shards = original
    return {"state": engine.state_dict(dtype=torch.float32), "gathers": len(gathers)}


def test_muon_on_whole_matrices_needs_no_gather_and_matches_the_reference():
    """Stage 2, world 2: with `whole_tensors` each rank runs Newton-Schulz on the hidden
    matrices it owns (no gather of momentum directions; `flat_even` gathers each unit);
    both equal the single-process Muon reference."""
    whole = run_world(_muon_case, 2, "whole_tensors")
    flat = run_world(_muon_case, 2, "flat_even")
    assert whole["gathers"] == 0 and flat["gathers"] > 0
    reference = reference_run(2)
    for name, value in reference.items():
        torch.testing.assert_close(whole["state"][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(flat["state"][name], value, rtol=1e-5, atol=1e-6)


def _save(rank: int, world: int, directory: str) -> dict:
    config = {**_config(3), "strategy": "whole_tensors"}
    torch.manual_seed(0)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    for i in range(2):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    engine.save_checkpoint(directory, tag="t")
    return engine.state_dict(dtype=torch.float32)


def _load(rank: int, world: int, directory: str, strategy: str) -> dict:
    config = {**_config(3), "strategy": strategy}
    torch.manual_seed(1)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    engine.load_checkpoint(directory, tag="t")
    return engine.state_dict(dtype=torch.float32)


def test_a_whole_tensors_checkpoint_moves_to_even_plans_and_back_exactly(tmp_path):
    saved = run_world(_save, 4, str(tmp_path))
    for world, strategy in ((1, "flat_even"), (2, "per_tensor_dim0"), (3, "whole_tensors")):
        loaded = run_world(_load, world, str(tmp_path), strategy)
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (world, strategy, name)


# ---- owners pay owner prices ----------------------------------------------------------------


def block_owners(manifest: partition.Manifest, *, world_size: int, stage: int, **options):
    """A cost model's plan: each unit (a block) whole on one rank, round-robin; no
    padding."""
    even = partition.flat_even(manifest, world_size=world_size, stage=stage, **options)
    units = []
    for index, unit in enumerate(even.units):
        owner = index % world_size
        numel = sum(pc.numel for pl in unit.placements for pc in pl.pieces)
        bounds = tuple(0 if r <= owner else numel for r in range(world_size + 1))
        units.append(dataclasses.replace(unit, numel=numel, shard_numel=numel, bounds=bounds))
    return dataclasses.replace(even, units=tuple(units), strategy="block_owners")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gloo", [False, True])
def test_a_block_owner_plan_moves_no_more_than_zero3(world, gloo):
    """Pure: a unit whole on one rank is broadcast from it and its gradient reduced to it
    (no padded all-gather, no all-reduce): per step the wire bytes of ZeRO-3 within 5%."""
    manifest = partition.describe(Net())
    options = {"persistence_threshold": 0}
    owners = partition.plan(manifest, world_size=world, stage=3, strategy=block_owners, **options)
    zero3 = partition.plan(manifest, world_size=world, stage=3, **options)
    assert all(u.bounds for u in owners.units)

    def wire(plan):
        rows = partition.comm_volume(
            plan, regathered=range(len(plan.units)), scatter_as_all_reduce=gloo
        )
        return sum(r.wire_bytes for r in rows), {r.operation for r in rows}

    owner_bytes, operations = wire(owners)
    zero3_bytes, _ = wire(zero3)
    assert owner_bytes <= 1.05 * zero3_bytes, (owner_bytes, zero3_bytes)
    assert {"broadcast", "reduce"} <= operations and "all_gather" not in operations


def _owner_case(rank: int, world: int, stage: int) -> dict:
    from fzero import comm

    strategy = "tests.test_uneven:block_owners"
    config = {**_config(stage), "strategy": strategy}
    torch.manual_seed(0)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    sent: dict[str, tuple[int, int]] = {}
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        before = comm.traffic()
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        after = comm.traffic()
        if i == STEPS - 1:  # a steady step: the first recorded the trace
            sent = {
                op: (calls - before.get(op, (0, 0))[0], size - before.get(op, (0, 0))[1])
                for op, (calls, size) in after.items()
                if (calls, size) != before.get(op, (0, 0))
            }
    predicted: dict[str, tuple[int, int]] = {}
    for row in engine.comm_volume():
        calls, size = predicted.get(row.operation, (0, 0))
        predicted[row.operation] = (calls + row.calls, size + row.bytes)
    return {"sent": sent, "predicted": predicted, "state": engine.state_dict(torch.float32)}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_block_owner_plan_trains_as_torch_optim_and_sends_what_comm_volume_says(stage):
    result = run_world(_owner_case, 2, stage)
    assert result["sent"] == result["predicted"]
    assert "broadcast" in result["sent"] and "all_gather" not in result["sent"]
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * 2)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for name, expected in model.state_dict().items():
        error = ((result["state"][name] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 1e-6, (name, error)
