"""`fzero.init` / `fzero.train_step` / `fzero.state_dict`: the functional front door
reaches the engine's parameters bitwise (same reductions, same update kernels), keeps
stage 3's per-unit gathering, composes with torch.func (`grad_fn`), and refuses misuse."""

from __future__ import annotations

import itertools
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import fzero
from tests._dist import run_world
from tests.models import Awkward, Net, global_batch

MICRO, STEPS, LR = 2, 3, 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _config(stage: int, accum: int, clip: float, precision: str, offload: bool | str) -> dict:
    """`offload`: False, True (cpu), "nvme" (commit two_slots) or "in_place" (nvme)."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "zero_optimization": {
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 300,
        },
    }
    if offload is True:
        config["zero_optimization"].update(stage=stage, offload_optimizer={"device": "cpu"})
    elif offload:
        swap = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
        if offload == "in_place":
            swap["commit"] = "in_place"
        config["zero_optimization"].update(stage=stage, offload_optimizer=swap)
    if precision == "fp16":  # 2^15 overflows at the first step (skipped, scale halved), then trains
        config["fp16"] = {"enabled": True, "initial_scale_power": 15, "hysteresis": 1}
    return config


def _plan(model: nn.Module, world: int, stage: int) -> fzero.partition.Plan:
    options = {"persistence_threshold": 0} if stage == 3 else {}
    manifest = fzero.partition.describe(model)
    return fzero.partition.plan(manifest, world_size=world, stage=stage, **options)


def engine_and_step_case(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case: the engine and train_step on the same micro-batches; their losses, and
    both consolidated state dicts."""
    results = {}
    for case in cases:
        stage, precision, accum, clip, offload, *kind = case
        config = _config(stage, accum, clip, precision, offload)
        build = fzero.optim.lamb if kind == ["lamb"] else fzero.optim.adamw
        optimizer = build(lr=LR, weight_decay=0.01)
        torch.manual_seed(0)
        engine = fzero.shard(
            Net(), stage=stage, optimizer=optimizer, config=config, precision=precision
        )
        torch.manual_seed(0)
        model = Net()
        plan = _plan(model, world, stage)
        state = fzero.init(model, plan, optimizer, precision=precision, config=config)
        assert (state.residence is not None) == (offload in ("nvme", "in_place"))
        dtype = DTYPES[precision]

        def loss_fn(params, batch, model=model, dtype=dtype):
            x, y = batch
            out = torch.func.functional_call(model, params, (x.to(dtype),))
            return F.mse_loss(out.float(), y)

        step = fzero.train_step(loss_fn, plan, optimizer, config=config)
        engine_losses, step_losses, skipped = [], [], []
        for i in range(STEPS):
            x, y = global_batch(i, MICRO * accum * world)
            for a in range(accum):
                rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
                loss = F.mse_loss(engine(x[rows]).float(), y[rows])
                engine.backward(loss)
                engine.step()
                state, metrics = step(state, (x[rows], y[rows]))
                engine_losses.append(loss.item())
                step_losses.append(metrics["loss"].item())
            skipped.append((engine.was_step_skipped(), metrics["skipped"]))
            assert metrics["stepped"] != metrics["skipped"]
            assert metrics["grad_norm"] == engine.get_global_grad_norm()
            assert metrics["loss_scale"] == engine.current_loss_scale
        assert state.counters.global_steps == engine.global_steps == STEPS
        assert state.counters.micro_steps == engine.micro_steps
        assert state.counters.skipped_steps == engine.skipped_steps
        results[tuple(case)] = {
            "losses": (engine_losses, step_losses),
            "skipped": skipped,
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
        }
        engine.destroy()
    return results


def _assert_same(results: dict) -> None:
    for case, result in results.items():
        engine_losses, step_losses = result["losses"]
        assert engine_losses == step_losses, case
        for ours, theirs in result["skipped"]:
            assert ours == theirs, case
        assert result["engine"].keys() == result["step"].keys()
        for name, expected in result["engine"].items():
            assert torch.equal(result["step"][name], expected), (case, name)


