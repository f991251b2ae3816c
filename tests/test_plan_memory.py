"""Where a plan's states live and their dtypes are plan data (`partition.Memory`): pure
checks in one process, and runs where a strategy's plan says what a config would (the
optimizer on the host or in a swap file, bf16 moments) and trains exactly as the config
saying it does, in both doors."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import pytest
import torch
from torch import nn

import fzero
from fzero import partition
from fzero.partition import Memory, PlanError
from fzero.partition._mesh_plan import as_kind_plan
from tests._dist import run_world

STEPS, MICRO = 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))


def _manifest() -> partition.Manifest:
    return partition.describe(_model())


def test_memory_round_trips_and_plans_that_say_nothing_keep_their_bytes():
    plain = partition.plan(_manifest(), world_size=2, stage=3)
    assert plain.memory == Memory()
    assert "memory" not in msgpack.unpackb(partition.to_bytes(plain))  # old digests hold
    said = Memory(params="host", optimizer="nvme", states="bf16")
    plan = partition.plan(_manifest(), world_size=2, stage=3, memory=said)
    assert plan.memory == said and partition.from_bytes(partition.to_bytes(plan)) == plan
    assert partition.plan_digest(plan) != partition.plan_digest(plain)
    header = partition.part_fields(plan, 0)["memory"]
    assert header == "['host', 'nvme', 'fp32', 'bf16']"
    mesh = partition.mesh_plan(
        _manifest(), partition.Mesh({"node": 2, "local": 2}), "mics", memory=said
    )
    assert partition.from_bytes(partition.to_bytes(mesh)) == mesh
    assert mesh.memory == said and as_kind_plan(mesh).memory == said


@pytest.mark.parametrize(
    ("stage", "memory", "message"),
    [
        (3, Memory(optimizer="disk"), "memory.optimizer is 'disk'; allowed: device, host, nvme"),
        (3, Memory(states="fp16"), "memory.states is 'fp16'; allowed: fp32, bf16"),
        (
            0,
            Memory(optimizer="host"),
            "memory.optimizer is 'host' (DeepSpeed's zero_optimization.offload_optimizer.device "
            "is 'cpu') but unit '0' is split as stage 0",
        ),
        (
            2,
            Memory(params="nvme"),
            "memory.params is 'nvme' (DeepSpeed's zero_optimization.offload_param.device is "
            "'nvme') but the plan is stage 2",
        ),
    ],
)
def test_validate_names_what_no_plan_may_say(stage, memory, message):
    with pytest.raises(PlanError) as error:
        partition.plan(_manifest(), world_size=2, stage=stage, memory=memory)
    assert message in str(error.value)


def test_with_memory_fills_what_the_plan_leaves_unsaid_and_refuses_contradictions():
    plan = partition.plan(_manifest(), world_size=2, stage=3, memory=Memory(optimizer="nvme"))
    merged = partition.with_memory(plan, Memory(params="host", states="bf16"))
    assert merged.memory == Memory(params="host", optimizer="nvme", states="bf16")
    assert partition.with_memory(plan, Memory(optimizer="nvme")) == plan
    with pytest.raises(PlanError, match=r"memory\.optimizer is 'nvme' but the config says 'host'"):
        partition.with_memory(plan, Memory(optimizer="host"))


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_the_functional_doors_refuse_parameter_shards_they_would_keep_in_memory(where):
    """Only the engine places stage 3's parameter shards off the device; `fzero.init`,
    `train_step` and `eval_step` name a plan (or config) that says so rather than keep
    them in memory against it."""
    plan = partition.plan(
        _manifest(), world_size=1, stage=3, memory=Memory(params=where), persistence_threshold=0
    )
    optimizer = fzero.optim.adamw(lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": MICRO}
    for door, call in (
        ("fzero.init", lambda: fzero.init(_model(), plan, optimizer, config=config)),
        (
            "fzero.train_step",
            lambda: fzero.train_step(lambda p, b: 0, plan, optimizer, config=config),
        ),
        ("fzero.eval_step", lambda: fzero.eval_step(lambda p, b: 0, plan, config=config)),
    ):
        with pytest.raises(PlanError, match=rf"{door}: memory\.params is '{where}' .*the engine"):
            call()
    offload = {"stage": 3, "offload_param": {"device": "cpu"}}
    plain = partition.plan(_manifest(), world_size=1, stage=3, persistence_threshold=0)
    with pytest.raises(PlanError, match=r"fzero\.init: memory\.params is 'host'"):
        fzero.init(_model(), plain, optimizer, config={**config, "zero_optimization": offload})


def test_memory_per_rank_reads_where_the_plan_keeps_its_states():
    said = Memory(optimizer="host", states="bf16")
    plan = partition.plan(_manifest(), world_size=2, stage=2, memory=said)
    plain = dataclasses.replace(plan, memory=Memory())
    estimate = partition.memory_per_rank(plan, 1)
    assert estimate == partition.memory_per_rank(
        plain, 1, offload_optimizer=True, state_dtype="bfloat16"
    )
    assert estimate.host == estimate.optimizer_state + estimate.master > 0
    assert estimate.optimizer_state * 2 == partition.memory_per_rank(plain, 1).optimizer_state


def _said_by(memory: Memory):
    """A strategy of a researcher's own that says where the states live."""

    def strategy(manifest, *, world_size, stage, **options):
        laid = partition.flat_even(manifest, world_size=world_size, stage=stage, **options)
        return dataclasses.replace(laid, memory=memory)

    return strategy


