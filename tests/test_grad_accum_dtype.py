"""DeepSpeed's `data_types.grad_accum_dtype` (the plan's `memory.grads`): gradients summed
across micro-steps in the compute dtype (bf16, fp16) at half the accumulators' bytes, at
every stage through both doors alike, within that dtype's rounding of the fp32 sum; the
accumulators saved and resumed mid-window in their dtype; the mixes no run does refused
by name."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import partition
from fzero.config import ConfigError, load_config
from tests._dist import run_world
from tests.models import Net, global_batch
from tests.test_bf16_masters import both_doors, build_doors

MICRO, ACCUM, LR = 2, 3, 1e-2


def _config(stage: int, accum_dtype: str | None, compute: str = "bf16", **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.05,
        "steps_per_print": 0,
        compute: {"enabled": True},
        "data_types": {"grad_accum_dtype": accum_dtype},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
            **zero,
        },
    }


def doors_case(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per (stage, accumulation dtype, compute dtype, offload, optimizer): the engine and
    train_step on the same micro-batches, what they hold and what the plan says they
    hold."""
    results = {}
    for stage, accum_dtype, compute, offload, name in cases:
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        config = _config(stage, accum_dtype, compute, **zero)
        optimizer = getattr(fzero.optim, name)(lr=LR, weight_decay=0.01)
        cast = torch.bfloat16 if compute == "bf16" else torch.float16
        engine, model, state, step = build_doors(
            Net, world, stage, optimizer, config, compute, cast=cast
        )
        start = engine.state_dict(dtype=torch.float32)
        engine_losses, step_losses, state = both_doors(
            engine, step, state, rank, world, ACCUM, steps=3
        )
        results[(stage, accum_dtype, compute, offload, name)] = {
            "losses": (engine_losses, step_losses),
            "start": start,
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "dtypes": sorted({str(rt.grad.dtype) for rt in engine.units}),
            "step_dtypes": sorted({str(u.grad.dtype) for u in state.units}),
            "grads": (engine.memory_held().grads, engine.memory_planned().grads),
            "plan": state.plan.memory.grads,
        }
        engine.destroy()
    return results


def _error(a: dict, b: dict) -> float:
    """The largest difference of `a`'s weight changes from `b`'s, relative to `b`'s
    largest change, over the tensors (SGD: the change is the accumulated gradient)."""
    return max(
        (
            (a["engine"][n] - b["engine"][n]).abs().max()
            / (b["engine"][n] - b["start"][n]).abs().max()
        ).item()
        for n in b["engine"]
    )


def test_gradients_accumulate_in_bf16_at_every_stage_through_both_doors():
    """World 2, three micro-steps per step, clipping: the accumulators are bf16 (half the
    fp32 ones' bytes, as the plan says), the engine and train_step bitwise alike, and the
    weights within bf16's rounding of the same run accumulating in fp32 but not equal to
    it (the key acts): SGD, whose change of the weights is the accumulated gradient."""
    cases = [(s, dtype, "bf16", False, "sgd") for s in range(4) for dtype in ("bf16", "fp32")]
    cases += [(2, "bf16", "bf16", True, "adamw"), (2, "bf16", "bf16", False, "adamw")]
    cases += [(3, "bf16", "bf16", False, "adamw")]
    results = run_world(doors_case, 2, cases)
    for case, result in results.items():
        engine_losses, step_losses = result["losses"]
        assert engine_losses == step_losses, case
        for name, value in result["engine"].items():
            assert torch.equal(value, result["step"][name]), (case, name)
        held, planned = result["grads"]
        assert held == planned, case
        expected = "torch.bfloat16" if case[1] == "bf16" else "torch.float32"
        assert result["dtypes"] == result["step_dtypes"] == [expected], case
        assert result["plan"] == case[1]
    for stage in range(4):
        half = results[(stage, "bf16", "bf16", False, "sgd")]
        full = results[(stage, "fp32", "bf16", False, "sgd")]
        assert half["grads"][0] * 2 == full["grads"][0], stage
        error = _error(half, full)
        assert 0 < error <= 1e-2, (stage, error)
    offload = results[(2, "bf16", "bf16", True, "adamw")]
    memory = results[(2, "bf16", "bf16", False, "adamw")]
    assert offload["losses"] == memory["losses"]  # the host widens the same bf16 sums
    for name, value in memory["engine"].items():
        assert torch.equal(offload["engine"][name], value), name