FP32 = list(itertools.product(range(4), ["fp32"], (1, 2), (0.0, 0.05), (False,)))


@pytest.mark.parametrize("world", [1, 2])
def test_train_step_equals_the_engine_bitwise_fp32_all_stages(world):
    _assert_same(run_world(engine_and_step_case, world, FP32))


def test_train_step_equals_the_engine_bitwise_bf16_fp16_and_offload():
    cases = [(stage, "bf16", 2, 0.05, False) for stage in range(4)]
    cases += [(stage, "fp16", 1, 0.0, False) for stage in (0, 3)]
    cases += [(stage, "fp32", 1, 0.05, True) for stage in (1, 3)]
    results = run_world(engine_and_step_case, 2, cases)
    _assert_same(results)
    fp16 = results[(3, "fp16", 1, 0.0, False)]["skipped"]
    assert fp16[0] == (True, True) and not fp16[-1][0]  # overflow skipped, then trained


def test_train_step_offloads_to_nvme_as_the_engine_does_bitwise():
    """NVMe offload through the core's swap file and transactional step in both doors:
    both commit modes, stages 1-3, accumulation, bf16 and LAMB's two passes."""
    cases = [(stage, "fp32", 2, 0.05, "nvme") for stage in (1, 2, 3)]
    cases += [(2, "bf16", 1, 0.0, "in_place"), (3, "fp32", 1, 0.0, "in_place")]
    cases += [(2, "fp32", 1, 0.05, "nvme", "lamb")]
    _assert_same(run_world(engine_and_step_case, 2, cases))


def test_train_step_runs_lamb_as_the_engine_does_bitwise():
    """LAMB's per-tensor trust ratio over tensors that span ranks: one implementation
    (`fzero.core.update`) in both doors."""
    cases = [(stage, "fp32", 1, 0.05, False, "lamb") for stage in range(4)]
    cases += [(3, "bf16", 2, 0.0, False, "lamb"), (2, "fp32", 1, 0.0, True, "lamb")]
    _assert_same(run_world(engine_and_step_case, 2, cases))


class _Recomputed(nn.Module):
    """Residual blocks run through `fzero.checkpointing.checkpoint` (recomputed in
    backward), or directly."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + (fzero.checkpointing.checkpoint(block, h) if self.checkpointed else block(h))
        return h


def recompute_case(rank: int, world: int) -> dict:
    """Activation checkpointing in both doors at every stage, and the same model
    without it: a recomputation under functional_call must use the step's parameters."""
    results = {}
    for stage in range(4):
        for checkpointed in (True, False):
            config = {
                "steps_per_print": 0,
                "zero_optimization": {"stage3_param_persistence_threshold": 0},
            }
            optimizer = fzero.optim.adamw(lr=1e-2)
            torch.manual_seed(0)
            engine = fzero.shard(
                _Recomputed(checkpointed), stage=stage, optimizer=optimizer, config=config
            )
            torch.manual_seed(0)
            model = _Recomputed(checkpointed)
            plan = _plan(model, world, stage)
            state = fzero.init(model, plan, optimizer)

            def loss_fn(params, x, model=model):
                return torch.func.functional_call(model, params, (x,)).square().mean()

            step = fzero.train_step(loss_fn, plan, optimizer)
            for i in range(3):
                x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * i + rank))
                engine.backward(engine(x).square().mean())
                engine.step()
                state, _ = step(state, x)
            results[(stage, checkpointed)] = (
                engine.state_dict(torch.float32),
                fzero.state_dict(state),
            )
            engine.destroy()
    return results


def test_activation_checkpointing_under_train_step_equals_the_engine_at_every_stage():
    results = run_world(recompute_case, 2)
    for stage in range(4):
        (engine, step), (plain, _) = results[(stage, True)], results[(stage, False)]
        for name, expected in engine.items():
            assert torch.equal(step[name], expected), (stage, name)
            torch.testing.assert_close(expected, plain[name], rtol=1e-6, atol=1e-7)


