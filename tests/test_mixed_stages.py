"""Units of one plan split as different ZeRO stages ("ZeRO-1 for the embeddings, ZeRO-3
for the blocks") run in both doors: the engine and `train_step` match a single-process
torch.optim run, agree bitwise, save and resume exactly, restore under uniform ZeRO-3
at another world size, send what `comm_volume` says and hold what `memory_per_rank`
says; each unit's state is whole or a shard as its own stage says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero import comm, partition
from fzero.core.init import config_for_plan
from fzero.partition import Mesh, PlanError, UnitSharding
from tests._dist import run_world
from tests.models import Net, global_batch, parity_config, torch_reference
from tests.test_needs import TrustHParams, norm_scaled_sgd

MICRO, ACCUM, STEPS, LR, CLIP = 2, 2, 3, 1e-2, 0.05

# name -> (the plan's stage, unit_stages): module paths of `tests.models.Net`
CASES = {
    "zero1 embed + zero3": (3, {"embed": 1}),
    "zero2 + zero3": (3, {"blocks.0": 2, "head": 2}),
    "zero0 embed + zero1 head + zero2": (2, {"embed": 0, "head": 1}),
    "zero0 + zero1 + zero3": (3, {"embed": 0, "blocks.1": 1}),
}
MESH = {"node": 2, "local": 2}  # world 4: split within "local", replicated over "node"


def _split_as(mesh: Mesh, stage: int, axes: tuple[str, ...]) -> UnitSharding:
    """ZeRO stage `stage` of one unit over `axes` (whole over no axis)."""
    split, whole = mesh.sharding(*axes), mesh.replicated
    return UnitSharding(
        params=split if stage == 3 else whole,
        grads=split if stage >= 2 else whole,
        optimizer=split if stage >= 1 else whole,
    )


def _mesh_preset(stage: int, stages: dict[str, int]) -> partition.Custom:
    """MiCS-like: every unit as its stage within "local", replicas along "node"."""

    def rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        own = next((s for k, s in stages.items() if unit.module.split(".")[0] == k), None)
        own = stages.get(unit.module, own)
        return _split_as(mesh, stage if own is None else own, ("local",))

    return partition.Custom("mixed", rule, stage=stage)


def _strategy(name: str, on_mesh: bool):
    stage, stages = CASES[name]
    if on_mesh:
        return partition.on_mesh(Mesh(MESH), _mesh_preset(stage, stages))
    return partition.with_unit_stages(stages)


def _config(stage: int, offload: str = "none") -> dict:
    """The parity config at `stage`; `offload`: the optimizer's device ("cpu")."""
    config = parity_config(MICRO, ACCUM, CLIP)
    config["zero_optimization"]["stage"] = stage
    if offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    return config


def _norm_apply_(param, direction, segments, p_norms, d_norms, hp):
    """p -= lr x trust x ‖p‖ x d per tensor: the parameter's norm alone (a trust ratio
    ‖p‖ / ‖d‖ would hide a norm counted W times on both sides)."""
    for (a, b), p_norm in zip(segments, p_norms):
        param[a:b].add_(direction[a:b], alpha=-hp.lr * hp.trust * p_norm)


def norm_sgd() -> fzero.optim.Optimizer:
    """Momentum SGD scaled per tensor by its whole norm (declares TensorNorms)."""
    hp = TrustHParams(lr=0.5, momentum=0.9, weight_decay=0.01, trust=0.5)
    return norm_scaled_sgd("norm_sgd", hp, _norm_apply_)


OPTIMIZERS = {
    "adamw": lambda: fzero.optim.adamw(lr=LR, weight_decay=0.01),
    "lamb": lambda: fzero.optim.lamb(lr=LR, weight_decay=0.01),  # per-tensor norms
    "norm_sgd": norm_sgd,
    "muon": lambda: fzero.optim.muon(lr=0.02, weight_decay=0.01),  # whole tensors
}


