"""Plans on a mesh run through both doors: 4 processes as a 2x2 mesh ("node" x "local").

Every preset (ZeRO-3 over the mesh, MiCS/HSDP, hpZ) and user plans that mix placements
equal a single-process torch.optim run and each other; a MiCS run resumes bitwise; its
checkpoint restores exactly as plain ZeRO-3 on 2 processes and then on 1.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fzero
from fzero import partition
from fzero.partition import Custom, Mesh, UnitSharding
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, STEPS, LR = 2, 4, 1e-2
MESH = Mesh({"node": 2, "local": 2})
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "steps_per_print": 0,
    "gradient_clipping": 0.05,
    "zero_optimization": {"reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
}


def _mixed(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """The first layer's parameters whole on every rank (its gradients and optimizer
    state still split within the node); the rest MiCS within the node."""
    local = mesh.sharding("local")
    params = mesh.replicated if unit.module.startswith("embed") else local
    return UnitSharding(params, local, local)


def _hsdp2(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """ZeRO-2 within the node, replicated across nodes (HSDP with whole parameters)."""
    local = mesh.sharding("local")
    return UnitSharding(mesh.replicated, local, local)


def _hsdp1(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """ZeRO-1 within the node: only the optimizer state split."""
    return UnitSharding(mesh.replicated, mesh.replicated, mesh.sharding("local"))


PRESETS = {
    "zero3": "zero3",
    "mics": "mics",
    "hpz": "hpz",
    "mixed": Custom("mixed", _mixed),
    # MiCS over both axes, gathered one axis at a time (mics_hierarchical_params_gather)
    "hierarchical": partition.MiCS(("node", "local"), hierarchical_params_gather=True),
    "hsdp2": Custom("hsdp2", _hsdp2, stage=2),
    "hsdp1": Custom("hsdp1", _hsdp1, stage=1),
}


def _mesh_strategy(preset):
    def strategy(manifest, *, world_size, stage, **options):
        return partition.mesh_plan(manifest, MESH, PRESETS[preset], **options)

    return strategy


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * MESH.size)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rows(rank: int) -> slice:
    return slice(rank * MICRO, (rank + 1) * MICRO)


def _engine(preset: str, zero: dict | None = None, accumulation: int = 1):
    torch.manual_seed(0)
    model = Net()
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **(zero or {})}}
    config["gradient_accumulation_steps"] = accumulation
    stage = {"hsdp2": 2, "hsdp1": 1}.get(preset, 3)
    return fzero.shard(
        model,
        stage=stage,
        optimizer=fzero.optim.adamw(lr=LR, weight_decay=0.01),
        config=config,
        strategy=_mesh_strategy(preset) if preset in PRESETS else None,
    )


def _train_engine(engine, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = global_batch(step, MICRO * MESH.size)
        loss = torch.nn.functional.mse_loss(engine(x[_rows(rank)]), y[_rows(rank)])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / MESH.size)
    return losses


def _train_step(rank: int, preset: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    stage = {"hsdp2": 2, "hsdp1": 1}.get(preset, 3)
    manifest = partition.describe(model)
    threshold = CONFIG["zero_optimization"]["stage3_param_persistence_threshold"]
    plan = partition.mesh_plan(manifest, MESH, PRESETS[preset], persistence_threshold=threshold)
    optimizer = fzero.optim.adamw(lr=LR, weight_decay=0.01)
    state = fzero.init(model, plan, optimizer, config=CONFIG)
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], "stage": stage}}

    def loss_fn(params, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step_fn = fzero.train_step(loss_fn, plan, optimizer, config)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * MESH.size)
        state, metrics = step_fn(state, (x[_rows(rank)], y[_rows(rank)]))
        total = metrics["loss"].detach().clone().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / MESH.size)
    weights = fzero.state_dict(state)
    assert bool(weights) == (rank == 0)  # process 2 is plan rank 0 too (MiCS): it gets {}
    return losses, weights


def _every_case(rank: int, world: int) -> dict:
    results = {}
    for preset in PRESETS:
        engine = _engine(preset)
        losses = _train_engine(engine, rank, range(STEPS))
        results[("engine", preset)] = (losses, engine.state_dict(dtype=torch.float32))
        results[("train_step", preset)] = _train_step(rank, preset)
    for key, zero in (("mics_shard_size", {"mics_shard_size": 2}),
                      ("zero_hpz_partition_size", {"zero_hpz_partition_size": 2})):  # fmt: skip
        engine = _engine("from the config", {"stage": 3, **zero})
        results[("config", key)] = (
            _train_engine(engine, rank, range(STEPS)),
            engine.state_dict(dtype=torch.float32),
        )
        results[("mesh", key)] = (engine.plan.mesh.preset, engine.plan.mesh.shard)
    return results


def _mics_case(
    rank: int, world: int, zero: dict | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    if zero is None:
        engine = _engine("from the config", {"stage": 3, "mics_shard_size": 2})
    else:  # two nodes of two ranks, as DeepSpeed reads them
        os.environ["NDEV_PER_NODE"] = "2"
        engine = _engine("from the config", zero)
    return _train_engine(engine, rank, range(STEPS)), engine.state_dict(dtype=torch.float32)


HIERARCHICAL = {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": True}


@pytest.mark.parametrize("zero", [None, HIERARCHICAL], ids=["mics", "hierarchical"])
def test_mics_from_deepspeed_keys_at_2x2_matches_torch_optim(zero):
    """The quick cases (`make test`): MiCS, and MiCS's hierarchical gather over two nodes
    of two ranks (one all-gather per axis); every preset and both doors are the slow
    test's."""
    losses, state = run_world(_mics_case, MESH.size, zero)
    ref_losses, ref_state = reference()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7)
    for name, expected in ref_state.items():
        assert ((state[name] - expected).abs().max() / expected.abs().max()).item() <= 1e-6