WIDTH, DEPTH = 16, 6


def _chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)])


def stage3_live_case(rank: int, world: int) -> dict:
    """The same three steps with `stage3_max_live_parameters` one unit, and unbounded."""
    results = {}
    for max_live in (1, None):
        model = _chain()
        plan = _plan(model, world, 3)
        unit_numel = plan.units[0].numel
        zero = {"stage3_max_live_parameters": unit_numel * max_live} if max_live else {}
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer)

        def loss_fn(params, x, model=model):
            return torch.func.functional_call(model, params, (x,)).square().mean()

        step = fzero.train_step(loss_fn, plan, optimizer, config={"zero_optimization": zero})
        peaks, losses = [], []
        for i in range(3):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + rank))
            state, metrics = step(state, x)
            peaks.append(metrics["gathered_peak_numel"])
            losses.append(metrics["loss"].item())
        held = sum(u.master.numel() for u in state.units)
        results[max_live] = {"peaks": peaks, "unit": unit_numel, "losses": losses, "held": held}
    return results


def test_stage3_train_step_gathers_one_unit_at_a_time_with_the_same_results():
    results = run_world(stage3_live_case, 2)
    one, whole = results[1], results[None]
    assert max(one["peaks"]) == one["unit"]  # one unit gathered at a time, never the model
    assert max(whole["peaks"]) == DEPTH * whole["unit"]  # the default bound lets all live
    assert one["losses"] == whole["losses"]  # bitwise: gathering order changes no number
    assert one["held"] == DEPTH * one["unit"] // 2  # between steps: this rank's shards only


def reuse_case(rank: int, world: int) -> dict:
    """All-gathers per call at stage 3: the first call records the order units are used
    in; later ones keep every unit from forward into backward under DeepSpeed's default
    reuse distance, and at distance 0 gather again all that backward needs but the one
    it needs first."""
    results = {}
    for reuse in (None, 0):
        torch.manual_seed(0)
        model = _chain()
        plan = _plan(model, world, 3)
        zero = {"stage3_max_reuse_distance": reuse} if reuse is not None else {}
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer)

        def loss_fn(params, x, model=model):
            return torch.func.functional_call(model, params, (x,)).square().mean()

        step = fzero.train_step(loss_fn, plan, optimizer, config={"zero_optimization": zero})
        gathers = []
        for i in range(3):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + rank))
            state, metrics = step(state, x)
            gathers.append(metrics["gathers"])
        results[reuse] = (gathers, len(plan.units), fzero.state_dict(state))
    return results


def test_stage3_train_step_keeps_units_for_backward_within_the_reuse_distance():
    results = run_world(reuse_case, 2)
    (kept, units, a), (strict, _, b) = results[None], results[0]
    assert units == DEPTH
    # the first call gathers in forward and again in backward (all but the first
    # layer's weight, which backward does not need: the input takes no gradient)
    assert kept[0] == strict[0] == 2 * units - 1
    assert kept[1:] == [units, units]  # then each unit once: kept for backward
    assert strict[1:] == [2 * units - 2] * 2  # backward's first unit is within distance 0
    assert all(torch.equal(a[k], b[k]) for k in a)


def per_sample_case(rank: int, world: int) -> dict:
    """Per-example clipping through grad_fn at stages 2 and 3: the consolidated weights."""
    from examples.per_sample_clipping import clipped_mean_grads, make_batch, make_model

    results = {}
    for stage in (2, 3):
        model = make_model()
        plan = _plan(model, world, stage)
        optimizer = fzero.optim.sgd(lr=0.1, momentum=0.9)
        state = fzero.init(model, plan, optimizer)

        def grad_fn(params, batch, model=model):
            return clipped_mean_grads(model, params, *batch, 1.0)

        step = fzero.train_step(plan=plan, optimizer=optimizer, grad_fn=grad_fn)
        for i in range(3):
            x, y = make_batch(i, 8 * world)
            rows = slice(rank * 8, (rank + 1) * 8)
            state, _ = step(state, (x[rows], y[rows]))
        results[stage] = fzero.state_dict(state)
    return results