def _engine(
    name: str,
    on_mesh: bool = False,
    seed: int = 0,
    door: str = "shard",
    kind: str = "adamw",
    offload: str = "none",
):
    """The engine of case `name` through `fzero.shard` (strategy=with_unit_stages, or
    on_mesh), or `fzero.initialize` with the config's `unit_stages` (DeepSpeed's door)."""
    stage = CASES[name][0]
    torch.manual_seed(seed)
    model = Net()
    if door == "initialize":
        assert not on_mesh
        config = {
            **_config(stage),
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "unit_stages": CASES[name][1],
        }
        engine, *_ = fzero.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine
    return fzero.shard(
        model,
        stage=stage,
        optimizer=OPTIMIZERS[kind](),
        config=_config(stage, offload),
        strategy=_strategy(name, on_mesh),
    )


def _rows(rank: int, world: int, step: int, a: int):
    x, y = global_batch(step, MICRO * ACCUM * world)
    rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
    return x[rows], y[rows]


def _tensor_states(state: fzero.TrainState) -> dict[str, torch.Tensor]:
    """Every tensor's fp32 master and optimizer moments, whole (collective over every
    process; NVMe: read back from the swap file): what a restore must give back exactly,
    whatever the plan. A shard is placed
    at its plan rank's block (on a mesh whose optimizer is split finer than its gradients
    the plan's ranks are not in process order; with replicas a block is filled by each)."""
    plan, out = state.plan, {}
    world = dist.get_world_size()
    if plan.mesh is not None:
        mesh = Mesh(plan.mesh.axes)
        ranks = [mesh.index_in_group(p, plan.mesh.shard) for p in range(world)]
    else:
        ranks = list(range(world))
    for index, unit in enumerate(plan.units):
        with state.resident(index) as u:  # NVMe: read back from the swap file
            moments = {
                k: v.clone()
                for k, v in u.optim._asdict().items()
                if isinstance(v, torch.Tensor) and v.dim() == 1 and k != "step"
            }
            master = u.master.clone()
        for kind, part in {"master": master, **moments}.items():
            part = part.float().contiguous()
            if part.numel() != unit.numel:  # a shard: gathered over every process
                parts = [torch.empty_like(part) for _ in range(world)]
                dist.all_gather(parts, part)
                whole = torch.empty(unit.numel)
                for process, r in enumerate(ranks):
                    whole[slice(*plan.shard_range(unit, r))] = parts[process]
            else:
                whole = part
            for pl in unit.placements:
                shape = plan.manifest[pl.fqn].shape
                out[f"{kind}:{pl.fqn}"] = partition_pieces(whole, pl, shape)
    return out


def partition_pieces(flat: torch.Tensor, placement, shape) -> torch.Tensor:
    value = torch.empty(int(torch.tensor(shape).prod()) if shape else 1)
    for piece in placement.pieces:
        value[piece.start : piece.start + piece.numel] = flat[
            piece.offset : piece.offset + piece.numel
        ]
    return value.reshape(shape)


# ---- parity with torch.optim, both doors bitwise alike, each unit as its stage ---------------


def doors_case(
    rank: int,
    world: int,
    names: list[str],
    on_mesh: bool,
    kind: str = "adamw",
    offload: str = "none",
) -> dict:
    out = {}
    for name in names:
        stage = CASES[name][0]
        engine = _engine(name, on_mesh, kind=kind, offload=offload)
        torch.manual_seed(0)
        model = Net()
        manifest = partition.describe(model)
        if on_mesh:
            laid = partition.mesh_plan(
                manifest, Mesh(MESH), _mesh_preset(*CASES[name]), persistence_threshold=0
            )
            plan = partition.executable(laid)
        else:
            plan = partition.plan(
                manifest,
                world_size=world,
                stage=stage,
                unit_stages=CASES[name][1],
                persistence_threshold=0,
            )
        kind_of = {"none": "device", "cpu": "host", "nvme": "nvme"}[offload]
        assert engine.plan.memory == partition.Memory(optimizer=kind_of), name  # the config's
        assert partition.with_memory(plan, engine.plan.memory) == engine.plan, name
        config = _config(stage, offload)
        losses, state = train_both(rank, world, engine, model, plan, OPTIMIZERS[kind](), config)
        out[name] = {
            "losses": losses,
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "stages": engine.plan.stages,
            "holdings": _holdings(engine),
            "state_holdings": _state_holdings(state),
            "held": engine.memory_held() == engine.memory_planned(),
        }
        engine.destroy()
    return out


