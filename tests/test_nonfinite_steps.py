"""A step whose gradients are not finite is skipped where DeepSpeed skips it (checked
against DeepSpeed itself in `tests/deepspeed_reference`): at stages 1-3 and with bf16,
on every rank when one rank's gradient holds an inf, in both doors; the weights, the
optimizer state and the lr schedule stay where they were, and training goes on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import partition
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, STEPS, BAD = 2, 3, 1  # the step at index BAD has an inf on rank 1

# (stage, precision) -> whether DeepSpeed 0.19.8 skips the step (deepspeed_reference/parity.py)
SKIPS = {
    (0, "fp32"): False,  # the client's update, as torch applies it
    (1, "fp32"): True,
    (2, "fp32"): True,
    (3, "fp32"): True,
    (0, "bf16"): True,
    (2, "bf16"): True,
    (2, "bf16, no check"): False,  # bf16.check_grad_overflow false
    (3, "bf16, no check"): True,  # stage 3 checks whatever the key says
    (0, "fp16, static scale"): True,  # fp16 checks always (DeepSpeed's overflow check)
    (2, "fp16, static scale"): True,
}


def _config(stage: int, precision: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision.startswith("bf16"):
        config["bf16"] = {"enabled": True, "check_grad_overflow": precision == "bf16"}
    if precision.startswith("fp16"):
        config["fp16"] = {"enabled": True, "loss_scale": 128}
    return config


def _batch(rank: int, world: int, step: int, dtype: torch.dtype):
    x, y = global_batch(step, MICRO * world)
    x, y = x[rank * MICRO : (rank + 1) * MICRO].to(dtype), y[rank * MICRO : (rank + 1) * MICRO]
    if step == BAD and rank == 1:
        x = x.clone()
        x[0, 0] = math.inf
    return x, y


def case(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    out = {}
    for stage, precision in cases:
        config = _config(stage, precision)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision[:4], torch.float32)
        torch.manual_seed(0)
        engine, *_ = fzero.initialize(model=Net(), config=config)
        torch.manual_seed(0)
        model = Net()
        plan = partition.plan(partition.describe(model), world_size=world, stage=stage)
        precision_of = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        optimizer = fzero.optim.adamw(lr=1e-2)
        state = fzero.init(model, plan, optimizer, precision=precision_of, config=config)

        def loss_fn(params, batch, model=model):
            x, y = batch
            return F.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y)

        step = fzero.train_step(loss_fn, plan, fzero.optim.adamw(lr=1e-2), config=config)
        lrs, counts, skipped, kept = [], [], [], {}
        for i in range(STEPS):
            x, y = _batch(rank, world, i, dtype)
            before = engine.state_dict(dtype=torch.float32) if i == BAD else None
            engine.backward(F.mse_loss(engine(x).float(), y))
            engine.step()
            state, metrics = step(state, (x, y))
            lrs.append(engine.get_lr()[0])
            counts.append((engine.global_steps, engine.skipped_steps))
            skipped.append(bool(metrics["skipped"]))
            if before is not None:
                after = engine.state_dict(dtype=torch.float32)
                kept = {k: torch.equal(v, after[k]) for k, v in before.items()}
        weights = engine.state_dict(dtype=torch.float32)
        out[(stage, precision)] = {
            "lrs": lrs,
            "counts": counts,
            "skipped": skipped,
            "kept": all(kept.values()),
            "finite": all(bool(torch.isfinite(v).all()) for v in weights.values()),
            "step finite": all(
                bool(torch.isfinite(v).all())
                for v in fzero.state_dict(state, module=model).values()
            ),
            "norm": engine.get_global_grad_norm(),
        }
        engine.destroy()
    return out


@pytest.mark.parametrize(
    "cases",
    [
        [(0, "fp32"), (2, "fp32"), (0, "bf16"), (2, "bf16, no check")],
        [(1, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16, no check")],
        [(0, "fp16, static scale"), (2, "fp16, static scale")],
    ],
)
def test_a_step_with_gradients_that_are_not_finite_is_skipped_where_deepspeed_skips_it(cases):
    results = run_world(case, 2, cases)
    for key in cases:
        result, skips = results[key], SKIPS[key]
        assert result["kept"] == skips, key  # the weights kept over the bad step
        assert result["finite"] == result["step finite"] == skips, key
        assert result["skipped"] == [False, skips, False], key  # train_step says so too
        assert result["counts"] == [(1, 0), (2, int(skips)), (3, int(skips))], key
        # the schedule waits for the skipped step: the third lr is the second's then
        applied = [s for s, c in zip(result["lrs"], result["counts"]) if c[1] == 0]
        if skips:
            assert result["lrs"][1] == result["lrs"][0] and result["lrs"][2] > result["lrs"][1]
        else:
            assert len(applied) == STEPS
