"""Units of one plan split over different groups of mesh axes (`Unit.shard_axes`): MiCS
for the blocks (within the node, replicas across it) beside ZeRO-3 over the world for the
rest, ZeRO-1 embeddings within the node beside ZeRO-3 over the world. On 2x2 both doors
match a single-process torch.optim run, agree bitwise, hold what the plan says, send what
`comm_volume` says, resume bitwise and restore under plain ZeRO-3 at world 2 and 1."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import partition
from fzero.partition import Mesh, PlanError, UnitSharding
from tests._dist import run_world
from tests.models import Net
from tests.test_mixed_stages import (
    ACCUM,
    OPTIMIZERS,
    _config,
    _rows,
    check_against_torch,
    engine_resumes,
    restores_under_zero3,
    sent_and_predicted,
    state_resumes,
    train_both,
    uniform_case,
)

MESH = {"node": 2, "local": 2}
WORLD, LOCAL = ("node", "local"), ("local",)

# name -> the plan's stage, and per top-level module of `tests.models.Net`: (stage, axes
# of its split kinds[, the optimizer's axes where they are more])
CASES = {
    "mics blocks + zero3 rest": (3, {"blocks": (3, LOCAL)}, (3, WORLD)),
    "zero1 embed in node + zero3": (3, {"embed": (1, LOCAL)}, (3, WORLD)),
    "zero2 blocks in node + zero1 head + zero3 embed": (
        3,
        {"blocks": (2, LOCAL), "head": (1, WORLD)},
        (3, WORLD),
    ),
    # the optimizer split finer on some units only: the blocks' over the world beside
    # MiCS for the rest (in either order of the blocks' optimizer axes)
    "blocks' optimizer over the world + mics": (
        3,
        {"blocks": (3, LOCAL, ("local", "node"))},
        (3, LOCAL),
    ),
    "blocks' optimizer over node, local + zero1 head in node": (
        3,
        {"blocks": (3, LOCAL, WORLD), "head": (1, LOCAL)},
        (3, LOCAL),
    ),
}


def _preset(name: str) -> partition.Custom:
    stage, own, rest = CASES[name]

    def rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        unit_stage, axes, *optimizer = own.get(unit.module.split(".")[0], rest)
        split, whole = mesh.sharding(*axes), mesh.replicated
        return UnitSharding(
            params=split if unit_stage == 3 else whole,
            grads=split if unit_stage >= 2 else whole,
            optimizer=mesh.sharding(*optimizer[0]) if optimizer else split,
        )

    return partition.Custom(name.replace(" ", "_"), rule, stage=stage)


def _laid(name: str) -> partition.Plan:
    manifest = partition.describe(Net())
    return partition.mesh_plan(manifest, Mesh(MESH), _preset(name), persistence_threshold=0)


def _offloaded(stage: int, offload: str) -> dict:
    """The parity config at `stage` with the optimizer on the host ("cpu"), or it and
    stage 3's parameter shards in swap files ("nvme", in a new directory per process)."""
    config = _config(stage)
    zero = config["zero_optimization"]
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        path = tempfile.mkdtemp(prefix="fzero-own-axes-")
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        zero["offload_param"] = {"device": "nvme", "nvme_path": path}
        config["aio"] = {"block_size": 8192, "thread_count": 2}
    return config


def _engine(name: str, seed: int = 0, offload: str = "none", kind: str = "adamw"):
    stage = CASES[name][0]
    torch.manual_seed(seed)
    return fzero.shard(
        Net(),
        stage=stage,
        optimizer=OPTIMIZERS[kind](),
        config=_offloaded(stage, offload),
        strategy=partition.on_mesh(Mesh(MESH), _preset(name)),
    )


# ---- the plan alone -------------------------------------------------------------------------


def test_units_on_their_own_axes_lower_to_one_plan_whose_queries_follow_them():
    plan = partition.executable(_laid("mics blocks + zero3 rest"))
    assert plan.world_size == 4 and plan.mesh.shard == WORLD
    blocks = [u for u in plan.units if u.module.startswith("blocks")]
    assert blocks and all(u.shard_axes == LOCAL for u in blocks)
    assert all(u.shard_axes is None for u in plan.units if u not in blocks)
    block = blocks[0]
    assert block.shard_numel == block.numel // 2
    # plan ranks (node, local) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1): shard = local index
    assert [plan.shard_index(block, r) for r in range(4)] == [0, 1, 0, 1]
    assert [plan.unit_replica(block, r) for r in range(4)] == [0, 0, 1, 1]
    assert [plan.shard_writer(block, s) for s in (0, 1)] == [0, 1]
    # what each rank holds, and what it writes: each shard once
    held = {s.fqn for r in range(4) for s in partition.local_slices(plan, r) if s.unit == 1}
    assert held == {pl.fqn for pl in block.placements}
    written = [s for r in range(4) for s in partition.written_slices(plan, r) if s.unit == 1]
    assert sum(s.numel for s in written) == sum(
        pc.numel for pl in block.placements for pc in pl.pieces
    )
    # the wire format keeps the axes; lowering again gives the same plan
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    assert partition.executable(plan) is plan
    rows = partition.comm_volume(plan, accumulation_steps=2)
    axes = {(r.operation, r.what, r.axes) for r in rows}
    assert ("reduce_scatter", "gradients", LOCAL) in axes  # the blocks within the node
    assert ("reduce_scatter", "gradients", WORLD) in axes  # the rest over the world
    assert ("all_reduce", "gradients across replicas", ("node",)) in axes
    assert ("all_gather", "parameters for forward", LOCAL) in axes
    assert "over=local" in partition.format_plan(plan)
    assert partition.process_groups(plan) == (WORLD, LOCAL, ("node",))


