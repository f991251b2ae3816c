"""Engine behaviours beyond parity: memory accounting, fp16 overflow, awkward models,
the DeepSpeed entry point with client optimizers, and the launcher."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fzero
from tests._dist import run_world
from tests.models import Awkward, Net, global_batch, param_groups

ROOT = Path(__file__).resolve().parent.parent
MICRO = 2


def _train(engine, rank, world, steps, accum=1, scale_loss=None):
    losses = []
    for step in range(steps):
        x, y = global_batch(step, MICRO * accum * world)
        for i in range(accum):
            rows = slice((i * world + rank) * MICRO, (i * world + rank + 1) * MICRO)
            loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            if scale_loss is not None:
                loss = loss * scale_loss(step)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def memory_cases(rank, world):
    out = {}
    for stage in range(4):
        for precision in ("fp32", "bf16", "fp16"):
            torch.manual_seed(0)
            model = Net()
            engine = fzero.shard(
                model,
                stage=stage,
                precision=precision,
                config={
                    "train_micro_batch_size_per_gpu": MICRO,
                    "zero_optimization": {
                        "stage3_param_persistence_threshold": 0,
                        "reduce_bucket_size": 300,
                    },
                },
                param_groups=param_groups(model),
            )
            _train(engine, rank, world, 2)
            out[(stage, precision)] = (engine.memory_held(), engine.memory_planned())
    return out


def telemetry_case(rank, world):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "fp16": {"enabled": True},
    }
    engine = fzero.shard(Net(), stage=3, config=config)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = _train(engine, rank, world, 4)
    return out.getvalue(), losses


def test_steps_per_print_logs_loss_lr_scale_throughput_and_breakdown():
    text, losses = run_world(telemetry_case, 2)
    lines = text.splitlines()
    assert [line.split()[3] for line in lines] == ["2", "4"], text  # all of it, if not
    pattern = (
        r"\[fzero Net(?:#\d+)?\] step 4 \| steps 3-4: loss (\d+\.\d{4}), [\d.]+ samples/s \| "
        r"lr 0\.001 loss_scale \d+ skipped \d+ \| "
        r"model states [\d.]+ MB \(plan [\d.]+ MB, max over ranks\), peak \d+ MB \| "
        r"ms/step: backward [\d.]+ comm [\d.]+ forward [\d.]+ step [\d.]+"
    )
    match = re.fullmatch(pattern, lines[1])
    assert match, lines[1]
    assert match[1] == f"{(losses[2] + losses[3]) / 2:.4f}"  # mean since the last line


def test_memory_held_equals_plan_for_every_stage():
    for case, (held, planned) in run_world(memory_cases, 2).items():
        assert held == planned, case


def overflow_case(rank, world, stage):
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 2},
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
    }
    engine = fzero.shard(model, stage=stage, config=config)
    # step 0 good; steps 1 and 2 overflow on rank 1 only; step 3 good
    poison = {1: float("inf"), 2: float("nan")}
    record = []
    for step in range(4):
        before = [rt.master.clone() for rt in engine.units]
        state_before = [rt.state.exp_avg.clone() for rt in engine.units]
        _train_step = poison.get(step, 1.0) if rank == 1 else 1.0
        x, y = global_batch(step, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows]) * _train_step
        engine.backward(loss)
        engine.step()
        unchanged = all(torch.equal(a, rt.master) for a, rt in zip(before, engine.units))
        state_same = all(
            torch.equal(a, rt.state.exp_avg) for a, rt in zip(state_before, engine.units)
        )
        finite = all(torch.isfinite(rt.master).all() for rt in engine.units)
        scale = engine.current_loss_scale
        record.append((engine.was_step_skipped(), unchanged, state_same, finite, scale))
    return record, engine.skipped_steps, engine.global_steps


def collapse_case(rank, world):
    """fp16 with gradients that overflow at every step (rank 1's loss is inf): the scale
    falls 4 -> 2 -> 1 (min) over two skipped steps, and the third overflow stops both
    doors on every rank with the same error; the state is as before that step."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "fp16": {"enabled": True, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1},
    }
    torch.manual_seed(0)
    engine = fzero.shard(Net(), stage=2, config=config)
    model = Net()
    plan = fzero.partition.plan(fzero.partition.describe(model), world_size=world, stage=2)
    optimizer = fzero.optim.adamw()
    state = fzero.init(model, plan, optimizer, precision="fp16", config=config)

    def loss_fn(params, batch):
        x, y = batch
        out = torch.func.functional_call(model, params, (x.half(),)).float()
        return nn.functional.mse_loss(out, y) * (float("inf") if rank == 1 else 1.0)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    errors = {}
    for i in range(3):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
        engine.backward(loss * (float("inf") if rank == 1 else 1.0))
        try:
            engine.step()
        except fzero.optim.LossScaleError as error:
            errors["engine"] = str(error)
        try:
            state, _ = step(state, (x[rows], y[rows]))
        except fzero.optim.LossScaleError as error:
            errors["train_step"] = str(error)
    after = (engine.global_steps, engine.skipped_steps, engine.current_loss_scale)
    return errors, after, (state.counters.global_steps, state.counters.skipped_steps)