@pytest.mark.slow
def test_every_preset_and_mixed_plans_at_2x2_match_torch_optim_through_both_doors():
    results = run_world(_every_case, MESH.size)
    ref_losses, ref_state = reference()
    assert results.pop(("mesh", "mics_shard_size")) == ("mics", ("shard",))
    assert results.pop(("mesh", "zero_hpz_partition_size")) == ("hpz", ("node", "local"))
    first = None
    for case, (losses, state) in results.items():
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7, msg=str(case))
        assert state.keys() == ref_state.keys()
        for name, expected in ref_state.items():
            error = ((state[name] - expected).abs().max() / expected.abs().max()).item()
            assert error <= 1e-6, (case, name, error)
        if first is None:
            first = state
        for name in ref_state:  # and each other
            torch.testing.assert_close(state[name], first[name], rtol=1e-6, atol=1e-7)


def _traffic_case(
    rank: int, world: int, preset: str, accumulation: int, zero: dict | None = None
) -> dict:
    stage = {"hsdp2": 2, "hsdp1": 1}.get(preset, 3)
    zero = {"stage": stage, "stage3_max_reuse_distance": 0, **(zero or {})}
    engine = _engine(preset, zero, accumulation)
    rows = range(accumulation)
    _train_engine(engine, rank, rows)  # the first step records the trace
    before = fzero.comm.traffic_by_group()
    _train_engine(engine, rank, rows)
    after = fzero.comm.traffic_by_group()
    sent = {
        (group, op): after[group][op][1] - before.get(group, {}).get(op, (0, 0))[1]
        for group, ops in after.items()
        for op in ops
    }
    predicted: dict = {}
    for row in engine.comm_volume():
        group = "world" if row.axes == MESH.names else "+".join(row.axes)
        predicted[(group, row.operation)] = predicted.get((group, row.operation), 0) + row.bytes
    losses = _train_engine(engine, rank, range(2, 2 + 4 * accumulation))
    return {"sent": {k: v for k, v in sent.items() if v}, "predicted": predicted, "loss": losses}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mics", "hpz", "hsdp2", "hsdp1", "mixed", "hierarchical"])