def train_both(
    rank: int,
    world: int,
    engine,
    model: torch.nn.Module,
    plan: partition.Plan,
    optimizer: fzero.optim.Optimizer,
    config: dict,
) -> tuple[tuple[list[float], list[float]], fzero.TrainState]:
    """`STEPS` steps of `engine` and of `train_step` under `plan` (from `model`'s
    weights) on the same rows: both doors' losses, and the final `TrainState`."""
    state = fzero.init(model, plan, optimizer, config=config)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    engine_losses, step_losses = [], []
    for i in range(STEPS):
        for a in range(ACCUM):
            x, y = _rows(rank, world, i, a)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            state, metrics = step(state, (x, y))
            engine_losses.append(loss.item())
            step_losses.append(metrics["loss"].item())
    return (engine_losses, step_losses), state


def _holdings(engine) -> list[tuple[int, int, int, int, int, int]]:
    """Per unit: (stage, buffer numel, gradient numel, master numel, parameter elements
    bound now, whole parameter buffer's numel or -1): what each stage keeps whole or
    split between steps."""
    rows = []
    for rt in engine.runtime.units:
        bound = sum(p.data.numel() for p, _, _ in rt.params)
        full = rt.full.numel() if rt.full is not None else -1
        rows.append(
            (engine.plan.stage_of(rt.unit), rt.unit.numel, rt.grad.numel(), rt.master.numel(),
             bound, full)
        )  # fmt: skip
    return rows


def _state_holdings(state: fzero.TrainState) -> list[tuple[int, int, int, int, int, int]]:
    """`_holdings`'s rows of a `TrainState` (nothing bound: -1)."""
    plan = state.plan
    return [
        (stage, unit.numel, u.grad.numel(), u.master.numel(), -1,
         -1 if u.params is None else u.params.numel())
        for stage, unit, u in zip(plan.stages, plan.units, state.units)
    ]  # fmt: skip


def _check_doors(results: dict, world: int) -> dict[str, float]:
    errors = check_against_torch(results, world)
    for name, result in results.items():
        assert len(set(result["stages"])) > 1, name  # the units do differ in stage
        _check_holdings(name, result["holdings"], world)
        _check_holdings(name, result["state_holdings"], world, bound=False)
    return errors


def check_against_torch(results: dict, world: int) -> dict[str, float]:
    """Each case's result (`losses` of both doors, their `engine` and `step` weights,
    whether the engine `held` what it planned) against a single-process torch.optim
    AdamW run: both doors bitwise alike, within 1e-6 of it. The largest error per case."""
    # one weight decay for every tensor: train_step takes one optimizer's hyper-parameters
    _, ref_state = torch_reference(
        lambda groups: torch.optim.AdamW(
            [p for group in groups for p in group["params"]], lr=LR, weight_decay=0.01
        ),
        steps=STEPS, micro=MICRO, accum=ACCUM, world=world, clip=CLIP,
    )  # fmt: skip
    errors = {}
    for name, result in results.items():
        engine_losses, step_losses = result["losses"]
        assert engine_losses == step_losses, name  # both doors bitwise alike
        for key, expected in result["engine"].items():
            assert torch.equal(result["step"][key], expected), (name, key)
        errors[name] = max(
            (result["engine"][k] - v).abs().max().item() for k, v in ref_state.items()
        )
        assert errors[name] <= 1e-6, (name, errors[name])
        assert result["held"], name  # memory_held() == memory_planned()
    return errors


def _check_holdings(name: str, holdings: list, world: int, bound: bool = True) -> None:
    """A unit below stage 2 keeps its whole gradient, below 1 its whole master; a
    stage-3 unit's parameters are a shard between uses, a lower one's whole (and, in the
    engine, bound to the module). `holdings`: `_holdings`'s rows (a `TrainState`'s with
    `bound` False)."""
    for stage, numel, grad, master, params_bound, full in holdings:
        where = (name, stage, numel)
        shard_numel = numel // world
        assert grad == (numel if stage < 2 else shard_numel), where
        assert master == (numel if stage == 0 else shard_numel), where
        if stage == 3:  # the shard (None where the fp32 master serves): nothing whole
            assert full in (-1, shard_numel) and (params_bound == 0 or not bound), where
        else:
            assert full == numel and (params_bound > 0 or not bound), where


