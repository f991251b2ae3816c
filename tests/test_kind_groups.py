"""Kinds split over different groups of axes: on a 2x2 mesh (`node` x `local`) the
optimizer state split over the world (`("local", "node")` or `("node", "local")`: a
quarter of each unit per rank; in the second order a rank's quarter lies in another
rank's gradient half, and the blocks are exchanged) with the gradients split within the
node (`("local",)`), the parameters whole (a ZeRO-2 shape) or split as the gradients
(MiCS's ZeRO-3 within the node). Both doors run it: they match a single-process
torch.optim run, agree bitwise, send what `comm_volume` says, hold what
`memory_per_rank` says, keep each kind at its split, save and resume exactly, and
restore under plain ZeRO-3 at world 2 and 1. What is not run is refused by
`validate`, naming the unit, the kind and the axes."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import comm, partition
from fzero.partition import Mesh, PlanError, UnitSharding
from fzero.partition._mesh_comm import publish_hops
from tests._dist import run_world
from tests.models import Net, global_batch, parity_config, torch_reference
from tests.test_mixed_stages import _per_step, _predicted, _tensor_states, engine_resumes
from tests.test_muon import HP as MUON
from tests.test_muon import reference_run as muon_reference

MICRO, ACCUM, STEPS, LR, CLIP = 2, 2, 3, 1e-2, 0.05
MESH = {"node": 2, "local": 2}
WORLD = 4

# name -> (stage, whether the parameters are split over "local"); a name ending in
# ", node first" splits the optimizer over ("node", "local"), else ("local", "node")
CASES = {
    "zero2-like": (2, False),
    "mics zero3-like": (3, True),
    "zero1 embed + zero2-like": (2, False),
    "zero2-like, node first": (2, False),
    "mics zero3-like, node first": (3, True),
    "zero1 embed + zero2-like, node first": (2, False),
    # a ZeRO-1 unit in one bucket with a stage-0 unit: all-reduced whole with it over
    # every process, so its average is in place and nothing moves at the boundary
    "zero0 + zero1 in a bucket, node first": (2, False),
}


def _order(name: str) -> tuple[str, str]:
    """The optimizer's axes in case `name`."""
    return ("node", "local") if name.endswith(", node first") else ("local", "node")


def _zero1(name: str) -> tuple[str, ...]:
    """The modules whose units keep whole gradients (ZeRO-1) beside the finer split."""
    if name.startswith("zero0 + zero1"):
        return ("head",)
    return ("embed",) if name.startswith("zero1 embed") else ()


def _zero0(name: str) -> tuple[str, ...]:
    """The modules whose units keep every kind whole (stage 0) beside the finer split."""
    return ("blocks.1",) if name.startswith("zero0 + zero1") else ()


def _rule(
    params_split: bool,
    zero1: tuple[str, ...] = (),
    order: tuple[str, str] = ("local", "node"),
    zero0: tuple[str, ...] = (),
):
    """Every unit: optimizer over `order`, gradients over ("local",) (whole for the
    modules in `zero1`), params over ("local",) or whole; the modules in `zero0` whole."""

    def rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        local = mesh.sharding("local")
        if unit.module in zero0:
            return UnitSharding(mesh.replicated, mesh.replicated, mesh.replicated)
        return UnitSharding(
            params=local if params_split and not unit.persistent else mesh.replicated,
            grads=mesh.replicated if unit.module in zero1 else local,
            optimizer=mesh.sharding(*order),
        )

    return rule


def _preset(name: str) -> partition.Custom:
    stage, params_split = CASES[name]
    rule = _rule(params_split, _zero1(name), _order(name), _zero0(name))
    return partition.Custom("finer optimizer", rule, stage=stage)


def _config(stage: int, name: str = "") -> dict:
    config = parity_config(MICRO, ACCUM, CLIP)
    config["zero_optimization"]["stage"] = stage
    if _zero0(name):  # buckets that hold the stage-0 and the ZeRO-1 unit together
        config["zero_optimization"]["reduce_bucket_size"] = 2000
    return config


def _optimizer() -> fzero.optim.Optimizer:
    return fzero.optim.adamw(lr=LR, weight_decay=0.01)


def _engine(name: str, seed: int = 0, config: dict | None = None):
    stage = CASES[name][0]
    torch.manual_seed(seed)
    return fzero.shard(
        Net(),
        stage=stage,
        optimizer=_optimizer(),
        config=config or _config(stage, name),
        strategy=partition.on_mesh(Mesh(MESH), _preset(name)),
    )


def _plan(name: str) -> partition.Plan:
    torch.manual_seed(0)
    manifest = partition.describe(Net())
    laid = partition.mesh_plan(manifest, Mesh(MESH), _preset(name), persistence_threshold=0)
    return partition.executable(laid)