def per_sample_reference(world: int) -> dict[str, torch.Tensor]:
    """One process, plain torch: each example's gradient clipped to norm 1, averaged."""
    from examples.per_sample_clipping import make_batch, make_model

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        x, y = make_batch(i, 8 * world)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for xi, yi in zip(x, y):
            model.zero_grad()
            F.cross_entropy(model(xi[None]), yi[None]).backward()
            norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
            factor = min(1.0, 1.0 / (norm.item() + 1e-6))
            for t, p in zip(total, model.parameters()):
                t += factor * p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / len(x)
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_per_sample_clipping_under_zero3_matches_a_single_process_reference():
    results = run_world(per_sample_case, 2)
    expected = per_sample_reference(2)
    for stage, result in results.items():
        assert result.keys() == expected.keys()
        for name, value in expected.items():
            message = f"stage {stage}: {name}"
            torch.testing.assert_close(result[name], value, rtol=1e-5, atol=1e-6, msg=message)


def test_per_sample_clipping_example_trains_under_zero3():
    from tests.test_examples import ROOT, _fzero_run

    out = _fzero_run(ROOT / "examples" / "per_sample_clipping.py", "--steps", "20")
    assert "ZeRO-3 over 2 ranks: rank 0 holds 416 of 804 fp32 weights" in out
    first, last = (float(v) for v in out.split("loss ")[-1].split(";")[0].split(" -> "))
    assert last < first - 0.1, out


def awkward_case(rank: int, world: int) -> dict:
    """Tied weights, a frozen layer, an unused layer, a block used twice, at stage 3."""
    torch.manual_seed(0)
    engine = fzero.shard(Awkward(), stage=3, optimizer=fzero.optim.adam(lr=1e-2))
    torch.manual_seed(0)
    model = Awkward()
    plan = _plan(model, world, 3)
    state = fzero.init(model, plan, fzero.optim.adam(lr=1e-2))

    def loss_fn(params, tokens):
        return torch.func.functional_call(model, params, (tokens,)).logsumexp(-1).mean()

    step = fzero.train_step(loss_fn, plan, fzero.optim.adam(lr=1e-2))
    for i in range(3):
        tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(i + rank))
        engine.backward(engine(tokens).logsumexp(-1).mean())
        engine.step()
        state, _ = step(state, tokens)
    return {"engine": engine.state_dict(), "step": fzero.state_dict(state, module=model)}


def test_awkward_model_at_stage3_equals_the_engine():
    result = run_world(awkward_case, 2)
    assert list(result["step"]) == list(result["engine"])  # the module's keys, in order
    for name, value in result["engine"].items():
        torch.testing.assert_close(result["step"][name], value, rtol=0, atol=0, msg=name)


def _single_state(stage: int = 2):
    model = Net()
    plan = _plan(model, 1, stage)
    optimizer = fzero.optim.adam(lr=LR)
    state = fzero.init(model, plan, optimizer, seed=3)

    def loss_fn(params, batch):
        out = torch.func.functional_call(model, params, (batch[0],))
        return F.mse_loss(F.dropout(out, 0.5), batch[1])

    return model, plan, optimizer, state, loss_fn


def pytree_case(rank: int, world: int) -> dict:
    _, plan, optimizer, state, loss_fn = _single_state()
    step = fzero.train_step(loss_fn, plan, optimizer)
    copy = pytree.tree_map_only(torch.Tensor, torch.clone, state)
    assert type(copy) is fzero.TrainState and copy.counters == state.counters
    batch = global_batch(0, 4)
    first, m1 = step(state, batch)
    with pytest.raises(ValueError, match="was given to a step already"):
        step(state, batch)
    second, m2 = step(copy, batch)  # the copy replays the step: same dropout, same result
    assert m1["loss"].item() == m2["loss"].item()
    assert torch.equal(first.rng, second.rng) and not torch.equal(first.rng, copy.rng)
    a, b = fzero.state_dict(first), fzero.state_dict(second)
    same = all(torch.equal(a[k], b[k]) for k in a)
    return {"same": same, "leaves": len(pytree.tree_leaves(state))}