def test_mixed_stages_match_torch_optim_in_both_doors_at_world_2():
    errors = _check_doors(run_world(doors_case, 2, list(CASES), False), 2)
    print("max abs error vs torch.optim, world 2:", errors)


@pytest.mark.slow  # four ranks, two runs: about 13 s on two cores (world 2 is in the fast job)
def test_mixed_stages_match_torch_optim_in_both_doors_at_world_4_and_on_a_2x2_mesh():
    names = list(CASES)[:3]
    errors = _check_doors(run_world(doors_case, 4, names, False), 4)
    print("max abs error vs torch.optim, world 4:", errors)
    results = run_world(doors_case, 4, names, True)
    for result in results.values():  # split within "local": blocks of numel / 2
        result["holdings"] = result["state_holdings"] = []
    print("max abs error vs torch.optim, 2x2 mesh:", _check_doors(results, 4))


# ---- what ignoring a unit's stage would break: checked on the plan alone ---------------------


def test_the_plan_carries_each_units_stage_and_its_queries_follow_it():
    torch.manual_seed(0)
    model = Net()
    manifest = partition.describe(model)
    options = {"world_size": 2, "stage": 3, "persistence_threshold": 0}
    plan = partition.plan(manifest, unit_stages={"embed": 1}, **options)
    stages = dict(zip((u.name for u in plan.units), plan.stages))
    assert stages == {"embed": 1, "blocks.0": 3, "blocks.1": 3, "head": 3}
    assert plan.stage == 3 and plan.mixed
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    assert partition.to_plan(plan) is plan  # a plan of the whole world already
    by_name = dict(zip((u.name for u in plan.units), plan.stages))
    said = partition.Custom(
        "mixed", lambda mesh, unit: partition.stage_shardings(mesh, by_name[unit.name], False)
    )
    on_mesh = partition.mesh_plan(manifest, partition.Mesh.single(2), said, persistence_threshold=0)
    assert on_mesh.shardings == plan.shardings and partition.to_plan(on_mesh) == plan
    uniform = partition.plan(manifest, **options)
    assert partition.plan_digest(uniform) != partition.plan_digest(plan)
    memory = partition.memory_per_rank(plan, 0)
    embed = plan.units[0]
    whole = partition.memory_per_rank(uniform, 0)
    # the embeddings' params and gradients whole, their optimizer state a shard
    assert memory.params - whole.params == 4 * (embed.numel - embed.shard_numel)
    assert memory.grads - whole.grads == 4 * (embed.numel - embed.shard_numel)
    assert memory.optimizer_state == whole.optimizer_state
    # stage 2 in a stage-3 plan is stage 3's persistent unit (params whole)
    two = partition.plan(manifest, unit_stages={"head": 2}, **options)
    assert two.units[-1].persistent and two.units[-1].stage is None and two.stages[-1] == 2
    buckets = partition.reduction_buckets(plan, 10**9)
    assert buckets == ((3, 2, 1), (0,))  # whole and split gradients never share a bucket
    # on a mesh: MiCS with ZeRO-1 embeddings is the Custom preset's plan (but for its name)
    mics = partition.with_unit_stages({"embed": 1}, strategy=partition.on_mesh(Mesh(MESH), "mics"))
    ours = partition.plan(manifest, world_size=4, stage=3, strategy=mics, persistence_threshold=0)
    laid = partition.mesh_plan(
        manifest, Mesh(MESH), _mesh_preset(3, {"embed": 1}), persistence_threshold=0
    )
    custom = partition.executable(laid)
    assert ours.stages == custom.stages == (1, 3, 3, 3)
    assert dataclasses.replace(ours, mesh=custom.mesh) == custom


def test_a_plan_written_before_unit_stages_reads_as_it_was():
    torch.manual_seed(0)
    plan = partition.plan(partition.describe(Net()), world_size=2, stage=2)
    data = partition.to_bytes(plan)
    assert b"stage" in data and partition.from_bytes(data) == plan
    assert all(u.stage is None for u in plan.units) and not plan.mixed