def _config(stage: int, where: str, nvme_path: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "aio": {"block_size": 8192, "thread_count": 1},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": where, "nvme_path": nvme_path},
        },
    }


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, 8, generator=generator), torch.randn(MICRO, 4, generator=generator)


def _train_functional(model, plan, state, config) -> tuple[list[float], dict]:
    """`STEPS` steps of `train_step` from `state`: the losses and the weights."""

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, plan, fzero.optim.adamw(), config=config)
    rank, losses = torch.distributed.get_rank(), []
    for i in range(STEPS):
        state, metrics = step(state, _batch(rank, i))
        losses.append(metrics["loss"].item())
    return losses, fzero.state_dict(state, module=model)


def _train_engine(engine) -> list[float]:
    return _train_range(engine, 0, STEPS)


def _doors_case(rank: int, world: int, stage: int, kind: str, root: str) -> dict:
    """The same training three ways: the config says where the optimizer lives (engine),
    a strategy's plan says it and the config only where files go (engine), and a plan
    that says it through `fzero.init` and `train_step` (no offload key at all)."""
    said = Memory(optimizer=kind)
    device = {"host": "cpu", "nvme": "nvme"}[kind]
    path = f"{root}/rank{rank}"
    for where in ("config", "plan", "state"):
        os.makedirs(f"{path}/{where}")
    out: dict = {}
    by_config = fzero.shard(_model(), config=_config(stage, device, f"{path}/config"))
    out["config"] = _train_engine(by_config), by_config.state_dict(dtype=torch.float32)
    out["config memory"] = by_config.plan.memory == said
    by_plan = fzero.shard(
        _model(), config=_config(stage, "none", f"{path}/plan"), strategy=_said_by(said)
    )
    out["plan"] = _train_engine(by_plan), by_plan.state_dict(dtype=torch.float32)
    out["plan swaps"] = (by_plan.nvme is not None) == (kind == "nvme") and by_plan.offload
    out["plan memory"] = by_plan.plan.memory == said
    by_config.destroy()
    by_plan.destroy()

    model = _model()
    plan = partition.plan(partition.describe(model), world_size=world, stage=stage, memory=said)
    config = _config(stage, "none", f"{path}/state")
    state = fzero.init(model, plan, fzero.optim.adamw(), config=config)
    out["state swaps"] = (state.residence is not None) == (kind == "nvme")
    out["train_step"] = _train_functional(model, plan, state, config)
    try:  # a plan and a config that say different things: named, nothing built
        fzero.shard(_model(), config=_config(stage, "cpu" if kind == "nvme" else "nvme", path),
                    strategy=_said_by(said))  # fmt: skip
        out["conflict"] = "no error"
    except ValueError as error:
        out["conflict"] = str(error)
    return out