def test_train_state_is_a_pytree_a_copy_replays_a_step_and_a_donated_state_is_refused():
    result = run_world(pytree_case, 1)
    assert result["same"]
    assert result["leaves"] > 0


def records_case(rank: int, world: int) -> dict[int, tuple[int, int, int]]:
    """Per stage: the plan's units, the runtime records three steps made, and the records
    made in all once a copy of the state (other buffers) was stepped too."""
    import fzero.core.step as step_module

    original, made = step_module.runtime_of, []

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    step_module.runtime_of = counting
    result = {}
    try:
        for stage in (0, 1, 2, 3):
            made.clear()
            _, plan, optimizer, state, loss_fn = _single_state(stage)
            step = fzero.train_step(loss_fn, plan, optimizer)
            for i in range(3):
                state, _ = step(state, global_batch(i, 4))
            three = len(made)
            step(pytree.tree_map_only(torch.Tensor, torch.clone, state), global_batch(3, 4))
            result[stage] = (len(plan.units), three, len(made))
    finally:
        step_module.runtime_of = original
    return result


def test_train_step_makes_the_update_records_once_not_per_step():
    for stage, (units, three_steps, with_copy) in run_world(records_case, 1).items():
        assert units > 0
        assert three_steps == units, f"stage {stage}"  # the first step's, kept
        assert with_copy == 2 * units, f"stage {stage}"  # a state of other buffers: anew