def test_mesh_collectives_run_on_their_axes_as_comm_volume_predicts(preset):
    """Bytes per group and operation of a step equal `engine.comm_volume()` (2
    micro-steps, units released after forward: `stage3_max_reuse_distance` 0). MiCS
    keeps parameter gathers inside the node and sends gradient shards across; hpZ's
    backward gathers stay inside the node."""
    moved = run_world(_traffic_case, MESH.size, preset, 2)
    assert moved["sent"] == moved["predicted"]
    sent = moved["sent"]
    if preset == "mics":
        assert sent[("local", "all_gather")] > 0 and ("node", "all_gather") not in sent
        assert 0 < sent[("node", "all_reduce")] * 2 <= sent[("local", "all_reduce")]
    if preset == "hpz":
        assert sent[("local", "all_gather")] > 0  # backward, from the secondary copy
        assert sent[("world", "all_gather")] > 0  # forward, from the primary shards
    if preset == "hsdp1":  # ZeRO-1 in the node: reduced into the node's shards, then across
        assert 0 < sent[("node", "all_reduce")] * 2 <= sent[("local", "all_reduce")]
    if preset == "hierarchical":  # one gather per axis, the outermost first
        assert sent[("node", "all_gather")] * 2 == sent[("local", "all_gather")]
        assert ("world", "all_gather") not in sent


def _resume_case(rank: int, world: int, directory: str, preset: str) -> dict:
    engine = _engine(preset)
    _train_engine(engine, rank, range(2))
    engine.save_checkpoint(directory, tag="s2")
    _train_engine(engine, rank, range(2, STEPS))
    straight = engine.state_dict(dtype=torch.float32)
    again = _engine(preset)
    again.load_checkpoint(directory, tag="s2")
    _train_engine(again, rank, range(2, STEPS))
    return {"straight": straight, "resumed": again.state_dict(dtype=torch.float32)}


def _reshard_case(rank: int, world: int, source: str, target: str, tag: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    engine = fzero.shard(
        model,
        stage=3,
        optimizer=fzero.optim.adamw(lr=LR, weight_decay=0.01),
        config=CONFIG,
    )
    engine.load_checkpoint(source, tag=tag)
    engine.save_checkpoint(target, tag="moved")
    return engine.state_dict(dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mics", "hpz"])
def test_a_mesh_run_resumes_bitwise_and_its_checkpoint_moves_to_world_2_then_1(tmp_path, preset):
    out = run_world(_resume_case, MESH.size, str(tmp_path / "mesh"), preset)
    for name, value in out["straight"].items():
        assert torch.equal(value, out["resumed"][name]), name
    report, intact = fzero.checkpoint.inspect(str(tmp_path / "mesh"))
    assert intact, report
    described = {
        "mics": "preset mics on mesh node=2 x local=2, split over local, 2 replicas over node",
        "hpz": "preset hpz on mesh node=2 x local=2, split over node+local, hpZ secondary over "
        "local",
    }
    assert described[preset] in report, report
    at2 = run_world(_reshard_case, 2, str(tmp_path / "mesh"), str(tmp_path / "w2"), "s2")
    at1 = run_world(_reshard_case, 1, str(tmp_path / "w2"), str(tmp_path / "w1"), "moved")
    saved = fzero.checkpoint.consolidated_state_dict(str(tmp_path / "mesh"), tag="s2")
    for name, value in saved.items():
        assert torch.equal(at2[name], value.float()), name
        assert torch.equal(at1[name], value.float()), name


ZERO_PLUS_PLUS = {"zero_quantized_weights": True, "zero_quantized_gradients": True}


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_zero_plus_plus_on_a_mesh_sends_what_comm_volume_predicts(bits):
    """ZeRO++ whole (hpZ, qwZ and qgZ) at 2x2: forward gathers int8 over the world,
    backward from the in-node secondary copy, gradients reduced hierarchically — int8 or
    int4 blocks inside the node, then what is already summed there across nodes — bytes
    per group as `comm_volume` says, each step's loss within 2% (int8) or 5% (int4) of the
    exact run's on this small net (`benchmarks/quantized.py` measures 300 steps)."""
    zero = {**ZERO_PLUS_PLUS, "zero_quantized_gradients_bits": bits}
    quantized = run_world(_traffic_case, MESH.size, "hpz", 2, zero)
    exact = run_world(_traffic_case, MESH.size, "hpz", 2)
    assert quantized["sent"] == quantized["predicted"]
    sent = quantized["sent"]
    assert sent[("local", "all_to_all")] > 0 and sent[("node", "all_to_all")] > 0  # two hops
    assert sent[("node", "all_to_all")] <= sent[("local", "all_to_all")]  # blocks of 256
    assert ("world", "all_to_all") not in sent and ("world", "all_reduce") in sent  # norm
    rtol = {8: 2e-2, 4: 5e-2}[bits]
    torch.testing.assert_close(quantized["loss"], exact["loss"], rtol=rtol, atol=0)