@pytest.mark.parametrize(("stage", "kind"), [(2, "nvme"), (3, "host")])
def test_a_plan_that_says_where_the_optimizer_lives_trains_as_the_config_saying_it(
    stage, kind, tmp_path
):
    out = run_world(_doors_case, 2, stage, kind, str(tmp_path))
    assert out["config memory"] and out["plan memory"]
    assert out["plan swaps"] and out["state swaps"]
    losses, weights = out["config"]
    for door in ("plan", "train_step"):
        assert out[door][0] == losses, door  # bit for bit
        for name, value in weights.items():
            assert torch.equal(out[door][1][name], value), (door, name)
    other = "cpu" if kind == "nvme" else "nvme"
    assert f"the plan's memory.optimizer is {kind!r} but the config" in out["conflict"]
    assert f"says {dict(cpu='host', nvme='nvme')[other]!r}" in out["conflict"]


def _rank_memory_case(rank: int, world: int) -> str:
    memory = Memory(optimizer="host") if rank == 0 else Memory()
    try:
        fzero.shard(_model(), stage=2, strategy=_said_by(memory))
    except fzero.comm.RankDisagreement as error:
        return str(error)
    return "no error"


def test_ranks_that_keep_states_in_different_places_are_named():
    message = run_world(_rank_memory_case, 2)  # rank 0's; rank 1 raising fails run_world
    assert "the ranks hold different plans" in message
    assert "the plan's header" in message and "field 'memory'" in message


# ---- NVMe units beside units in memory, in one plan -----------------------------------

SPLIT = {"0": "nvme", "3": "nvme"}  # the first and last units in the swap file, "2" not


def _nvme_config(stage: int, path: str, accumulation: int = 2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.5,
        "aio": {"block_size": 8192, "thread_count": 1},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "none", "nvme_path": path},
        },
    }