def test_a_unit_on_its_own_axes_beside_a_finer_split_keeps_no_master_apart():
    """Beside units whose optimizer state is a quarter of their gradient half, a MiCS unit's
    optimizer, gradient and parameter shards are one half: its fp32 master is its
    parameter shard, as in any ZeRO-3 plan, and only the finer units' masters are apart
    (what a run holds: `memory_held() == memory_planned()` in the doors' tests)."""
    plan = _laid("blocks' optimizer over the world + mics")
    finer = [u for u in plan.units if plan.optimizer_finer(u)]
    own = [u for u in plan.units if u.shard_axes is not None]
    assert finer and own and all(not plan.optimizer_finer(u) for u in own)
    memory = partition.memory_per_rank(plan, 0)
    assert memory.master == sum(u.numel // 4 * 4 for u in finer)  # fp32 quarters only


def test_the_drawn_plan_shows_what_each_rank_holds_of_a_unit_on_its_own_axes():
    """`plot_plan`'s bars of the executable plan equal the mesh plan's, rank by rank:
    ranks 0 and 2 hold the same block of a MiCS unit, ranks 0 and 1 different ones."""
    from fzero.partition import _plot

    laid = _laid("mics blocks + zero3 rest")
    ran, said = _plot.plot_bars(partition.executable(laid)), _plot.plot_bars(laid)
    for kind in ("params", "grads", "optimizer"):
        assert ran[kind] == said[kind], kind


def test_a_unit_on_its_own_axes_is_refused_by_name_where_not_run():
    plan = partition.executable(_laid("mics blocks + zero3 rest"))
    units = list(plan.units)
    units[1] = dataclasses.replace(units[1], shard_axes=("node", "local"))
    with pytest.raises(PlanError, match=r"unit 'blocks.0': shard_axes is \('node', 'local'\)"):
        partition.validate(dataclasses.replace(plan, units=tuple(units)))
    numel = plan.units[1].numel
    bounds = tuple(numel * r // 4 for r in range(5))
    units[1] = dataclasses.replace(plan.units[1], bounds=bounds, shard_numel=numel // 4)
    with pytest.raises(PlanError, match=r"unit 'blocks\.0': split over .* with uneven bounds"):
        partition.validate(dataclasses.replace(plan, units=tuple(units)))

    def finer_beside(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        local = mesh.sharding("local")
        if unit.module.startswith("blocks"):  # the optimizer finer than its gradients
            return UnitSharding(params=local, grads=local, optimizer=mesh.sharding(*WORLD))
        every = mesh.sharding(*WORLD)
        return UnitSharding(params=every, grads=every, optimizer=every)

    with pytest.raises(PlanError, match=r"unit 'blocks\.0'"):
        partition.mesh_plan(
            partition.describe(Net()),
            Mesh(MESH),
            partition.Custom("x", finer_beside, stage=3),
            persistence_threshold=0,
        )


# ---- both doors against torch.optim ---------------------------------------------------------


def doors_case(
    rank: int, world: int, names: list[str], offload: str = "none", kind: str = "adamw"
) -> dict:
    out = {}
    for name in names:
        stage = CASES[name][0]
        engine = _engine(name, offload=offload, kind=kind)
        torch.manual_seed(0)
        model = Net()
        plan = partition.executable(_laid(name))
        assert engine.plan == partition.with_memory(plan, engine.plan.memory), name
        optimizer = OPTIMIZERS[kind]()
        config = _offloaded(stage, offload)  # parameters in a swap file: the engine's only
        config["zero_optimization"].pop("offload_param", None)
        losses, state = train_both(rank, world, engine, model, plan, optimizer, config)
        holdings = [  # (stage, numel, gradient shards, optimizer partition, held: grad, master)
            (
                plan.stage_of(u),
                u.numel,
                plan.shards_of(u),
                (lambda r: r[1] - r[0])(plan.shard_range(u, state.rank)),
                s.grad.numel(),
                s.master.numel(),
            )
            for u, s in zip(plan.units, state.units)
        ]
        out[name] = {
            "losses": losses,
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "held": engine.memory_held() == engine.memory_planned(),
            "holdings": holdings,
        }
        engine.destroy()
    return out


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_units_on_their_own_axes_match_torch_optim_in_both_doors_on_a_2x2_mesh(offload):
    """Every case in memory; the first three with the optimizer on the host, and with
    it and stage 3's parameters in swap files (beside a finer split the swap file's
    gradients are refused by name, as without units on their own axes)."""
    names = list(CASES) if offload == "none" else list(CASES)[:3]
    results = run_world(doors_case, 4, names, offload)
    errors = check_against_torch(results, 4)
    for name, result in results.items():
        splits = set()
        for stage, numel, parts, optimizer, grad, master in result["holdings"]:
            assert grad == (numel // parts if stage >= 2 else numel), (name, stage, numel)
            in_file = offload == "nvme"  # the master in the swap file
            assert master == (0 if in_file else optimizer), (name, stage, numel)
            splits.add((parts, numel // optimizer))
        assert len(splits) > 1, name  # units do split over different groups
    print("max abs error vs torch.optim, 2x2:", errors)


@pytest.mark.parametrize("kind", ["lamb", "norm_sgd", "muon"])
def test_tensor_norms_and_whole_tensors_beside_a_unit_on_its_own_axes(kind):
    """An optimizer that needs each tensor's whole norm (LAMB; `norm_sgd`, whose step
    scales with the norm itself, so a norm counted twice shows): a MiCS unit's shard is
    held by two plan ranks, whose sums count once. One that needs whole tensors (Muon's
    Newton-Schulz step): a MiCS unit's directions gathered within its group. Both doors
    agree bitwise and match a plain data-parallel (stage 0) run at world 4."""
    name = next(iter(CASES))
    result = run_world(doors_case, 4, [name], "none", kind)[name]
    engine_losses, step_losses = result["losses"]
    assert engine_losses == step_losses
    for key, expected in result["engine"].items():
        assert torch.equal(result["step"][key], expected), key
    uniform = run_world(uniform_case, 4, 0, kind)
    error = max((result["engine"][k] - v).abs().max().item() for k, v in uniform.items())
    assert error <= 1e-6, error


def traffic_case(rank: int, world: int, names: list[str], kind: str = "adamw") -> dict:
    out = {}
    for name in names:
        engine = _engine(name, kind=kind)
        out[name] = sent_and_predicted(rank, world, engine, 1, 2)
        engine.destroy()
    return out


def test_units_on_their_own_axes_send_what_comm_volume_predicts():
    for name, (sent, predicted) in run_world(traffic_case, 4, list(CASES)).items():
        assert sent == predicted, name
    # Muon: a MiCS unit's whole-tensor directions gathered within its group
    name = next(iter(CASES))
    sent, predicted = run_world(traffic_case, 4, [name], "muon")[name]
    assert sent == predicted, name


# ---- hpZ beside units on their own axes -----------------------------------------------------


def _hpz_rest(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """MiCS for the blocks (no copy: their primary is within the node), ZeRO-3 over the
    world for the rest with hpZ's secondary copy within the node."""
    if unit.module.startswith("blocks"):
        local = mesh.sharding(*LOCAL)
        return UnitSharding(local, local, local)
    world = mesh.sharding(*WORLD)
    return UnitSharding(world, world, world, params_secondary=mesh.sharding(*LOCAL))


def hpz_case(rank: int, world: int) -> dict:
    config = _config(3)
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0  # backward gathers again
    strategy = partition.on_mesh(Mesh(MESH), partition.Custom("hpz rest", _hpz_rest))

    def engine():
        torch.manual_seed(0)
        return fzero.shard(Net(), stage=3, optimizer=OPTIMIZERS["adamw"](), config=config,
                           strategy=strategy)  # fmt: skip

    first = engine()
    torch.manual_seed(0)
    model = Net()
    laid = partition.mesh_plan(
        partition.describe(model), Mesh(MESH), partition.Custom("hpz rest", _hpz_rest),
        persistence_threshold=0,
    )  # fmt: skip
    plan = partition.executable(laid)
    losses, state = train_both(rank, world, first, model, plan, OPTIMIZERS["adamw"](), config)
    result = {
        "losses": losses,
        "engine": first.state_dict(dtype=torch.float32),
        "step": fzero.state_dict(state, module=model),
        "held": first.memory_held() == first.memory_planned(),
        "secondary": first.plan.mesh.secondary,
        "own": [u.shard_axes for u in first.plan.units],
    }
    first.destroy()
    second = engine()
    result["traffic"] = sent_and_predicted(rank, world, second, 1, 2)
    second.destroy()
    return result


def test_hpz_beside_units_on_their_own_axes():
    """ZeRO-3 with hpZ's copy within the node beside MiCS blocks: within 1e-6 of
    torch.optim, both doors bitwise alike, the backward gathers within the node, and
    the traffic `comm_volume` predicts."""
    result = run_world(hpz_case, 4)
    assert result["secondary"] == LOCAL and LOCAL in result["own"] and None in result["own"]
    check_against_torch({"hpz rest": result}, 4)
    sent, predicted = result["traffic"]
    assert sent == predicted


def zero_plus_plus_case(rank: int, world: int, zero: dict) -> dict:
    """ZeRO++ (`zero`'s keys) for the rest beside MiCS blocks: each step's loss, and
    what a step sent against what `comm_volume` predicts, by operation."""
    config = _config(3)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, **zero)
    torch.manual_seed(0)
    engine = fzero.shard(
        Net(), stage=3, optimizer=OPTIMIZERS["adamw"](), config=config,
        strategy=partition.on_mesh(Mesh(MESH), partition.Custom("hpz rest", _hpz_rest)),
    )  # fmt: skip
    losses = []
    for i in range(2):
        for a in range(ACCUM):
            x, y = _rows(rank, world, i, a)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    traffic = sent_and_predicted(rank, world, engine, 0, 2)
    same = _replicas_agree(engine.train_state)
    engine.destroy()
    return {"losses": losses, "traffic": traffic, "same": same}


def _replicas_agree(state: fzero.TrainState) -> bool:
    """Whether the processes holding the same shard of a unit hold the same master
    (collective): each unit's master gathered from every process."""
    plan, same = state.plan, True
    ranks = [Mesh(MESH).index_in_group(p, plan.mesh.shard) for p in range(4)]
    for unit, held in zip(plan.units, state.units):
        every = [torch.empty_like(held.master) for _ in range(4)]
        torch.distributed.all_gather(every, held.master.contiguous())
        for p, r in enumerate(ranks):
            writer = ranks.index(plan.shard_writer(unit, plan.shard_index(unit, r)))
            same &= torch.equal(every[p], every[writer])
    return same


def test_zero_plus_plus_beside_units_on_their_own_axes():
    """hpZ, qwZ and int8 qgZ for the rest beside MiCS blocks (quantized within each
    unit's own group): the bytes `comm_volume` predicts, every process's weights alike,
    each step's loss within 10% of the exact run's (on this tiny net, one int8 scale per
    unit: plain ZeRO++ on the 2x2 mesh is 7.5% off at the fourth micro-step too)."""
    zero = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    quantized = run_world(zero_plus_plus_case, 4, zero)
    exact = run_world(zero_plus_plus_case, 4, {})
    sent, predicted = quantized["traffic"]
    assert sent == predicted and sent["all_to_all"][0] > 0  # qgZ's all-to-alls ran
    assert quantized["same"] and exact["same"]
    torch.testing.assert_close(quantized["losses"], exact["losses"], rtol=0.1, atol=0)


# ---- checkpoints ----------------------------------------------------------------------------


def save_case(rank: int, world: int, root: str, name: str, offload: str = "none") -> dict:
    saved, resumed = engine_resumes(
        lambda seed: _engine(name, seed=seed, offload=offload),
        lambda i, a: _rows(rank, world, i, a),
        root,
    )
    return {"saved": saved, "resumed": resumed}


def state_resume_case(rank: int, world: int, root: str, name: str) -> bool:
    """train_step saved mid-window (a reduced shard's accumulator written once, by its
    replica 0; a ZeRO-1 unit's whole one by every rank) resumes bitwise."""
    stage = CASES[name][0]
    mesh, preset = Mesh(MESH), _preset(name)

    def plan_of(manifest: partition.Manifest) -> partition.Plan:
        laid = partition.mesh_plan(manifest, mesh, preset, persistence_threshold=0)
        return partition.executable(laid)

    return state_resumes(rank, world, root, plan_of, stage)


def test_units_on_their_own_axes_resume_exactly_and_restore_under_zero3_at_world_2_and_1(
    tmp_path,
):
    names = list(CASES)
    for index, name in enumerate([names[0], names[1], names[4]]):  # 4: a finer split beside
        root = str(tmp_path / f"engine{index}")
        result = run_world(save_case, 4, root, name)
        assert result["resumed"], name
        _, intact = fzero.checkpoint.inspect(root)
        assert intact, name
        restores_under_zero3(root, result["saved"], name)
        assert run_world(state_resume_case, 4, str(tmp_path / f"state{index}"), name), name
    name = next(iter(CASES))  # the optimizer and parameter shards in swap files
    result = run_world(save_case, 4, str(tmp_path / "nvme"), name, "nvme")
    assert result["resumed"], name
    restores_under_zero3(str(tmp_path / "nvme"), result["saved"], name)