def test_fp16_gradients_accumulate_in_fp16_under_loss_scaling():
    """fp16 compute with fp16 accumulators (DeepSpeed's default for fp16 under ZeRO): the
    doors alike, within fp16's rounding of the fp32-accumulating run."""
    cases = [(2, "fp16", "fp16", False, "sgd"), (2, None, "fp16", False, "sgd")]
    cases += [(3, "fp16", "fp16", False, "adamw")]
    results = run_world(doors_case, 2, cases)
    for case, result in results.items():
        assert result["losses"][0] == result["losses"][1], case
        expected = "torch.float32" if case[1] is None else "torch.float16"
        assert result["dtypes"] == [expected], case
    error = _error(results[cases[0]], results[cases[1]])
    assert 0 < error <= 5e-3, error


def checkpoint_case(rank: int, world: int, root: str) -> dict:
    """Save mid accumulation window with bf16 accumulators, keep training; a new engine
    loads the checkpoint and trains the same micro-steps: bitwise the same."""
    config = _config(2, "bf16")
    torch.manual_seed(0)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)

    def micro(e, i: int) -> float:
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.mse_loss(e(x[rows].bfloat16()).float(), y[rows])
        e.backward(loss)
        e.step()
        return loss.item()

    for i in range(4):  # one step and one micro-step into the next window
        micro(engine, i)
    engine.save_checkpoint(root, tag="mid")
    saved = [rt.grad.clone() for rt in engine.units]
    after = [micro(engine, i) for i in range(4, 9)]
    torch.manual_seed(1)
    other = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    other.load_checkpoint(root, tag="mid")
    loaded = [rt.grad.clone() for rt in other.units]
    resumed = [micro(other, i) for i in range(4, 9)]
    result = {
        "after": after,
        "resumed": resumed,
        "grads_equal": all(torch.equal(a, b) for a, b in zip(saved, loaded)),
        "grad_dtypes": sorted({str(g.dtype) for g in loaded}),
        "saved_nonzero": any(bool(g.any()) for g in saved),
        "weights_equal": all(
            torch.equal(a, b)
            for a, b in zip(
                engine.state_dict(dtype=torch.float32).values(),
                other.state_dict(dtype=torch.float32).values(),
            )
        ),
    }
    engine.destroy()
    other.destroy()
    return result


def test_bf16_accumulators_save_and_resume_mid_window_bitwise(tmp_path):
    result = run_world(checkpoint_case, 2, os.fspath(tmp_path))
    assert result["saved_nonzero"] and result["grads_equal"]
    assert result["grad_dtypes"] == ["torch.bfloat16"]
    assert result["after"] == result["resumed"] and result["weights_equal"]


def test_the_plan_says_the_accumulators_dtype_and_its_bytes():
    plan = partition.plan(partition.describe(Net()), world_size=2, stage=2)
    half = partition.with_memory(plan, partition.Memory(grads="bf16"))
    assert partition.from_bytes(partition.to_bytes(half)) == half
    assert partition.to_bytes(partition.with_memory(plan, partition.Memory())) == (
        partition.to_bytes(plan)  # the default writes the bytes it did before
    )
    assert partition.plan_digest(half) != partition.plan_digest(plan)
    fp32 = partition.memory_per_rank(plan, 0)
    bf16 = partition.memory_per_rank(half, 0)
    assert bf16.grads * 2 == fp32.grads and bf16.params == fp32.params
    assert partition.memory_per_rank(half, 0, grad_dtype="float32").grads == fp32.grads