def _mixed_case(rank: int, world: int, stage: int, root: str) -> dict:
    path = f"{root}/swap{rank}"
    os.makedirs(path, exist_ok=True)
    config = _nvme_config(stage, path)
    out: dict = {}
    plain = fzero.shard(_model(), config=config)
    out["plain"] = _train_engine(plain), plain.state_dict(dtype=torch.float32)
    plain.destroy()

    mixed = fzero.shard(_model(), config=config, strategy=partition.with_unit_memory(SPLIT))
    residency = mixed.runtime.residency
    out["held"] = [residency.holds(i) for i in range(len(mixed.plan.units))]
    out["masters"] = [rt.master.numel() for rt in mixed.runtime.units]
    losses = _train_range(mixed, 0, STEPS // 2)
    mixed.save_checkpoint(f"{root}/ckpt", tag="mid")
    losses += _train_range(mixed, STEPS // 2, STEPS)
    out["mixed"] = losses, mixed.state_dict(dtype=torch.float32)
    mixed.destroy()

    resumed = fzero.shard(_model(), config=config, strategy=partition.with_unit_memory(SPLIT))
    resumed.load_checkpoint(f"{root}/ckpt", tag="mid")
    out["resumed"] = _continue(resumed), resumed.state_dict(dtype=torch.float32)
    resumed.destroy()
    zero3 = fzero.shard(_model(), config=_nvme_config(3, path))  # all in memory, stage 3
    zero3.load_checkpoint(f"{root}/ckpt", tag="mid")
    out["zero3"] = _continue(zero3), zero3.state_dict(dtype=torch.float32)
    zero3.destroy()

    model = _model()
    plan = partition.plan(
        partition.describe(model), world_size=world, stage=stage, unit_memory=SPLIT
    )
    state = fzero.init(model, plan, fzero.optim.adamw(), config=config)
    out["state held"] = [state.residence.holds(i) for i in range(len(plan.units))]
    out["train_step"] = _train_functional(model, plan, state, config)
    try:
        fzero.shard(_model(), config=config, optimizer=fzero.optim.lamb(),
                    strategy=partition.with_unit_memory(SPLIT))  # fmt: skip
        out["lamb"] = "no error"
    except ValueError as error:
        out["lamb"] = str(error)
    return out


def _continue(engine) -> list[float]:
    return _train_range(engine, STEPS // 2, STEPS)


def _train_range(engine, start: int, stop: int) -> list[float]:
    rank, losses = torch.distributed.get_rank(), []
    for step in range(start, stop):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_units_beside_units_in_memory_train_as_all_in_memory(stage, tmp_path):
    out = run_world(_mixed_case, 2, stage, str(tmp_path))
    assert out["held"] == [True, False, True] == out["state held"]
    assert out["masters"][0] == out["masters"][2] == 0 < out["masters"][1]  # evicted: on disk
    losses, weights = out["plain"]
    for run in ("mixed", "train_step"):
        assert out[run][0] == losses, run  # bit for bit: where states live changes nothing
        for name, value in weights.items():
            assert torch.equal(out[run][1][name], value), (run, name)
    for run in ("resumed", "zero3"):  # from the checkpoint saved mid-run
        assert out[run][0] == losses[STEPS // 2 :], run
        for name, value in weights.items():
            assert torch.equal(out[run][1][name], value), (run, name)
    assert "needs tensor norms" in out["lamb"]
    assert "units ['0', '3'] in the swap file" in out["lamb"]


PARAMS_SPLIT = {"0": {"params": "nvme"}, "3": {"params": "host", "optimizer": "nvme"}}


def _params_case(rank: int, world: int, root: str) -> dict:
    """Stage 3 with some units' parameter shards in the swap file or on the host (per
    unit, `Unit.params_memory`) beside units on the device, against all on the device;
    and a plan-wide `offload_param` nvme with one unit kept on the device."""
    path = f"{root}/swap{rank}"
    os.makedirs(path, exist_ok=True)
    config = _nvme_config(3, path)
    config["zero_optimization"]["offload_param"] = {"device": "none", "nvme_path": path}
    out: dict = {}
    plain = fzero.shard(_model(), config=config)
    out["plain"] = _train_engine(plain), plain.state_dict(dtype=torch.float32)
    plain.destroy()

    mixed = fzero.shard(_model(), config=config, strategy=partition.with_unit_memory(PARAMS_SPLIT))
    store = mixed.runtime.param_shards.store
    out["where"] = [mixed.plan.params_memory(u) for u in mixed.plan.units]
    out["on disk"] = [store.on_disk(i) for i in range(len(mixed.plan.units))]
    out["shards"] = [rt.param_shard.numel() if rt.param_shard is not None else None
                     for rt in mixed.runtime.units]  # fmt: skip
    losses = _train_range(mixed, 0, STEPS // 2)
    mixed.save_checkpoint(f"{root}/ckpt", tag="mid")
    losses += _train_range(mixed, STEPS // 2, STEPS)
    out["mixed"] = losses, mixed.state_dict(dtype=torch.float32)
    mixed.destroy()
    resumed = fzero.shard(_model(), config=config)  # all on the device, from the checkpoint
    resumed.load_checkpoint(f"{root}/ckpt", tag="mid")
    out["resumed"] = _continue(resumed), resumed.state_dict(dtype=torch.float32)
    resumed.destroy()

    config["zero_optimization"]["offload_param"]["device"] = "nvme"
    kept = partition.with_unit_memory({"2": {"params": "device"}})
    most = fzero.shard(_model(), config=config, strategy=kept)
    out["most where"] = [most.plan.params_memory(u) for u in most.plan.units]
    out["most"] = _train_engine(most), most.state_dict(dtype=torch.float32)
    most.destroy()
    return out


def test_parameter_shards_live_where_each_unit_says_and_train_as_on_the_device(tmp_path):
    out = run_world(_params_case, 2, str(tmp_path))
    assert out["where"] == ["nvme", "device", "host"]
    assert out["on disk"] == [True, False, False]
    assert out["shards"][0] == 0  # in the swap file: the record keeps an empty tensor
    assert out["most where"] == ["nvme", "device", "nvme"]
    losses, weights = out["plain"]
    for run in ("mixed", "most"):
        assert out[run][0] == losses, run  # bit for bit: where shards live changes nothing
        for name, value in weights.items():
            assert torch.equal(out[run][1][name], value), (run, name)
    assert out["resumed"][0] == losses[STEPS // 2 :]
    for name, value in weights.items():
        assert torch.equal(out["resumed"][1][name], value), name


def test_unit_parameter_memory_is_checked():
    with pytest.raises(PlanError, match=r"unit_memory\['0'\] names kind 'moments'; allowed"):
        partition.plan(_manifest(), world_size=2, stage=3, unit_memory={"0": {"moments": "bf16"}})
    with pytest.raises(PlanError, match=r"unit '0': master_dtype is 'fp16'; allowed"):
        partition.plan(_manifest(), world_size=2, stage=3, unit_memory={"0": {"master": "fp16"}})
    with pytest.raises(PlanError, match=r"unit '0': master_dtype is 'bf16' with its optimizer"):
        partition.plan(
            _manifest(), world_size=2, stage=3,
            unit_memory={"0": {"master": "bf16", "optimizer": "nvme"}},
        )  # fmt: skip
    said = partition.plan(_manifest(), world_size=2, stage=3, unit_memory={"0": {"master": "bf16"}})
    assert [said.master_dtype(u) for u in said.units] == ["bf16", "fp32", "fp32"]
    assert partition.from_bytes(partition.to_bytes(said)) == said
    lines = partition.format_plan(said).splitlines()  # a unit says what it keeps its own way
    assert lines[1].endswith(" memory=master:bf16") and "memory=" not in lines[0] + lines[4]
    with pytest.raises(PlanError, match=r"unit '0': states_dtype is 'fp16'; allowed"):
        partition.plan(_manifest(), world_size=2, stage=3, unit_memory={"0": {"states": "fp16"}})
    with pytest.raises(PlanError, match=r"states_dtype is 'bf16' with its optimizer on 'nvme'"):
        partition.plan(
            _manifest(), world_size=2, stage=3,
            unit_memory={"0": {"states": "bf16", "optimizer": "nvme"}},
        )  # fmt: skip
    with pytest.raises(PlanError, match=r"unit '0': params_memory is 'disk'; allowed"):
        partition.plan(_manifest(), world_size=2, stage=3, unit_memory={"0": {"params": "disk"}})
    with pytest.raises(
        PlanError, match=r"params_memory is 'nvme' but the unit is split as stage 2"
    ):
        partition.plan(
            _manifest(), world_size=2, stage=3, unit_stages={"0": 2},
            unit_memory={"0": {"params": "nvme"}},
        )  # fmt: skip
    plan = partition.plan(
        _manifest(), world_size=2, stage=3, persistence_threshold=0,
        unit_memory={"3": {"params": "host"}},
    )  # fmt: skip
    assert [plan.params_memory(u) for u in plan.units] == ["device", "device", "host"]
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    with pytest.raises(PlanError, match=r"fzero\.init: unit '3''s params_memory is 'host'"):
        fzero.init(
            _model(), plan, fzero.optim.adamw(), config={"train_micro_batch_size_per_gpu": 2}
        )


def _moments(units) -> list[dict[str, torch.Tensor]]:
    return [{k: getattr(u.state, k).clone() for k in ("exp_avg", "exp_avg_sq")} for u in units]


def _masters(units) -> list[dict[str, torch.Tensor]]:
    return [{"master": u.master.clone()} for u in units]


# what `unit_memory={"0": {kind: "bf16"}}` sets: the config key saying it plan-wide, what
# one step leaves, and each unit's dtype (the functional state's units have `optim`)
_DTYPE_KINDS = {
    "states": ("bf16_optimizer_states", _moments, lambda u: u.state.exp_avg.dtype),
    "master": ("bf16_master_weights_and_grads", _masters, lambda u: u.master.dtype),
}


def _unit_dtype_case(rank: int, world: int, stage: int, root: str, kind: str) -> dict:
    """bf16 `kind` ("states": `Unit.states_dtype`; "master": `Unit.master_dtype`) for
    unit "0" only, fp32 for the rest, bf16 compute: each unit's tensors after one step
    against the all-bf16 and all-fp32 runs', both doors, the bytes held against the
    plan's, and a checkpoint loaded into an all-fp32 run."""
    key, read, dtype_of = _DTYPE_KINDS[kind]
    config = _nvme_config(stage, root, accumulation=1)
    out: dict = {}
    for name, strategy, bf16 in (
        ("fp32", None, False),
        ("bf16", None, True),
        ("unit", partition.with_unit_memory({"0": {kind: "bf16"}}), False),
    ):
        said = dict(config, bf16={"enabled": True, key: bf16})
        engine = fzero.shard(_model(), config=said, strategy=strategy)
        _train_range(engine, 0, 1)
        units = engine.runtime.units
        out[name] = read(units)
        if name == "unit":
            out["held"] = engine.memory_held(), engine.memory_planned()
            out["dtypes"] = [str(dtype_of(rt)) for rt in units]
            out["losses"] = _train_range(engine, 1, STEPS)
            engine.save_checkpoint(f"{root}/ckpt", tag="t")
            wide = fzero.shard(_model(), config=dict(said, bf16={"enabled": True}))
            wide.load_checkpoint(f"{root}/ckpt", tag="t")
            out["saved"], out["loaded"] = read(units), read(wide.runtime.units)
            out["continued"] = _train_range(wide, STEPS, STEPS + 1)
            wide.destroy()
            model = _model()
            plan = partition.plan(
                partition.describe(model), world_size=world, stage=stage,
                persistence_threshold=0, unit_memory={"0": {kind: "bf16"}},
            )  # fmt: skip
            state = fzero.init(model, plan, fzero.optim.adamw(), precision="bf16", config=said)
            views = [UnitRuntimeLike(u.master, u.optim) for u in state.units]
            out["functional dtypes"] = [str(dtype_of(v)) for v in views]
            try:
                fzero.init(_model(), plan, fzero.optim.adamw(), config=config)  # fp32
                out["fp32 compute"] = "no error"
            except PlanError as error:
                out["fp32 compute"] = str(error)
        engine.destroy()
    return out


class UnitRuntimeLike:
    """A functional `UnitState` read as the engine's unit records are (`master`, `state`)."""

    def __init__(self, master: torch.Tensor, state) -> None:
        self.master, self.state = master, state


@pytest.mark.parametrize("kind", ["states", "master"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_units_moments_or_masters_in_bf16_beside_fp32_ones(stage, kind, tmp_path):
    out = run_world(_unit_dtype_case, 2, stage, str(tmp_path), kind)
    assert out["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32"]
    assert out["functional dtypes"] == out["dtypes"]
    held, planned = out["held"]
    assert held == planned  # the plan counts each unit's bytes in its own dtype
    # one step from the same weights and gradients: each unit's tensors as its dtype's run
    for index, run in ((0, "bf16"), (1, "fp32"), (2, "fp32")):
        for key, value in out["unit"][index].items():
            assert torch.equal(value, out[run][index][key]), (index, key)
    for saved, loaded in zip(out["saved"], out["loaded"]):
        for key, value in saved.items():
            assert loaded[key].dtype == torch.float32
            assert torch.equal(loaded[key], value.float()), key  # widened exactly
    assert len(out["continued"]) == 1
    if kind == "master":  # bf16 masters are bf16 parameters: bf16 compute only
        refused = "unit '0': master_dtype is 'bf16' but the compute dtype is 'fp32'"
        assert refused in out["fp32 compute"]


def test_unit_memory_keys_and_values_are_checked():
    with pytest.raises(PlanError, match=r"unit_memory key 'embed' names no unit"):
        partition.plan(_manifest(), world_size=2, stage=2, unit_memory={"embed": "nvme"})
    with pytest.raises(PlanError, match=r"unit '0': optimizer_memory is 'disk'; allowed"):
        partition.plan(_manifest(), world_size=2, stage=2, unit_memory={"0": "disk"})
    with pytest.raises(PlanError, match=r"unit '0''s optimizer_memory is 'nvme' but unit '0' is"):
        partition.plan(
            _manifest(), world_size=2, stage=1, unit_stages={"0": 0}, unit_memory={"0": "nvme"}
        )
    plan = partition.plan(_manifest(), world_size=2, stage=2, unit_memory={"3": "host"})
    assert [plan.optimizer_memory(u) for u in plan.units] == ["device", "device", "host"]
    # the swap file keeps every master in one dtype, the plan's (bf16 or fp32)
    nvme = Memory(optimizer="nvme", master="bf16")
    assert partition.plan(_manifest(), world_size=2, stage=3, memory=nvme).memory == nvme
    assert partition.from_bytes(partition.to_bytes(plan)) == plan


def _mesh_case(rank: int, world: int, root: str) -> dict:
    """MiCS on 2 x 2 (stage 3 within `local`, replicas over `node`): everything in memory,
    then the first and last units' optimizer in the swap file, in both doors."""
    path = f"{root}/swap{rank}"
    os.makedirs(path, exist_ok=True)
    config = _nvme_config(3, path)
    mesh = partition.Mesh({"node": 2, "local": 2})
    out: dict = {}
    plain = fzero.shard(_model(), config=config, strategy=partition.on_mesh(mesh, "mics"))
    out["plain"] = _train_engine(plain), plain.state_dict(dtype=torch.float32)
    plain.destroy()
    on_mesh = partition.with_unit_memory(SPLIT, strategy=partition.on_mesh(mesh, "mics"))
    mixed = fzero.shard(_model(), config=config, strategy=on_mesh)
    out["held"] = [mixed.runtime.residency.holds(i) for i in range(len(mixed.plan.units))]
    out["mixed"] = _train_engine(mixed), mixed.state_dict(dtype=torch.float32)
    mixed.destroy()

    model = _model()
    laid = partition.mesh_plan(
        partition.describe(model), mesh, "mics", strategy=partition.with_unit_memory(SPLIT),
        persistence_threshold=0,
    )  # fmt: skip
    state = fzero.init(model, laid, fzero.optim.adamw(), config=config)
    out["train_step"] = _train_functional(model, laid, state, config)
    return out


@pytest.mark.slow  # four ranks on two cores
def test_nvme_units_beside_units_in_memory_on_a_2x2_mesh(tmp_path):
    out = run_world(_mesh_case, 4, str(tmp_path))
    assert out["held"] == [True, False, True]
    losses, weights = out["plain"]
    for run in ("mixed", "train_step"):
        assert out[run][0] == losses, run
        for name, value in weights.items():
            assert torch.equal(out[run][1][name], value), (run, name)


def test_a_units_moment_dtype_is_counted_alike_on_a_mesh_and_as_run():
    """`memory_per_rank` of a mesh plan with one unit's moments in bf16 equals that of the
    plan both doors run for it, and is below the all-fp32 plan's by that unit's moments'
    two missing bytes each (two Adam moments)."""
    mesh = partition.Mesh({"node": 2, "local": 2})
    laid = partition.mesh_plan(
        _manifest(), mesh, "mics", persistence_threshold=0,
        strategy=partition.with_unit_memory({"0": {"states": "bf16"}}),
    )  # fmt: skip
    plain = partition.mesh_plan(_manifest(), mesh, "mics", persistence_threshold=0)
    assert [u.states_dtype for u in laid.units] == ["bf16", None, None]
    for rank in range(2):  # processes 0 and 1: node 0's, the plan's ranks 0 and 1
        said = partition.memory_per_rank(laid, rank)
        assert said == partition.memory_per_rank(partition.executable(laid), rank)
        unit = laid.units[0]
        part = unit.numel // mesh.group_size(laid.shardings[0].optimizer.shard)
        saved = partition.memory_per_rank(plain, rank).optimizer_state - said.optimizer_state
        assert saved == part * 2 * 2


def test_a_units_master_dtype_is_counted_alike_on_a_mesh_and_as_run():
    """`memory_per_rank` of a mesh plan with one unit's masters in bf16 (bf16 parameters:
    they are its master) equals that of the plan both doors run for it, and is below the
    all-fp32 plan's by that unit's four master bytes each; off the device, two."""
    mesh = partition.Mesh({"node": 2, "local": 2})
    for where, saved_bytes in (("device", 4), ("host", 2)):
        memory = Memory(optimizer=where)
        laid = partition.mesh_plan(
            _manifest(), mesh, "mics", persistence_threshold=0, memory=memory,
            strategy=partition.with_unit_memory({"0": {"master": "bf16"}}),
        )  # fmt: skip
        plain = partition.mesh_plan(
            _manifest(), mesh, "mics", persistence_threshold=0, memory=memory
        )
        assert [u.master_dtype for u in laid.units] == ["bf16", None, None]
        for rank in range(2):
            said = partition.memory_per_rank(laid, rank, param_dtype="bfloat16")
            ran = partition.memory_per_rank(
                partition.executable(laid), rank, param_dtype="bfloat16"
            )
            assert said == ran
            part = laid.units[0].numel // mesh.group_size(laid.shardings[0].optimizer.shard)
            before = partition.memory_per_rank(plain, rank, param_dtype="bfloat16")
            assert before.master - said.master == part * saved_bytes
            assert before.offloaded - said.offloaded == (part * 2 if where == "host" else 0)