def test_fp16_loss_scale_collapse_stops_both_doors_with_a_named_error():
    errors, engine_after, state_after = run_world(collapse_case, 2)
    message = (
        r"fp16: the gradients of step 3 overflowed with the loss scale already at its "
        r"minimum 1 \(fp16\.min_loss_scale\), after 2 skipped step\(s\) of 2: "
    )
    assert re.match(message, errors["engine"]), errors["engine"]
    assert errors["train_step"] == errors["engine"]
    assert engine_after == (2, 2, 1.0)  # the third step neither counted nor applied
    assert state_after == (2, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_the_step_and_follows_hysteresis(stage):
    record, skipped, steps = run_world(overflow_case, 2, stage)
    assert [r[0] for r in record] == [False, True, True, False]
    assert [r[1] for r in record] == [False, True, True, False]  # params untouched when skipped
    assert [r[2] for r in record] == [False, True, True, False]  # optimizer state too
    assert all(r[3] for r in record)  # never a NaN written
    # scale 256: overflow 1 absorbed by hysteresis 2, overflow 2 halves it
    assert [r[4] for r in record] == [256.0, 256.0, 128.0, 128.0]
    assert (skipped, steps) == (2, 4)


def _awkward_batch(step, size):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (size, 5), generator=gen), torch.randint(
        0, 11, (size, 5), generator=gen
    )


def _lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, 11), targets.reshape(-1))


def awkward_cases(rank, world):
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        engine = fzero.shard(
            Awkward(),
            stage=stage,
            optimizer=fzero.optim.adamw(lr=0.05),
            config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        )
        for step in range(3):
            x, y = _awkward_batch(step, MICRO * world)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(_lm_loss(engine(x[rows]), y[rows]))
            engine.step()
        out[stage] = engine.state_dict()
    return out


def test_tied_frozen_unused_and_reused_modules_match_torch():
    world = 2
    torch.manual_seed(0)
    model = Awkward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.05)
    for step in range(3):
        x, y = _awkward_batch(step, MICRO * world)
        opt.zero_grad()
        _lm_loss(model(x), y).backward()
        for p in trainable:  # fzero gives unused parameters zero gradients
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    expected = model.state_dict()
    for stage, state in run_world(awkward_cases, world).items():
        assert list(state) == list(expected)
        assert torch.equal(state["head.weight"], state["embed.weight"])
        for name, value in expected.items():
            torch.testing.assert_close(
                state[name], value, rtol=1e-5, atol=1e-6, msg=f"{stage} {name}"
            )


def client_optimizer_case(rank, world):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = {
        "train_batch_size": 2 * MICRO * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "zero_optimization": {"stage": 2},
    }
    engine, returned, loader, scheduler = fzero.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=config
    )
    # the returned optimizer acts on the engine, over the client's live param groups
    assert returned.param_groups is opt.param_groups and scheduler is sched and loader is None
    assert engine.gradient_accumulation_steps() == 2
    _train(engine, rank, world, 4, accum=2)
    return engine.state_dict(), engine.get_lr()


def test_initialize_runs_a_client_torch_optimizer_and_scheduler():
    world = 2
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in range(4):
        x, y = global_batch(step, MICRO * 2 * world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    state, lrs = run_world(client_optimizer_case, world)
    assert lrs == [g["lr"] for g in opt.param_groups]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)