def test_unit_stages_errors_name_the_key_the_value_and_what_is_allowed():
    manifest = partition.describe(Net())

    def error(**options) -> str:
        try:
            partition.plan(manifest, world_size=2, **options)
        except PlanError as caught:
            return str(caught)
        raise AssertionError(f"no error for {options}")

    assert "unit_stages['embed'] is 3; allowed: 0 to the plan's stage 2" in error(
        stage=2, unit_stages={"embed": 3}
    )
    assert "'encoder' names no unit" in error(stage=3, unit_stages={"encoder": 1})
    assert "'blocks.0'" in error(stage=3, unit_stages={"encoder": 1})  # the units listed
    assert "plan stage is 3 but its units are split as stages [1]" in error(
        stage=3, unit_stages={"": 1}
    )
    plan = partition.plan(manifest, world_size=2, stage=3)
    with pytest.raises(ValueError, match=r"the config's unit_stages is \{'embed': 1\}, but"):
        config_for_plan({"unit_stages": {"embed": 1}}, plan)  # train_step runs its plan
    bad = dataclasses.replace(plan.units[0], stage=5)
    try:
        partition.validate(dataclasses.replace(plan, units=(bad, *plan.units[1:])))
    except PlanError as caught:
        assert "unit 'embed': stage is 5; allowed: None (the plan's) or 0 to" in str(caught)
    else:
        raise AssertionError("stage 5 accepted")


# ---- traffic: what comm_volume says -----------------------------------------------------------


