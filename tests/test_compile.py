"""An engine over `torch.compile(model)` trains as over the eager model, at every stage:
the same units (torch.compile's `_orig_mod.` wrapper is transparent to the plan) and the
same weights within fp32 rounding (compiled kernels fuse operations, so not bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero.partition import module_key
from tests._dist import run_world
from tests.models import Net, global_batch


def test_torch_compiles_wrapper_does_not_change_a_models_units():
    assert module_key("_orig_mod.embed.weight") == "_orig_mod.embed"
    assert module_key("_orig_mod.blocks.1.0.bias") == "_orig_mod.blocks.1"
    assert module_key("_orig_mod.bias") == "_orig_mod"
    assert module_key("blocks.0._orig_mod.0.weight") == "blocks.0"
    eager = fzero.partition.plan(fzero.partition.describe(Net()), world_size=2, stage=3)
    compiled = torch.compile(Net())
    wrapped = fzero.partition.plan(fzero.partition.describe(compiled), world_size=2, stage=3)
    assert [len(u.placements) for u in wrapped.units] == [len(u.placements) for u in eager.units]


def compiled_case(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    results = {}
    for stage in stages:
        weights = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            model = torch.compile(Net()) if compiled else Net()
            config = {
                "zero_optimization": {"stage3_param_persistence_threshold": 0},
                "steps_per_print": 0,
            }
            optimizer = fzero.optim.adamw(lr=1e-2)
            engine = fzero.shard(model, stage=stage, optimizer=optimizer, config=config)
            for i in range(3):
                x, y = global_batch(i, 4)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
            state = engine.state_dict(torch.float32)
            weights[compiled] = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
            weights[(compiled, "units")] = len(engine.plan.units)
        results[stage] = weights
    return results


@pytest.mark.slow  # torch.compile builds C++ kernels: about 30 s per pair of stages here
@pytest.mark.parametrize("stages", [(0, 1), (2, 3)])
def test_an_engine_over_a_compiled_model_trains_as_over_the_eager_one(stages):
    results = run_world(compiled_case, 1, stages)
    for stage, weights in results.items():
        assert weights[(True, "units")] == weights[(False, "units")], stage
        assert weights[True].keys() == weights[False].keys()
        for name, expected in weights[False].items():
            torch.testing.assert_close(weights[True][name], expected, rtol=1e-6, atol=1e-6)


def compiled_loss_case(rank: int, world: int) -> dict:
    """train_step at stage 3 with `loss_fn` and with `torch.compile(loss_fn)`."""
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Net()
        manifest = fzero.partition.describe(model)
        plan = fzero.partition.plan(manifest, world_size=world, stage=3, persistence_threshold=0)
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer)

        def loss_fn(params, batch, model=model):
            x, y = batch
            return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

        step = fzero.train_step(torch.compile(loss_fn) if compiled else loss_fn, plan, optimizer)
        peaks = []
        for i in range(3):
            state, metrics = step(state, global_batch(i, 4))
            peaks.append(metrics["gathered_peak_numel"])
        results[compiled] = (fzero.state_dict(state), peaks, sum(u.numel for u in plan.units))
    return results


@pytest.mark.slow
def test_a_compiled_loss_fn_at_stage3_gets_whole_parameters_and_trains_as_eager():
    results = run_world(compiled_loss_case, 2)
    (eager, _, total), (compiled, peaks, _) = results[False], results[True]
    assert peaks == [total] * 3  # every unit gathered for the call, as grad_fn does
    for name, expected in eager.items():
        torch.testing.assert_close(compiled[name], expected, rtol=1e-6, atol=1e-6)