def _error(call) -> str:
    """`call()`'s exception as "Type: message" ("no error" when it returns)."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def errors_case(rank: int, world: int) -> dict[str, str]:
    model, plan, optimizer, state, loss_fn = _single_state()
    nvme = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "."}}
    with torch.device("meta"):
        on_meta = Net()
    bad = fzero.train_step(plan=plan, optimizer=optimizer, grad_fn=lambda p, b: (0.0, {"x": 1}))
    scalar = fzero.train_step(lambda p, b: torch.ones(3, requires_grad=True), plan, optimizer)
    other = fzero.train_step(loss_fn, _plan(model, 1, 3), optimizer)
    calls = {
        "both": lambda: fzero.train_step(loss_fn, plan, optimizer, grad_fn=lambda p, b: None),
        "world": lambda: fzero.init(model, _plan(model, 2, 1), optimizer),
        "nvme": lambda: fzero.train_step(
            loss_fn, plan, optimizer, config={"zero_optimization": nvme}
        )(state, global_batch(0, 4)),
        "stage": lambda: fzero.train_step(
            loss_fn, plan, optimizer, config={"zero_optimization": {"stage": 3}}
        ),
        "model": lambda: fzero.init(nn.Linear(2, 2), plan, optimizer),
        "meta": lambda: fzero.init(on_meta, plan, optimizer),
        "grads": lambda: bad(state, None),
        "scalar": lambda: scalar(state, None),
        "plan": lambda: other(state, global_batch(0, 4)),
    }
    return {name: _error(call) for name, call in calls.items()}


def test_train_step_errors_name_what_is_wrong():
    errors = run_world(errors_case, 1)
    expected = {
        "both": r"TypeError: train_step takes exactly one of loss_fn and grad_fn",
        "world": r"ValueError: plan\.world_size is 2 but torch.distributed runs 1 ranks",
        "nvme": r"ValueError: train_step: state.plan is not the plan this step was made "
        r"for; state.plan.memory.optimizer is 'device', the step's 'nvme'",
        "stage": r"ValueError: the config's zero_optimization\.stage is 3; the plan's 2",
        "model": r"ValueError: the model does not fit the plan: missing parameters \['embed",
        "meta": r"ValueError: .*on the meta device \(first: 'embed.weight'\)",
        "grads": r"ValueError: grad_fn's grads do not fit the plan: unknown names \['x'\]",
        "scalar": r"ValueError: loss_fn returned a tensor of shape \(3,\).*expected a scalar",
        "plan": r"ValueError: train_step: state.plan is not the plan this step was made for",
    }
    assert errors.keys() == expected.keys()
    for name, pattern in expected.items():
        assert re.match(pattern, errors[name]), (name, errors[name])


def schedule_case(rank: int, world: int) -> list[float]:
    """A config's optimizer and scheduler blocks drive train_step as they drive the engine."""
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "gradient_clipping": 0.0,  # named: initialize's default is DeepSpeed's 1.0
    }
    torch.manual_seed(0)
    engine, *_ = fzero.initialize(model=Net(), config=config)
    torch.manual_seed(0)
    model = Net()
    plan = _plan(model, world, 1)
    optimizer = fzero.optim.optimizer_from_name("AdamW", {"lr": 0.01})
    state = fzero.init(model, plan, optimizer)

    def loss_fn(params, batch):
        return F.mse_loss(torch.func.functional_call(model, params, (batch[0],)), batch[1])

    step = fzero.train_step(loss_fn, plan, config=config)
    lrs = []
    for i in range(5):
        x, y = global_batch(i, 4)
        engine.backward(F.mse_loss(engine(x), y))
        lrs.append(engine.get_lr()[0])
        engine.step()
        state, metrics = step(state, (x, y))
        assert metrics["lr"][0] == lrs[-1]
    a, b = engine.state_dict(torch.float32), fzero.state_dict(state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    return lrs


def test_config_optimizer_and_scheduler_blocks_drive_train_step():
    lrs = run_world(schedule_case, 1)
    assert lrs[0] < lrs[-1]


def test_train_step_is_exported_with_its_state_types():
    assert dist.is_available()
    for name in ("init", "train_step", "state_dict", "TrainState", "UnitState", "Counters"):
        assert name in fzero.__all__ and hasattr(fzero, name)


def transforms_case(rank: int, world: int) -> dict:
    """A loss_fn that vmaps the model over examples and passes (params, buffers) to
    functional_call, plus an input-gradient penalty (double backward): stage 3's
    placeholders go through torch.func transforms and reach stage 0's weights."""
    results = {}
    for stage in (0, 3):
        model = _chain()
        plan = _plan(model, world, stage)
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer)

        def loss_fn(params, x, model=model):
            def one(xi):
                return torch.func.functional_call(model, (params, {}), (xi,))

            out = torch.func.vmap(one)(x.requires_grad_())
            (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            return out.square().mean() + 0.1 * slope.square().mean()

        step = fzero.train_step(loss_fn, plan, optimizer)
        for i in range(3):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + rank))
            state, _ = step(state, x)
        results[stage] = fzero.state_dict(state)
    return results


def test_stage3_placeholders_compose_with_vmap_and_double_backward():
    results = run_world(transforms_case, 2)
    for name, expected in results[0].items():
        torch.testing.assert_close(results[3][name], expected, rtol=1e-6, atol=1e-7, msg=name)


def inner_transform_case(rank: int, world: int) -> dict:
    """A loss that is itself a gradient (the penalty of a weight-gradient norm): with
    torch.func.grad inside loss_fn at stages 0-2, and at stage 3 through grad_fn= (the
    route the stage-3 error names); the same weights either way."""
    results: dict = {}
    for stage, route in ((2, "loss_fn"), (3, "loss_fn"), (3, "grad_fn")):
        torch.manual_seed(0)
        model = _chain()
        plan = _plan(model, world, stage)
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer)

        def penalty(params, x, model=model):
            def inner(p):
                return torch.func.functional_call(model, (p, {}), (x,)).square().mean()

            grads = torch.func.grad(inner)(params)
            return sum(g.square().sum() for g in grads.values())

        if route == "loss_fn":
            step = fzero.train_step(penalty, plan, optimizer)
        else:
            outer = torch.func.grad_and_value(penalty)
            step = fzero.train_step(
                grad_fn=lambda params, x, outer=outer: outer(params, x)[::-1],
                plan=plan,
                optimizer=optimizer,
            )
        try:
            for i in range(2):
                x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * i + rank))
                state, _ = step(state, x)
            results[(stage, route)] = fzero.state_dict(state)
        except RuntimeError as error:
            results[(stage, route)] = str(error)
    return results