def _per_step(before: dict, after: dict, steps: int) -> dict[str, tuple[int, int]]:
    """Calls and bytes per operation `comm.traffic()` counted between two readings, per
    optimizer step."""
    sent = {}
    for op, (calls, size) in after.items():
        was_calls, was_size = before.get(op, (0, 0))
        if (calls, size) != (was_calls, was_size):
            sent[op] = ((calls - was_calls) // steps, (size - was_size) // steps)
    return sent


def _predicted(engine) -> dict[str, tuple[int, int]]:
    """`engine.comm_volume()`'s calls and bytes per operation, per step."""
    predicted: dict[str, tuple[int, int]] = {}
    for row in engine.comm_volume():
        calls, size = predicted.get(row.operation, (0, 0))
        predicted[row.operation] = (calls + row.calls, size + row.bytes)
    return predicted


def sent_and_predicted(
    rank: int, world: int, engine, warm: int, steps: int
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """`engine` trained `warm` steps, then `steps` more counted: what they sent per step
    (`comm.traffic()`) and what `engine.comm_volume()` predicts, by operation."""

    def run(first: int, count: int) -> None:
        for i in range(first, first + count):
            for a in range(ACCUM):
                x, y = _rows(rank, world, i, a)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()

    run(0, warm)
    before = comm.traffic()
    run(warm, steps)
    return _per_step(before, comm.traffic(), steps), _predicted(engine)


def traffic_case(rank: int, world: int, names: list[str], on_mesh: bool) -> dict:
    out = {}
    for name in names:
        engine = _engine(name, on_mesh, door="shard" if on_mesh else "initialize")
        sent, predicted = sent_and_predicted(rank, world, engine, 2, 3)
        staged = {u.name: s for u, s in zip(engine.plan.units, engine.plan.stages)}
        out[name] = (sent, predicted, staged)
        engine.destroy()
    return out


def test_a_mixed_step_sends_what_comm_volume_predicts():
    """World 2 through fzero.initialize and the config's unit_stages; a 2x2 mesh through
    fzero.shard and a Custom preset."""
    for name, (sent, predicted, staged) in run_world(traffic_case, 2, list(CASES), False).items():
        assert sent == predicted, name
        assert len(set(staged.values())) > 1, (name, staged)
    names = list(CASES)[:2]
    for name, (sent, predicted, _) in run_world(traffic_case, 4, names, True).items():
        assert sent == predicted, ("mesh", name)


# ---- checkpoints: resume exactly, restore under uniform ZeRO-3 elsewhere ---------------------


def engine_resumes(make, rows, root: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Train 2 steps of `make(seed)`'s engine (seed 0) on `rows(step, a)`, save under
    `root`, train 1 more; a fresh engine (seed 7) loads and runs the same step. The saved
    tensor states and whether both last steps end bitwise alike."""
    engine = make(0)
    for i in range(2):
        for a in range(ACCUM):
            x, y = rows(i, a)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = _tensor_states(engine.train_state)

    def last(engine) -> dict:
        for a in range(ACCUM):
            x, y = rows(2, a)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        return engine.state_dict(dtype=torch.float32)

    straight = last(engine)
    engine.destroy()
    fresh = make(7)
    fresh.load_checkpoint(root, tag="t")
    resumed = last(fresh)
    fresh.destroy()
    return saved, all(torch.equal(straight[k], resumed[k]) for k in straight)


def save_case(rank: int, world: int, root: str, name: str) -> dict:
    """`engine_resumes` for case `name`: the saved tensor states, whether it resumed."""
    saved, resumed = engine_resumes(
        lambda seed: _engine(name, seed=seed), lambda i, a: _rows(rank, world, i, a), root
    )
    return {"saved": saved, "resumed": resumed}


def restore_case(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(5)
    model = Net()
    manifest = partition.describe(model)
    plan = partition.plan(manifest, world_size=world, stage=3, persistence_threshold=0)
    optimizer = fzero.optim.adamw(lr=LR, weight_decay=0.01)
    state = fzero.init(model, plan, optimizer)
    restored = fzero.checkpoint.restore(root, state, optimizer=optimizer, module=model)
    return _tensor_states(restored.state)


def state_resume_case(rank: int, world: int, root: str, name: str) -> bool:
    """train_step: save after 3 micro-steps (mid-window), resume bitwise."""
    stage, stages = CASES[name]

    def plan_of(manifest: partition.Manifest) -> partition.Plan:
        return partition.plan(
            manifest, world_size=world, stage=stage, unit_stages=stages, persistence_threshold=0
        )

    return state_resumes(rank, world, root, plan_of, stage)


def state_resumes(rank: int, world: int, root: str, plan_of, stage: int) -> bool:
    """train_step under `plan_of(manifest)` (config at `stage`): save after 3 micro-steps
    (mid-window), a fresh state (seed 7) restores it; whether the next 3 micro-steps end
    bitwise alike."""

    def setup(seed: int):
        torch.manual_seed(seed)
        model = Net()
        plan = plan_of(partition.describe(model))
        optimizer = fzero.optim.adamw(lr=LR, weight_decay=0.01)
        state = fzero.init(model, plan, optimizer, config=_config(stage))

        def loss_fn(params, batch):
            x, y = batch
            return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

        return optimizer, state, fzero.train_step(loss_fn, plan, optimizer, config=_config(stage))

    def run(step, state, first, count):
        for m in range(first, first + count):
            state, _ = step(state, _rows(rank, world, m // ACCUM, m % ACCUM))
        return state

    optimizer, state, step = setup(0)
    state = run(step, state, 0, 3)
    fzero.checkpoint.save(root, state, optimizer=optimizer, tag="s")
    straight = fzero.state_dict(run(step, state, 3, 3))
    _, fresh, step = setup(7)
    restored = fzero.checkpoint.restore(root, fresh, optimizer=optimizer)
    resumed = fzero.state_dict(run(step, restored.state, 3, 3))
    return all(torch.equal(straight[k], resumed[k]) for k in straight)


def restores_under_zero3(root: str, saved: dict, name: str) -> None:
    """The checkpoint at `root` restores under plain ZeRO-3 at world 2 and 1 to exactly
    the tensor states `saved` (`_tensor_states` of the run that wrote it)."""
    for world in (2, 1):
        restored = run_world(restore_case, world, root)
        assert restored.keys() == saved.keys(), name
        for key, value in saved.items():
            assert torch.equal(restored[key], value), (name, world, key)


def test_mixed_checkpoints_resume_exactly_and_restore_under_zero3_at_world_2_and_1(tmp_path):
    for index, name in enumerate(CASES):
        root = str(tmp_path / f"engine{index}")
        result = run_world(save_case, 2, root, name)
        assert result["resumed"], name
        report, intact = fzero.checkpoint.inspect(root)
        # units below stage 2 by stage; stage 2 in a stage-3 plan: persistent units
        assert intact and ("units by stage: " in report or "persistent)" in report), report
        restores_under_zero3(root, result["saved"], name)
        assert run_world(state_resume_case, 2, str(tmp_path / f"state{index}"), name), name


def uniform_case(rank: int, world: int, stage: int, kind: str) -> dict:
    torch.manual_seed(0)
    config = _config(stage)
    engine = fzero.shard(Net(), stage=stage, optimizer=OPTIMIZERS[kind](), config=config)
    for i in range(STEPS):
        for a in range(ACCUM):
            x, y = _rows(rank, world, i, a)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    return engine.state_dict(dtype=torch.float32)


@pytest.mark.parametrize("kind", ["lamb", "norm_sgd"])
def test_tensor_norms_count_a_stage0_units_whole_tensors_once_beside_split_units(kind):
    """An optimizer that needs each tensor's whole norm (LAMB; `norm_sgd`, whose step
    scales with the norm itself): a stage-0 unit's sums are whole on every rank, a split
    unit's partial; both doors agree bitwise and match a plain data-parallel (stage 0)
    run."""
    name = "zero0 + zero1 + zero3"
    result = run_world(doors_case, 2, [name], False, kind)[name]
    engine_losses, step_losses = result["losses"]
    assert engine_losses == step_losses
    for key, expected in result["engine"].items():
        assert torch.equal(result["step"][key], expected), key
    uniform = run_world(uniform_case, 2, 0, kind)
    error = max((result["engine"][k] - v).abs().max().item() for k, v in uniform.items())
    assert error <= 1e-6, error


def offload_refused_case(rank: int, world: int) -> str:
    try:
        _engine("zero0 embed + zero1 head + zero2", offload="cpu")
    except ValueError as error:
        return str(error)
    return "no error"


def test_optimizer_offload_runs_units_at_stages_1_to_3_and_names_a_stage0_unit():
    names = ["zero1 embed + zero3", "zero2 + zero3"]
    errors = _check_doors(run_world(doors_case, 2, names, False, "adamw", "cpu"), 2)
    print("max abs error vs torch.optim, world 2, optimizer offload:", errors)
    message = run_world(offload_refused_case, 2)
    assert "offload_optimizer.device is 'cpu') but unit 'embed' is split as stage 0" in message


def uneven_case(rank: int, world: int, names: list[str]) -> dict:
    """`whole_tensors` (every tensor whole on one rank, uneven shards) with unit stages:
    traffic of the steps after the first, per step, the prediction, the weights."""
    out = {}
    for name in names:
        stage, stages = CASES[name]
        torch.manual_seed(0)
        strategy = partition.with_unit_stages(stages, strategy=partition.whole_tensors)
        engine = fzero.shard(
            Net(), stage=stage, optimizer=OPTIMIZERS["adamw"](), config=_config(stage),
            strategy=strategy,
        )  # fmt: skip
        before: dict = {}
        for i in range(STEPS):
            if i == 1:
                before = comm.traffic()
            for a in range(ACCUM):
                x, y = _rows(rank, world, i, a)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
        sent = _per_step(before, comm.traffic(), STEPS - 1)
        assert any(u.bounds for u in engine.plan.units)
        out[name] = (sent, _predicted(engine), engine.state_dict(dtype=torch.float32))
        engine.destroy()
    return out


def test_uneven_units_at_different_stages_match_torch_optim_and_comm_volume():
    names = ["zero1 embed + zero3", "zero0 embed + zero1 head + zero2"]
    _, ref_state = torch_reference(
        lambda groups: torch.optim.AdamW(
            [p for group in groups for p in group["params"]], lr=LR, weight_decay=0.01
        ),
        steps=STEPS, micro=MICRO, accum=ACCUM, world=2, clip=CLIP,
    )  # fmt: skip
    for name, (sent, predicted, state) in run_world(uneven_case, 2, names).items():
        assert sent == predicted, name
        error = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        assert error <= 1e-6, (name, error)