def test_the_mixes_no_run_does_are_refused_by_name():
    said = {"data_types": {"grad_accum_dtype": "bf16"}, "bf16": {"enabled": True}}
    assert load_config(said).data_types.grad_accum_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"'data_types\.grad_accum_dtype' is 'bf16' but 'bf16"):
        load_config({"data_types": {"grad_accum_dtype": "bf16"}, "bf16": {"enabled": False}})
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(ConfigError, match=r"grad_accum_dtype' is 'fp16' with .*'nvme' at stage 3"):
        load_config(
            {
                "fp16": {"enabled": True},
                "data_types": {"grad_accum_dtype": "fp16"},
                "zero_optimization": {"stage": 3, "offload_optimizer": nvme},
            }
        )
    with pytest.raises(ValueError, match=r"precision grads .* is 'bf16' but compute is 'fp32'"):
        fzero.Precision("fp32", grads="bf16").check()
    with pytest.raises(ValueError, match=r"precision grads is 'fp8'; allowed"):
        fzero.Precision("bf16", grads="fp8").check()
    plan = partition.plan(partition.describe(Net()), world_size=2, stage=3)
    with pytest.raises(partition.PlanError, match=r"memory\.grads is 'fp4'; allowed: fp32, bf16"):
        partition.with_memory(plan, partition.Memory(grads="fp4"))
    with pytest.raises(partition.PlanError, match=r"memory\.grads is 'fp16' .* swap file"):
        partition.with_memory(plan, partition.Memory(optimizer="nvme", grads="fp16"))
    nvme_bf16 = partition.Memory(optimizer="nvme", grads="bf16")  # the file holds bf16 sums
    assert partition.with_memory(plan, nvme_bf16).memory == nvme_bf16


def unit_case(rank: int, world: int, stage: int) -> dict:
    """bf16 gradient sums for the blocks only (`unit_memory={"blocks": {"grads":
    "bf16"}}`) beside fp32 ones, against all-bf16 and all-fp32 sums: the weights after
    one step (no clipping: each unit's update reads only its own gradient)."""
    config = _config(stage, None)
    config["gradient_clipping"] = 0.0
    out: dict = {}
    for name, accum, strategy in (
        ("fp32", None, None),
        ("bf16", "bf16", None),
        ("blocks", None, partition.with_unit_memory({"blocks": {"grads": "bf16"}})),
    ):
        said = dict(config, data_types={"grad_accum_dtype": accum})
        torch.manual_seed(0)
        engine = fzero.shard(
            Net(), optimizer=fzero.optim.adamw(lr=LR), config=said, strategy=strategy
        )
        x, y = global_batch(0, MICRO * ACCUM * world)
        for a in range(ACCUM):
            rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
            engine.backward(F.mse_loss(engine(x[rows].bfloat16()).float(), y[rows]))
            engine.step()
        out[name] = engine.state_dict(dtype=torch.float32)
        if name == "blocks":
            out["dtypes"] = [str(rt.grad.dtype) for rt in engine.units]
            out["held"] = (engine.memory_held().grads, engine.memory_planned().grads)
            out["buckets"] = partition.reduction_buckets(engine.plan, 300)
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_units_gradients_summed_in_bf16_beside_fp32_sums(stage):
    out = run_world(unit_case, 2, stage)
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    assert out["dtypes"] == [fp32, bf16, bf16, fp32]
    assert out["held"][0] == out["held"][1]
    # stages 0-1 share a buffer per bucket: a bucket holds one dtype ("head" and
    # "blocks.1" share one when their dtypes agree: ((3, 2), (1,), (0,)))
    assert out["buckets"] == ((3,), (2,), (1,), (0,))
    for name, value in out["blocks"].items():
        run = "bf16" if name.startswith("blocks") else "fp32"
        assert torch.equal(value, out[run][name]), (name, run)
    assert any(not torch.equal(out["bf16"][n], out["fp32"][n]) for n in out["fp32"])


def test_a_units_gradient_dtype_is_checked():
    with pytest.raises(partition.PlanError, match=r"unit 'head': grads_dtype is 'fp8'"):
        partition.plan(
            partition.describe(Net()), world_size=2, stage=2,
            unit_memory={"head": {"grads": "fp8"}},
        )  # fmt: skip
    plan = partition.plan(
        partition.describe(Net()), world_size=2, stage=2, unit_memory={"head": {"grads": "bf16"}}
    )
    assert partition.from_bytes(partition.to_bytes(plan)) == plan
    config = {"train_micro_batch_size_per_gpu": MICRO}
    with pytest.raises(partition.PlanError, match=r"unit 'head': grads_dtype is 'bf16' but the"):
        fzero.init(Net(), plan, fzero.optim.adamw(), config=config)