def test_torch_func_grad_inside_loss_fn_at_stage3_names_the_grad_fn_route():
    results = run_world(inner_transform_case, 1)
    error = results[(3, "loss_fn")]
    assert isinstance(error, str) and error.startswith("train_step at ZeRO stage 3: loss_fn ")
    assert "train_step(grad_fn=...)" in error
    for name, expected in results[(2, "loss_fn")].items():
        torch.testing.assert_close(results[(3, "grad_fn")][name], expected, msg=name)


def eval_case(rank: int, world: int) -> dict:
    """eval_step at stage 3 (one unit gathered at a time) gives the outputs of the
    consolidated model, reads the state without donating it, and changes nothing."""
    model = _chain()
    plan = _plan(model, world, 3)
    optimizer = fzero.optim.adamw(lr=1e-2)
    state = fzero.init(model, plan, optimizer)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,)).square().mean()

    def forward(params, x):
        return torch.func.functional_call(model, params, (x,))

    step = fzero.train_step(loss_fn, plan, optimizer)
    one_unit = {"zero_optimization": {"stage3_max_live_parameters": plan.units[0].numel}}
    evaluate = fzero.eval_step(forward, plan, config=one_unit)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    state, _ = step(state, x)
    before = fzero.state_dict(state)
    out = evaluate(state, x)
    assert not out.requires_grad
    after = fzero.state_dict(state)
    old = state
    state, _ = step(state, x)  # eval_step did not donate it: the state trains on
    with pytest.raises(ValueError, match=r"eval_step: this TrainState .* was given to a step"):
        evaluate(old, x)
    return {"out": out, "x": x, "before": before, "after": after}


def test_eval_step_at_stage3_matches_the_consolidated_model():
    result = run_world(eval_case, 2)
    model = _chain()
    model.load_state_dict(result["before"])
    with torch.no_grad():
        expected = model(result["x"])
    torch.testing.assert_close(result["out"], expected, rtol=1e-6, atol=1e-6)
    for name, value in result["before"].items():
        assert torch.equal(result["after"][name], value), name


def defaults_case(rank: int, world: int) -> dict:
    """What each door runs when neither the call nor the config names an optimizer, and
    the accumulation steps of a config that gives no batch size: one rule for both."""
    config = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.0}
    torch.manual_seed(0)
    engine = fzero.shard(Net(), stage=2, config=config)
    ds_engine, *_ = fzero.initialize(model=Net(), config={"gradient_clipping": 0.0})
    torch.manual_seed(0)
    model = Net()
    plan = _plan(model, world, 2)
    state = fzero.init(model, plan, fzero.optim.adamw())

    def loss_fn(params, batch):
        return F.mse_loss(torch.func.functional_call(model, params, (batch[0],)), batch[1])

    step = fzero.train_step(loss_fn, plan, config=config)
    stepped = []
    for i in range(4):
        x, y = global_batch(i, 4)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        state, metrics = step(state, (x, y))
        stepped.append(metrics["stepped"])
    a, b = engine.state_dict(torch.float32), fzero.state_dict(state)
    return {
        "shard": engine.functional_optimizer.hparams,
        "accumulation": (engine.gradient_accumulation_steps(), stepped, engine.global_steps),
        "equal": all(torch.equal(a[k], b[k]) for k in a),
        "initialize": ds_engine.functional_optimizer.name,
    }


def test_both_doors_take_the_same_default_optimizer_and_accumulation_steps():
    result = run_world(defaults_case, 1)
    assert result["shard"] == fzero.optim.adamw().hparams
    assert result["accumulation"] == (2, [False, True, False, True], 2)
    assert result["equal"]  # train_step without an optimizer ran AdamW's defaults too
    assert result["initialize"] == "none"  # DeepSpeed's: no optimizer, forward only