def lamb_config_case(rank, world, stage, accum):
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "steps_per_print": 0,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "Lamb",
            "params": {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 3}},
    }
    engine, _, _, scheduler = fzero.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    lrs = []
    for step in range(5):
        lrs.append(scheduler.get_lr()[0])
        x, y = global_batch(step, MICRO * accum * world)
        for i in range(accum):
            rows = slice((i * world + rank) * MICRO, (i * world + rank + 1) * MICRO)
            engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    return engine.state_dict(), lrs


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_config_lamb_with_warmup_does_not_depend_on_world_size(stage):
    # LAMB's per-tensor trust ratio needs whole-tensor norms: under sharding a tensor's
    # elements sit on several ranks, so a wrong reduction would change the result.
    one_state, one_lrs = run_world(lamb_config_case, 1, stage, 2)
    two_state, two_lrs = run_world(lamb_config_case, 2, stage, 1)
    schedule = fzero.optim.WarmupLR(warmup_max_lr=0.02, warmup_num_steps=3)
    assert one_lrs == two_lrs == [schedule(s, 0.0) for s in range(5)]
    for name, value in one_state.items():
        torch.testing.assert_close(two_state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _fzero_run(args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "fzero.cli", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tutorial_regression_script_trains_under_fzero_run(tmp_path):
    script = ["examples/regression/train.py", "--epochs", "4", "--save_dir", str(tmp_path)]
    result = _fzero_run(["-n", "2", *script])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [
        float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("epoch")
    ]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0], result.stdout
    assert "checkpoint round-trip: epoch 4, identical True" in result.stdout


def test_a_failing_rank_ends_the_job_and_is_named(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent("""
        import torch, fzero
        engine = fzero.shard(torch.nn.Linear(4, 4), stage=2)
        for step in range(5):
            if step == 2 and engine.global_rank == 1:
                raise RuntimeError("boom on purpose")
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
    """)
    )
    result = _fzero_run(["-n", "2", str(script)], timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "boom on purpose" in output and "rank      : 1" in output


def test_launcher_builds_torchrun_commands(tmp_path):
    from fzero.cli.launcher import parse_hostfile, torchrun_command

    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=4\n# comment\nworker-2 slots=4\n")
    hosts = parse_hostfile(hostfile)
    command = torchrun_command("train.py", ["--x", "1"], hosts=hosts, node_rank=1)
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=worker-1:29500",
        "--rdzv-id=fzero",
        "train.py",
        "--x",
        "1",
    ]
    assert "--standalone" in torchrun_command("t.py", [], nproc_per_node=2)
    hostfile.write_text("worker-1 4\n")
    with pytest.raises(ValueError, match=r"line 1.*hostname slots=N"):
        parse_hostfile(hostfile)
    dry = _fzero_run(["--dry-run", "-n", "3", "t.py", "--a"])
    assert dry.returncode == 0 and "--nproc-per-node=3 --standalone t.py --a" in dry.stdout


def test_dist_is_not_left_initialised_in_the_test_process():
    assert not dist.is_initialized()


def metrics_case(rank, world, path):
    torch.manual_seed(0)
    config = {"steps_per_print": 1, "metrics_file": path, "train_micro_batch_size_per_gpu": 2}
    engine = fzero.shard(Awkward(), stage=3, config=config)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        for step in range(2):
            x, y = _awkward_batch(step, MICRO * world)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(_lm_loss(engine(x[rows]), y[rows]))
            engine.step()
    return out.getvalue()


def test_metrics_file_has_tokens_flops_and_memory(tmp_path):
    import json

    path = tmp_path / "metrics.jsonl"
    text = run_world(metrics_case, 2, str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    params = sum(p.numel() for p in Awkward().parameters() if p.requires_grad)
    for record in records:
        # 2 ranks x 2 sequences x 5 tokens per step
        assert record["tokens_per_s"] == pytest.approx(20 / record["seconds"])
        flops = 6 * params * 20 / record["seconds"]  # 6 x parameters x tokens, per second
        assert record["tflops"] == pytest.approx(flops / 1e12)
        assert record["memory_mb"] == pytest.approx(record["memory_plan_mb"])
        assert record["peak_memory_mb"] > 0
    assert "tokens/s" in text and "TFLOP/s" in text


def zero_grad_case(rank: int, world: int) -> dict:
    """`engine.zero_grad` on what another pass left in `param.grad`: set to None, or with
    `set_to_none=False` zeroed in place (the same tensor), as torch's optimizers do."""
    engine = fzero.shard(Net(), stage=2, optimizer=fzero.optim.adamw(), config={})
    params = list(engine.module.parameters())
    for p in params:
        p.grad = torch.ones(p.shape)
    kept = [p.grad for p in params]
    engine.zero_grad(set_to_none=False)
    zeroed = all(p.grad is g and not g.any() for p, g in zip(params, kept))
    engine.zero_grad()
    return {"zeroed_in_place": zeroed, "none": all(p.grad is None for p in params)}


def test_zero_grad_honours_set_to_none():
    assert run_world(zero_grad_case, 1) == {"zeroed_in_place": True, "none": True}


def whole_tensors(manifest, *, world_size, stage, **options):
    """A user strategy a config names by `module:function` (FSDP2-like rows)."""
    return fzero.partition.per_tensor_dim0(manifest, world_size=world_size, stage=stage, **options)


def strategy_case(rank, world):
    base = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}}
    plans = {}
    for label, config, given in [
        ("default", base, None),
        ("named", {**base, "strategy": "per_tensor_dim0"}, None),
        ("imported", {**base, "strategy": "tests.test_engine_features:whole_tensors"}, None),
        ("argument", {**base, "strategy": "flat_even"}, whole_tensors),
    ]:
        torch.manual_seed(0)
        engine, *_ = fzero.initialize(model=Net(), config=config, strategy=given)
        plans[label] = engine.plan
        engine.destroy()
    errors = {}
    for bad in ("nope", "tests.test_engine_features:missing"):
        try:
            fzero.initialize(model=Net(), config={**base, "strategy": bad})
        except fzero.partition.PlanError as error:
            errors[bad] = str(error)
    return plans, errors


def test_initialize_and_the_config_name_a_partitioning_strategy():
    plans, errors = run_world(strategy_case, 2)
    assert plans["default"].strategy == "flat_even"
    assert plans["named"].strategy == "per_tensor_dim0"
    assert plans["imported"] == plans["named"]  # the user function ran
    assert plans["argument"] == plans["named"]  # the argument wins over the config key
    assert errors["nope"].startswith(
        "config key 'strategy' is 'nope'; allowed: flat_even, per_tensor_dim0, whole_tensors "
        "or 'module:function'"
    )
    assert "cannot be loaded" in errors["tests.test_engine_features:missing"]