def _rows(rank: int, step: int, a: int):
    x, y = global_batch(step, MICRO * ACCUM * WORLD)
    rows = slice((a * WORLD + rank) * MICRO, (a * WORLD + rank + 1) * MICRO)
    return x[rows], y[rows]


def _loss_fn(model):
    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return loss_fn


def _check_holdings(plan: partition.Plan, rank: int, units, params_split: bool, name: str) -> None:
    """Each kind at its split on this process: the optimizer state and master a quarter
    of the unit (the finer split: half if it were ignored; whole for the stage-0
    modules' units), the gradient accumulator a half (whole for the ZeRO-1 and stage-0
    modules' units), the parameters half or whole. `units`: (grad, master, moments,
    params numels)."""
    for unit, (grad, master, moments, params) in zip(plan.units, units):
        where, whole = (unit.name, rank), unit.module in _zero0(name)
        quarter = unit.numel // (1 if whole else 4)
        assert master == quarter and all(m == quarter for m in moments), where
        assert grad == unit.numel // (1 if unit.module in _zero1(name) or whole else 2), where
        assert params == (unit.numel // 2 if params_split else unit.numel), where


# ---- both doors against torch.optim, bitwise alike; traffic; memory; holdings -------------------


def doors_case(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        stage, params_split = CASES[name]
        engine = _engine(name)
        plan = _plan(name)
        assert plan == engine.plan and plan.optimizer_extra_size == 2
        assert plan.mesh.optimizer_extra == ("node",) and plan.mesh.shard == _order(name)
        assert plan.mesh.permuted == (_order(name) == ("node", "local"))
        torch.manual_seed(0)
        model = Net()
        state = fzero.init(model, plan, _optimizer(), config=_config(stage, name))
        step = fzero.train_step(_loss_fn(model), plan, _optimizer(), config=_config(stage, name))
        engine_losses, step_losses = [], []
        sent: dict[str, tuple[int, int]] = {}
        for i in range(STEPS):
            for a in range(ACCUM):
                x, y = _rows(rank, i, a)
                before = comm.traffic()
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                if i > 0:  # the first step records stage 3's trace
                    for op, (calls, size) in _per_step(before, comm.traffic(), 1).items():
                        was = sent.get(op, (0, 0))
                        sent[op] = (was[0] + calls, was[1] + size)
                state, metrics = step(state, (x, y))
                engine_losses.append(loss.item())
                step_losses.append(metrics["loss"].item())
        sent = {op: (n // (STEPS - 1), size // (STEPS - 1)) for op, (n, size) in sent.items()}
        _check_holdings(
            plan,
            rank,
            [
                (rt.grad.numel(), rt.master.numel(), _moments(rt.state),
                 (rt.full if rt.full is not None else rt.param_shard).numel())
                for rt in engine.runtime.units
            ],
            params_split,
            name,
        )  # fmt: skip
        _check_holdings(
            plan,
            rank,
            [(u.grad.numel(), u.master.numel(), _moments(u.optim), u.params.numel())
             for u in state.units],
            params_split,
            name,
        )  # fmt: skip
        out[name] = {
            "losses": (engine_losses, step_losses),
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "held": (engine.memory_held(), engine.memory_planned()),
            "traffic": (sent, _predicted(engine)),
            "volume": engine.comm_volume(),
        }
        engine.destroy()
    return out


def _moments(optim) -> list[int]:
    return [v.numel() for v in optim._asdict().values() if isinstance(v, torch.Tensor) and v.dim()]


def _reference() -> dict[str, torch.Tensor]:
    _, ref_state = torch_reference(
        lambda groups: torch.optim.AdamW(
            [p for group in groups for p in group["params"]], lr=LR, weight_decay=0.01
        ),
        steps=STEPS, micro=MICRO, accum=ACCUM, world=WORLD, clip=CLIP,
    )  # fmt: skip
    return ref_state


@pytest.mark.parametrize(
    "name",
    [
        "zero2-like",  # the fast job's world-4 case
        # the same machinery plus stage 3's gathers: 26 s on two loaded cores (slow job)
        pytest.param("mics zero3-like", marks=pytest.mark.slow),
        # ZeRO-1 embeddings: reduced whole at the boundary within the node, then across
        pytest.param("zero1 embed + zero2-like", marks=pytest.mark.slow),
        # the optimizer's quarter in another rank's gradient half: blocks exchanged
        "mics zero3-like, node first",
        pytest.param("zero2-like, node first", marks=pytest.mark.slow),
        pytest.param("zero1 embed + zero2-like, node first", marks=pytest.mark.slow),
        pytest.param("zero0 + zero1 in a bucket, node first", marks=pytest.mark.slow),
    ],
)
def test_an_optimizer_split_finer_than_the_gradients_runs_in_both_doors(name):
    result = run_world(doors_case, WORLD, [name])[name]
    engine_losses, step_losses = result["losses"]
    assert engine_losses == step_losses  # both doors bitwise alike
    for key, expected in result["engine"].items():
        assert torch.equal(result["step"][key], expected), key
    ref_state = _reference()
    error = max((result["engine"][k] - v).abs().max().item() for k, v in ref_state.items())
    assert error <= 1e-6, error
    held, planned = result["held"]
    assert held == planned, (held, planned)
    sent, predicted = result["traffic"]
    assert sent == predicted, (sent, predicted)
    assert ("all_to_all" in sent) == name.endswith(", node first"), sent  # the exchange
    print(partition.format_comm_volume(result["volume"]))
    print(f"max abs error vs torch.optim, 2x2 mesh, {name}: {error:.3g}")


def muon_case(rank: int, world: int, name: str) -> dict:
    """Muon (Newton-Schulz on each hidden matrix's whole direction, gathered from the
    optimizer's quarters) on the finer split, one micro-step per step: the engine's
    weights and the functional door's."""
    stage = CASES[name][0]
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0}
    config["zero_optimization"] = {"stage": stage}
    torch.manual_seed(0)
    engine = fzero.shard(
        Net(),
        stage=stage,
        optimizer=fzero.optim.muon(ns_dtype="fp32", **MUON),
        config=config,
        strategy=partition.on_mesh(Mesh(MESH), _preset(name)),
    )
    torch.manual_seed(0)
    model = Net()
    plan = _plan(name)
    state = fzero.init(model, plan, fzero.optim.muon(ns_dtype="fp32", **MUON), config=config)
    step = fzero.train_step(
        _loss_fn(model), plan, fzero.optim.muon(ns_dtype="fp32", **MUON), config=config
    )
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        before = comm.traffic()
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        sent = _per_step(before, comm.traffic(), 1)  # the last step's (a trace recorded)
        state, _ = step(state, (x[rows], y[rows]))
    result = {
        "engine": engine.state_dict(dtype=torch.float32),
        "step": fzero.state_dict(state, module=model),
        "traffic": (sent, _predicted(engine)),
        "directions": [r for r in engine.comm_volume() if "directions" in r.what],
    }
    engine.destroy()
    return result


@pytest.mark.slow  # four ranks, two plans
def test_muon_gathers_whole_directions_from_the_quarters_in_either_order():
    """A whole-tensor optimizer's direction is gathered from the optimizer's quarters
    (exchanged back first in the order ("node", "local")): both orders and both doors
    equal the single-process Muon reference."""
    reference = muon_reference(WORLD, steps=STEPS)
    for name in ("mics zero3-like", "mics zero3-like, node first"):
        result = run_world(muon_case, WORLD, name)
        for key, expected in reference.items():
            assert torch.equal(result["engine"][key], result["step"][key]), (name, key)
            torch.testing.assert_close(result["engine"][key], expected, rtol=1e-5, atol=1e-6)
        sent, predicted = result["traffic"]
        assert sent == predicted, (name, sent, predicted)  # the directions' gathers counted
        hops = {(r.operation, r.axes) for r in result["directions"]}
        assert {("all_gather", ("node",)), ("all_gather", ("local",))} <= hops, hops
        assert (("all_to_all", ("node", "local")) in hops) == name.endswith("node first")


def nvme_case(rank: int, world: int, name: str, path: str | None, swap: bool) -> dict:
    """The engine with the optimizer state in an NVMe swap file at `path` (None: in
    memory), its gradient accumulators there too (`swap`) or in host memory; and
    `train_step` on the engine's plan (its accumulators always in memory)."""
    config = _config(CASES[name][0])
    if path is not None:
        offload = {"device": "nvme", "nvme_path": path, "swap_gradients": swap}
        config["zero_optimization"]["offload_optimizer"] = offload
    try:
        engine = _engine(name, config=config)
    except ValueError as error:
        return {"refused": str(error)}
    torch.manual_seed(0)
    model = Net()
    plan = engine.plan  # the config's memory in it: the swap file for train_step too
    state = fzero.init(model, plan, _optimizer(), config=config)
    step = fzero.train_step(_loss_fn(model), plan, _optimizer(), config=config)
    for i in range(STEPS):
        for a in range(ACCUM):
            x, y = _rows(rank, i, a)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            state, _ = step(state, (x, y))
    result = {
        "state": engine.state_dict(dtype=torch.float32),
        "step": fzero.state_dict(state, module=model),
        "held": (engine.memory_held(), engine.memory_planned()),
    }
    engine.destroy()
    return result


@pytest.mark.slow  # four ranks, three runs
def test_the_optimizer_on_nvme_beside_the_finer_split_keeps_its_gradients_in_memory(tmp_path):
    """The boundary reduces each accumulated shard once more, in memory: gradients in the
    swap file (the default at stages 2-3) are refused naming the key, and with
    `swap_gradients: false` the run trains bit for bit as in memory, its accumulators
    in host memory (the same bytes as the in-memory run's)."""
    name = "mics zero3-like, node first"
    refused = run_world(nvme_case, WORLD, name, str(tmp_path), True)["refused"]
    assert "offload_optimizer.swap_gradients is true" in refused
    assert "('node', 'local'), finer than its gradients (('local',))" in refused
    memory = run_world(nvme_case, WORLD, name, None, False)
    nvme = run_world(nvme_case, WORLD, name, str(tmp_path), False)
    for key, value in memory["state"].items():
        assert torch.equal(nvme["state"][key], value), key
        assert torch.equal(nvme["step"][key], value), key  # train_step over the file
    assert nvme["held"][0].grads == memory["held"][0].grads > 0
    held, planned = nvme["held"]
    assert held == planned  # the masters and state in the swap file, the sums in memory
    assert held.nvme == held.master + held.optimizer_state > 0
    assert held.device == memory["held"][0].device - held.nvme


# ---- replicas beside the finer split: pod x node x local, 8 processes ---------------------------

PODS = {"pod": 2, "node": 2, "local": 2}


def _hpz_rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """ZeRO-3 over (`node`, `local`) with hpZ's secondary copy within `local`, the
    optimizer over `pod` too."""
    both = mesh.sharding("node", "local")
    if unit.persistent:
        return UnitSharding(mesh.replicated, both, mesh.sharding("node", "local", "pod"))
    return UnitSharding(both, both, mesh.sharding("node", "local", "pod"), mesh.sharding("local"))


def _hierarchical_rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """ZeRO-3 over (`node`, `local`) gathered one axis at a time (MiCS's hierarchical
    all-gather), the optimizer over `pod` too."""
    both = mesh.sharding("node", "local")
    optimizer = mesh.sharding("node", "local", "pod")
    if unit.persistent:
        return UnitSharding(mesh.replicated, both, optimizer)
    return UnitSharding(both, both, optimizer, hierarchical_params_gather=True)


def _every_axis_rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
    """ZeRO-2 within `local`, the optimizer over (`local`, `node`, `pod`): an eighth per
    rank, its blocks exchanged with the gradients' order (`local`, then `pod`, `node`)."""
    optimizer = mesh.sharding("local", "node", "pod")
    return UnitSharding(mesh.replicated, mesh.sharding("local"), optimizer)


# name -> (stage, the rule, the axes the optimizer alone is split over)
POD_CASES = {
    "replicas": (2, _rule(False), ("node",)),  # pure replicas over pod
    "hpz": (3, _hpz_rule, ("pod",)),  # hpZ's secondary copy beside the finer split
    "hierarchical": (3, _hierarchical_rule, ("pod",)),
    # the exchange within each pod's group (a subgroup), and over the world
    "replicas, node first": (2, _rule(False, (), ("node", "local")), ("node",)),
    "every axis, local first": (2, _every_axis_rule, ("pod", "node")),
}


def _pod_config(name: str) -> dict:
    config = _config(POD_CASES[name][0])
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0  # backward gathers again
    return config


def _pod_preset(name: str) -> partition.Custom:
    stage, rule, _ = POD_CASES[name]
    return partition.Custom(f"finer, {name}", rule, stage=stage)


def _pods_engine(seed: int = 0, name: str = "replicas"):
    torch.manual_seed(seed)
    return fzero.shard(
        Net(),
        stage=POD_CASES[name][0],
        optimizer=_optimizer(),
        config=_pod_config(name),
        strategy=partition.on_mesh(Mesh(PODS), _pod_preset(name)),
    )


def replicas_save_case(rank: int, world: int, root: str) -> dict:
    def rows(i: int, a: int):
        x, y = global_batch(i, MICRO * ACCUM * world)
        part = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
        return x[part], y[part]

    saved, resumed = engine_resumes(_pods_engine, rows, root)
    return {"saved": saved, "resumed": resumed}


def pods_case(rank: int, world: int, name: str) -> dict:
    """On `pod` x `node` x `local`: "replicas", the finer split of "zero2-like" with the
    mesh replicated over `pod` (each micro-step's gradient shard averaged over the
    pods, the optimizer over (`local`, `node`) within a pod); "hpz", ZeRO-3 over
    (`node`, `local`) with hpZ's secondary copy within `local` and the optimizer over
    `pod` too. Both doors; the engine's traffic by group in the last step."""
    extra = POD_CASES[name][2]
    engine = _pods_engine(name=name)
    torch.manual_seed(0)
    model = Net()
    manifest = partition.describe(model)
    plan = partition.executable(
        partition.mesh_plan(manifest, Mesh(PODS), _pod_preset(name), persistence_threshold=0)
    )
    assert plan == engine.plan and plan.mesh.optimizer_extra == extra
    assert plan.replicas == (2 if name.startswith("replicas") else 1)
    state = fzero.init(model, plan, _optimizer(), config=_pod_config(name))
    step = fzero.train_step(_loss_fn(model), plan, _optimizer(), config=_pod_config(name))
    losses, sent = ([], []), {}
    for i in range(STEPS):
        before = comm.traffic_by_group()
        for a in range(ACCUM):
            x, y = global_batch(i, MICRO * ACCUM * world)
            rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
            loss = F.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            losses[0].append(loss.item())
        after = comm.traffic_by_group()
        for a in range(ACCUM):
            x, y = global_batch(i, MICRO * ACCUM * world)
            rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
            state, metrics = step(state, (x[rows], y[rows]))
            losses[1].append(metrics["loss"].item())
        if i == STEPS - 1:
            for group, ops in after.items():
                for op, (_, size) in ops.items():
                    moved = size - before.get(group, {}).get(op, (0, 0))[1]
                    if moved:
                        sent[(frozenset(group.split("+")), op)] = moved
    predicted: dict = {}
    for row in engine.comm_volume():
        axes = frozenset(["world"] if set(row.axes) == set(PODS) else row.axes)
        predicted[(axes, row.operation)] = predicted.get((axes, row.operation), 0) + row.bytes
    result = {
        "losses": losses,
        "engine": engine.state_dict(dtype=torch.float32),
        "step": fzero.state_dict(state, module=model),
        "traffic": (sent, predicted),
    }
    engine.destroy()
    return result


@pytest.mark.slow  # eight processes on two cores: about 20 s each
@pytest.mark.parametrize("name", list(POD_CASES))
def test_the_finer_split_runs_with_replicas_or_hpz_beside_it(name):
    result = run_world(pods_case, 8, name)
    engine_losses, step_losses = result["losses"]
    assert engine_losses == step_losses
    for key, expected in result["engine"].items():
        assert torch.equal(result["step"][key], expected), key
    _, ref_state = torch_reference(
        lambda groups: torch.optim.AdamW(
            [p for group in groups for p in group["params"]], lr=LR, weight_decay=0.01
        ),
        steps=STEPS, micro=MICRO, accum=ACCUM, world=8, clip=CLIP,
    )  # fmt: skip
    error = max((result["engine"][k] - v).abs().max().item() for k, v in ref_state.items())
    assert error <= 1e-6, error
    sent, predicted = result["traffic"]
    assert sent == predicted, (sent, predicted)
    if name.startswith("replicas"):  # each shard averaged over the pods
        assert sent[(frozenset({"pod"}), "all_reduce")] > 0
    if name.endswith(", node first"):  # the exchange within the pod
        assert sent[(frozenset({"node", "local"}), "all_to_all")] > 0
    elif name == "every axis, local first":  # the exchange over the world
        assert sent[(frozenset({"world"}), "all_to_all")] > 0
    elif name == "replicas":
        pass
    elif name == "hpz":  # backward gathers within the node, from hpZ's secondary copy
        assert sent[(frozenset({"local"}), "all_gather")] > 0
    else:  # one gather per axis, never over both at once
        assert (frozenset({"node", "local"}), "all_gather") not in sent
        assert sent[(frozenset({"node"}), "all_gather")] > 0


@pytest.mark.slow  # eight processes, then two and one
def test_the_finer_split_with_replicas_resumes_and_restores_under_zero3(tmp_path):
    result = run_world(replicas_save_case, 8, str(tmp_path))
    assert result["resumed"]
    for world in (2, 1):
        restored = run_world(restore_case, world, str(tmp_path))
        assert restored.keys() == result["saved"].keys()
        for key, value in result["saved"].items():
            assert torch.equal(restored[key], value), (world, key)


# ---- checkpoints: resume exactly, restore under plain ZeRO-3 at world 2 and 1 -------------------


def save_case(rank: int, world: int, root: str, name: str) -> dict:
    """The engine: 2 steps, save, 1 more; a fresh engine loads and runs that step bitwise
    (`engine_resumes`). train_step: save mid-window (3 micro-steps: the gradients at
    their split), resume bitwise. Returns the saved tensor states."""
    saved, resumed = engine_resumes(
        lambda seed: _engine(name, seed=seed), lambda i, a: _rows(rank, i, a), f"{root}/engine"
    )
    mid_window = _state_resume(rank, f"{root}/state", name)
    return {"saved": saved, "resumed": resumed, "mid-window": mid_window}


def _state_resume(rank: int, root: str, name: str) -> bool:
    stage = CASES[name][0]
    plan = _plan(name)

    def setup(seed: int):
        torch.manual_seed(seed)
        model = Net()
        state = fzero.init(model, plan, _optimizer(), config=_config(stage))
        return state, fzero.train_step(_loss_fn(model), plan, _optimizer(), config=_config(stage))

    def run(step, state, first, count):
        for m in range(first, first + count):
            state, _ = step(state, _rows(rank, m // ACCUM, m % ACCUM))
        return state

    state, step = setup(0)
    state = run(step, state, 0, 3)
    fzero.checkpoint.save(root, state, optimizer=_optimizer(), tag="s")
    straight = fzero.state_dict(run(step, state, 3, 3))
    fresh, step = setup(7)
    restored = fzero.checkpoint.restore(root, fresh, optimizer=_optimizer())
    resumed = fzero.state_dict(run(step, restored.state, 3, 3))
    return all(torch.equal(straight[k], resumed[k]) for k in straight)


def restore_case(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(5)
    model = Net()
    plan = partition.plan(partition.describe(model), world_size=world, stage=3)
    state = fzero.init(model, plan, _optimizer())
    restored = fzero.checkpoint.restore(root, state, optimizer=_optimizer(), module=model)
    return _tensor_states(restored.state)


@pytest.mark.slow  # four ranks, then two and one: 29 s on two loaded cores
def test_a_finer_optimizer_split_resumes_exactly_and_restores_under_zero3(tmp_path):
    for index, name in enumerate(CASES):
        root = str(tmp_path / f"case{index}")
        result = run_world(save_case, WORLD, root, name)
        assert result["resumed"] and result["mid-window"], name
        report, intact = fzero.checkpoint.inspect(f"{root}/engine")
        split = "+".join(_order(name))
        assert intact and f"split over {split} (gradients and parameters over local)" in report
        for world in (2, 1):
            restored = run_world(restore_case, world, f"{root}/engine")
            assert restored.keys() == result["saved"].keys(), name
            for key, value in result["saved"].items():
                assert torch.equal(restored[key], value), (name, world, key)


# ---- the plan alone: wire format, queries, refusals ------------------------------------------


def _mesh_plan(rule, mesh: dict | None = None, stage: int = 3) -> partition.Plan:
    manifest = partition.describe(Net())
    preset = partition.Custom("mine", rule, stage=stage)
    return partition.mesh_plan(manifest, Mesh(mesh or MESH), preset, persistence_threshold=0)


def test_the_finer_split_is_plain_data_and_old_plans_keep_their_bytes():
    plan = _plan("mics zero3-like")
    assert plan.mesh.shard == ("local", "node") and plan.mesh.grads_shard == ("local",)
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    mics = partition.executable(_mesh_plan(lambda mesh, unit: partition.MiCS()(mesh, unit)))
    assert b"optimizer_extra" in partition.to_bytes(plan)
    assert b"optimizer_extra" not in partition.to_bytes(mics)  # written only when set
    assert partition.plan_digest(plan) != partition.plan_digest(mics)
    unit = plan.units[1]  # process (node=1, local=0) is plan rank 1: local 0's half, quarter 1
    assert plan.grads_range(unit, 1) == (0, unit.numel // 2)
    assert unit.shard_range(1) == (unit.numel // 4, unit.numel // 2)
    assert plan.optimizer_in_grads(unit, 1) == slice(unit.numel // 4, unit.numel // 2)


def test_comm_volume_and_memory_of_the_finer_split_beside_zero2_and_zero3_within_the_node():
    """Per step (2 micro-steps): the gradients cross `node` once, as a reduce-scatter of
    the half each rank accumulated (half the bytes of MiCS's all-reduce of it, which runs
    every micro-step); the optimizer state is a quarter per rank, not a half."""
    finer = {name: partition.executable(_mesh_plan(_rule(split), stage=stage))
             for name, (stage, split) in CASES.items()}  # fmt: skip
    within = {  # ZeRO-2 and ZeRO-3 within the node (MiCS), replicated across it
        s: partition.executable(_mesh_plan(_split(("local",) * (s == 3), ("local",), ("local",))))
        for s in (2, 3)
    }
    numel = sum(u.numel for u in within[2].units)
    for name, plan in finer.items():
        stage = CASES[name][0]
        rows = partition.comm_volume(plan, accumulation_steps=ACCUM)
        node = {(r.operation, r.what): r for r in rows if r.axes == ("node",)}
        across = node[("reduce_scatter", "gradients across replicas")]
        assert across.calls == len(plan.units) and across.bytes == numel // 2 * 4
        publish = node[("all_gather", "parameters after the update")]
        assert publish.bytes == numel // 2 * 4 and publish.world_size == 2
        mics = partition.comm_volume(within[stage], accumulation_steps=ACCUM)
        replicas = next(r for r in mics if r.what == "gradients across replicas")
        assert replicas.operation == "all_reduce" and replicas.bytes == ACCUM * numel // 2 * 4
        ours = partition.volume_by_axes(rows)[("node",)]
        theirs = partition.volume_by_axes(mics)[("node",)]
        assert ours < theirs
        memory = partition.memory_per_rank(plan, 0)
        assert memory.optimizer_state == 2 * numel // 4 * 4  # Adam's two moments, a quarter
        assert memory.grads == numel // 2 * 4  # fp32 accumulators, over local: a half
        mics_memory = partition.memory_per_rank(within[stage], 0)
        assert mics_memory.optimizer_state == 2 * memory.optimizer_state


def _refusal(rule, mesh: dict | None = None, stage: int = 3) -> str:
    with pytest.raises(PlanError) as caught:
        _mesh_plan(rule, mesh, stage)
    return str(caught.value)


def _split(params=(), grads=(), optimizer=(), **more):
    def rule(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        return UnitSharding(
            mesh.sharding(*params), mesh.sharding(*grads), mesh.sharding(*optimizer), **more
        )

    return rule


def test_validate_refuses_what_is_not_run_naming_the_unit_kind_and_axes():
    # the optimizer coarser than the gradients: an update needs its gradient reduced here
    message = _refusal(_split(grads=("local", "node"), optimizer=("local",)), stage=2)
    assert "unit 'embed' grads: split over ('local', 'node'), the optimizer state over " in message
    assert "axis 'node' is missing there" in message
    # the gradients' axes in another order in the optimizer's split: over the same ranks,
    # each rank's optimizer shard in another's gradient shard with no axis to exchange over
    message = _refusal(_split(grads=("node", "local"), optimizer=("local", "node")), stage=2)
    assert "unit 'embed' grads: split over ('node', 'local'), the optimizer state over " in message
    assert "these axes are in the order ('local', 'node') there" in message

    # one unit's optimizer finer, another's as its gradients: the others run on their own
    # axes (`Unit.shard_axes`, tests/test_unit_groups.py); two finer splits do not
    def some_finer(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        finer = ("local", "node") if unit.module == "head" else ("local",)
        return _split(grads=("local",), optimizer=finer)(mesh, unit)

    plan = partition.executable(_mesh_plan(some_finer, stage=2))
    assert plan.mesh.optimizer_extra == ("node",)
    axes = {u.module: u.shard_axes for u in plan.units}
    assert axes["head"] is None and axes["embed"] == ("local",)

    def two_finer(mesh: Mesh, unit: partition.Unit) -> UnitSharding:
        finer = ("local", "node") if unit.module == "head" else ("local", "pod")
        return _split(grads=("local",), optimizer=finer)(mesh, unit)

    message = _refusal(two_finer, PODS, stage=2)
    assert "unit 'head' optimizer: split over ('local', 'node'), other units' over " in message
    assert "one optimizer split finer than the gradients; other units split" in message


def test_the_optimizer_s_axes_in_any_order_around_the_gradients_run_as_an_exchange():
    """The optimizer over the gradients' axes and more, in any order: its shards are the
    plan's ranks in its order, its blocks exchanged with the gradients' order (the extra
    axes in mesh order); each process's ranges are the mesh plan's."""
    pods = Mesh(PODS)
    for order in [("local", "node", "pod"), ("pod", "local", "node"), ("node", "pod", "local")]:
        mp = _mesh_plan(_split(grads=("local",), optimizer=order), PODS, stage=2)
        plan = partition.executable(mp)
        assert plan.mesh.shard == order and plan.mesh.optimizer_extra == ("pod", "node")
        assert plan.mesh.gradient_order == ("local", "pod", "node") and plan.mesh.permuted
        # the boundary's reduce-scatter over the extra axes, the exchange over all of them
        assert {("pod", "node"), order} <= set(partition.process_groups(mp))
        for process in range(pods.size):
            rank = pods.index_in_group(process, order)
            assert plan.rank_in_plan_order(plan.rank_in_gradient_order(rank)) == rank
            for index, unit in enumerate(plan.units):
                said = mp.kind_range(index, "optimizer", process)
                assert unit.shard_range(rank) == said, (order, process, unit.name)
                said = mp.kind_range(index, "grads", process)
                assert plan.grads_range(unit, rank) == said, (order, process, unit.name)
                start = plan.grads_range(unit, rank)[0]
                slot = plan.optimizer_in_grads(unit, rank)  # the block the boundary leaves
                index_in_gradients = pods.index_in_group(process, plan.mesh.gradient_order)
                assert (start + slot.start, start + slot.stop) == unit.shard_range(
                    index_in_gradients
                )
    rows = partition.comm_volume(plan)
    exchanges = [r for r in rows if r.exchange]
    assert {r.what for r in exchanges} == {
        "gradients to optimizer shards",
        "updated params to grad blocks",
    }
    assert all(r.operation == "all_to_all" and r.wire_bytes == r.bytes for r in exchanges)
    # a whole-tensor optimizer's directions: back to the grad blocks, then gathered whole
    unit = plan.units[plan.unit_of("blocks.0.0.weight")]
    rows = partition.comm_volume(plan, whole_tensors={"blocks.0.0.weight"})
    directions = {(r.operation, r.axes): r.bytes for r in rows if "directions" in r.what}
    assert directions == {
        ("all_to_all", order): unit.numel // 8 * 4,
        ("all_gather", ("pod", "node")): unit.numel // 2 * 4,
        ("all_gather", ("local",)): unit.numel * 4,
    }
    with pytest.raises(PlanError, match="whole_tensors names 'nope', which is not a tensor"):
        partition.comm_volume(plan, whole_tensors={"nope"})


def test_a_hand_built_plan_naming_an_axis_of_size_1_costs_what_its_run_sends():
    """A mesh with an axis of size 1 named in the gradients' split: the ZeRO-1 unit beside
    the finer split is reduced and published in two hops, as `executable` runs it, and
    the rows are named without the axis (the plan that runs splits over none)."""
    mesh = Mesh({"pod": 1, **MESH})

    def rule(m: Mesh, unit: partition.Unit) -> UnitSharding:
        if unit.name.startswith("embed"):  # ZeRO-1 beside the finer split
            return UnitSharding(m.replicated, m.replicated, m.sharding("local", "node"))
        return UnitSharding(
            m.replicated, m.sharding("pod", "local"), m.sharding("pod", "local", "node")
        )

    mp = partition.mesh_plan(
        partition.describe(Net()), mesh, partition.Custom("mine", rule, stage=2),
        persistence_threshold=0,
    )  # fmt: skip
    assert mp.mesh.grads_shard == ("local",) and mp.mesh.optimizer_extra == ("node",)
    rows = partition.comm_volume(mp, accumulation_steps=ACCUM)
    # only the world's control all-reduces name every axis; no collective runs over pod
    assert rows and all("pod" not in r.axes or r.axes == mesh.names for r in rows)
    embed = mp.shardings[0]
    assert publish_hops(embed, ("local",), mesh) == (("node",), ("local",))
    assert partition.process_groups(mp) == (("node", "local"), ("node",), ("local",))


def test_a_stage_plan_that_states_the_finer_split_badly_is_refused():
    plan = _plan("zero2-like")
    for extra in [("local", "node"), ("local", "local"), ("pod",)]:  # all, twice, unknown
        bad = dataclasses.replace(plan.mesh, optimizer_extra=extra)
        with pytest.raises(PlanError, match=rf"plan optimizer_extra {re.escape(str(extra))}: "):
            partition.validate(dataclasses.replace(plan, mesh=bad))
    # the gradients over "node" and the optimizer over ("local", "node"): a permuted order
    other = dataclasses.replace(plan.mesh, optimizer_extra=("local",))
    assert other.permuted and other.grads_shard == ("node",)
    partition.validate(dataclasses.replace(plan, mesh=other))
    # an axis of size 1 orders nothing: no exchange where it alone is out of place
    single = partition.OnMesh(
        (("node", 2), ("local", 2), ("x", 1)), ("x", "local", "node"), optimizer_extra=("node",)
    )
    assert single.gradient_order == ("local", "x", "node") and not single.permuted
    staged = dataclasses.replace(plan.units[0], stage=1)  # ZeRO-1 beside it runs
    partition.validate(dataclasses.replace(plan, units=(staged, *plan.units[1:])))
    numel = plan.units[0].numel
    uneven = dataclasses.replace(plan.units[0], bounds=(0, numel, numel, numel, numel))
    with pytest.raises(PlanError, match=r"unit 'embed' optimizer: .* has uneven shards"):
        partition.validate(dataclasses.replace(plan, units=(uneven, *plan.units[1:])))
