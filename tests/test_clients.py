"""DeepSpeed's contract as clients rely on it: who owns the scheduler, what `initialize`
returns, what a load restores, and Accelerate's `DeepSpeedPlugin` against its own
non-DeepSpeed run.

DeepSpeed's behaviour (read from its engine, `runtime/engine.py`): `initialize`'s fourth
value is `engine.lr_scheduler` — the `lr_scheduler` argument (a callable is given the
optimizer) over the config's `scheduler` block, else None; the engine steps it after
each applied step; it is a plain attribute that clients reassign (Lightning sets it to
None and steps the scheduler itself); `load_checkpoint` restores the param groups' lr
with the optimizer state, whatever `load_lr_scheduler_states` says. Each case here
failed on fzero before (a scheduler stand-in returned, a second scheduler step per
step, an lr schedule restarting on resume) and trained wrong without an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fzero
from tests._dist import run_script, run_world
from tests.models import Net, global_batch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "client_scripts"
MICRO, LR = 2, 1e-2


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "zero_optimization": {"stage": stage},
        **extra,
    }


def _steps(engine, rank, world, steps, start=0):
    lrs = []
    for step in range(start, start + steps):
        x, y = global_batch(step, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        lrs.append(engine.get_lr()[0])
        engine.backward(nn.functional.mse_loss(engine(x[rows]).float(), y[rows]))
        engine.step()
    return lrs


def _reference(steps: int, world: int, scheduler_of) -> tuple[dict, list[float]]:
    """Plain torch: AdamW and a torch scheduler stepped once per step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = scheduler_of(opt)
    lrs = []
    for step in range(steps):
        x, y = global_batch(step, MICRO * world)
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model.state_dict(), lrs


def _halving(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)


def returns_case(rank, world):
    """What `initialize` returns as the scheduler, per DeepSpeed's four cases."""
    out = {}
    warmup = {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 4}}
    adamw = {"type": "AdamW", "params": {"lr": LR}}
    torch.manual_seed(0)
    model = Net()
    *_, none = fzero.initialize(model=model, config=_config(1, optimizer=adamw))
    out["none"] = none
    torch.manual_seed(0)
    model = Net()
    engine, *_, from_config = fzero.initialize(
        model=model, config=_config(1, optimizer=adamw, scheduler=warmup)
    )
    out["config"] = (from_config is engine.lr_scheduler, from_config.get_lr())
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _halving(opt)
    engine, *_, given = fzero.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(1, scheduler=warmup)
    )
    out["argument_wins"] = given is sched and engine.lr_scheduler is sched
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, _, made = fzero.initialize(
        model=model, lr_scheduler=_halving, config=_config(1, optimizer=adamw)
    )
    out["factory"] = (
        isinstance(made, torch.optim.lr_scheduler.LambdaLR) and made.optimizer is optimizer
    )
    return out


def test_initialize_returns_the_scheduler_deepspeed_returns():
    out = run_world(returns_case, 1)
    assert out["none"] is None  # DeepSpeed returns None: the client keeps its own
    same, lrs = out["config"]
    assert same and lrs == [0.0]  # WarmupLR's first lr, written when it is built
    assert out["argument_wins"] and out["factory"]


def lightning_case(rank, world, tmp, stage):
    """Lightning's DeepSpeedStrategy: `engine.lr_scheduler = None`, the client steps its
    torch scheduler itself; resume with `load_lr_scheduler_states=False` and the
    scheduler state restored from the client's own checkpoint dict."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _halving(opt)
    engine, *_ = fzero.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(stage)
    )
    assert engine.lr_scheduler is sched
    engine.lr_scheduler = None  # Lightning: "disable deepspeed lr scheduling"
    lrs = []
    for step in range(6):
        lrs += _steps(engine, rank, world, 1, start=step)
        sched.step()  # the client's own, once per step
        if step == 2:
            engine.save_checkpoint(tmp, tag="s3", client_state={"sched": sched.state_dict()})
    final = engine.state_dict()
    # resume into a fresh engine, as Lightning does
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _halving(opt)
    engine, *_ = fzero.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(stage)
    )
    engine.lr_scheduler = None
    _, client = engine.load_checkpoint(tmp, tag="s3", load_lr_scheduler_states=False)
    resumed_lr = opt.param_groups[0]["lr"]  # restored with the optimizer state
    sched.load_state_dict(client["sched"])
    resumed = []
    for step in range(3, 6):
        resumed += _steps(engine, rank, world, 1, start=step)
        sched.step()
    return lrs, final, resumed_lr, resumed, engine.state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_client_that_takes_the_scheduler_steps_it_once_and_resumes_its_lr(tmp_path, stage):
    world = 2
    state, lrs_ref = _reference(6, world, _halving)
    lrs, final, resumed_lr, resumed, final_resumed = run_world(
        lightning_case, world, str(tmp_path), stage
    )
    assert lrs == lrs_ref  # one step of the schedule per step, not two
    assert resumed_lr == lrs_ref[3] and resumed == lrs_ref[3:]
    for name, value in state.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(final_resumed[name], final[name]), name


def config_schedule_case(rank, world, tmp, load_lr_scheduler_states):
    """A config `scheduler` block stepped by the engine; a resume restores the lr with
    the optimizer state, and the position only with the scheduler state."""
    warmup = {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 5}}
    adamw = {"type": "AdamW", "params": {"lr": LR}}
    config = _config(3, optimizer=adamw, scheduler=warmup)
    torch.manual_seed(0)
    engine, *_ = fzero.initialize(model=Net(), config=config)
    lrs = _steps(engine, rank, world, 3)
    engine.save_checkpoint(tmp, tag="s3")
    lrs += _steps(engine, rank, world, 3, start=3)
    torch.manual_seed(0)
    engine, *_, scheduler = fzero.initialize(model=Net(), config=config)
    engine.load_checkpoint(tmp, tag="s3", load_lr_scheduler_states=load_lr_scheduler_states)
    resumed = _steps(engine, rank, world, 3, start=3)
    return lrs, resumed, scheduler.state_dict()


@pytest.mark.parametrize("load_lr_scheduler_states", [True, False])
def test_a_config_schedule_resumes_as_deepspeed_does(tmp_path, load_lr_scheduler_states):
    lrs, resumed, position = run_world(
        config_schedule_case, 2, str(tmp_path), load_lr_scheduler_states
    )
    assert lrs[0] == 0.0 and lrs[1] < lrs[2] < LR  # the warmup, one position a step
    # the first resumed step runs at the saved lr either way (the optimizer state's)
    assert resumed[0] == lrs[3]
    if load_lr_scheduler_states:
        assert resumed == lrs[3:] and position == {"last_batch_iteration": 5}
    else:  # DeepSpeed: the scheduler starts over from its first position after that step
        assert resumed[1:] == lrs[1:3] and position == {"last_batch_iteration": 2}


# ---- Accelerate ------------------------------------------------------------------------


def _accelerate(tmp: Path, name: str, stage: int, *args: str) -> tuple[dict, list[dict]]:
    """`tests/client_scripts/accelerate_nlp.py` as `accelerate launch --use_deepspeed`
    starts it (ACCELERATE_USE_DEEPSPEED), as `fzero run --as-deepspeed` runs it (on the
    test ranks: `tests._dist.run_script`)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    run_script(
        "--as-deepspeed", "--no_local_rank", "-n", "1", str(SCRIPTS / "accelerate_nlp.py"),
        "--zero_stage", str(stage), "--out", str(tmp / name), *args,
        cwd=ROOT, env={"ACCELERATE_USE_DEEPSPEED": "true" if stage else "false"},
    )  # fmt: skip
    record = json.loads((tmp / f"{name}.json").read_text())
    return load_file(tmp / f"{name}.safetensors"), record


@pytest.mark.slow  # six launches of Accelerate: in `make test-slow`
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_plugin_steps_the_scripts_scheduler_and_resumes(tmp_path, stage):
    """Accelerate keeps the script's own scheduler only when `initialize` returns None
    for it (DeepSpeed's answer); it then trains as Accelerate without DeepSpeed does,
    and `save_state`/`load_state` resume bitwise, lr included."""
    plain, plain_record = _accelerate(tmp_path, "plain", 0)
    ours, record = _accelerate(tmp_path, "zero", stage, "--save_state_at", "3")
    assert [r["lr"] for r in record] == [r["lr"] for r in plain_record]
    assert record[1]["lr"] > 0  # the warmup moved it (it stayed 0.0 before)
    for name, value in plain.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-5, msg=name)
    again, resumed = _accelerate(
        tmp_path, "resumed", stage, "--save_state_at", "3",
        "--resume_from", str(tmp_path / "zero-state"),
    )  # fmt: skip
    assert resumed == record[3:]
    for name, value in ours.items():
        assert torch.equal(again[name], value), name


# ---- TRL -------------------------------------------------------------------------------


def _sft(tmp: Path, name: str, deepspeed: dict | None) -> dict:
    """`tests/client_scripts/trl_sft.py` on 2 ranks: `fzero run --as-deepspeed` with a
    ZeRO config, else as plain Trainer DDP; returns the saved weights."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    out = tmp / name
    flags = [
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no",
        "--logging_steps", "1", "--seed", "0", "--bf16", "false", "--max_length", "16",
        "--dataloader_num_workers", "0", "--use_cpu", "true",
    ]  # fmt: skip
    command = ["-n", "2"]
    if deepspeed is not None:
        config = tmp / f"{name}.json"
        config.write_text(json.dumps(deepspeed))
        command += ["--as-deepspeed", "--no_local_rank"]
        flags += ["--deepspeed", str(config)]
    run_script(*command, str(SCRIPTS / "trl_sft.py"), *flags, cwd=ROOT)
    return load_file(out / "model.safetensors")


@pytest.mark.slow  # two Trainer launches
def test_trl_sft_trainer_at_zero3_trains_as_without_deepspeed(tmp_path):
    """TRL's SFTTrainer at ZeRO-3 (it imports `ZeroParamStatus` and gathers the LM head
    by `ds_status`) ends where its plain DDP run does."""
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    }
    ours = _sft(tmp_path, "zero3", config)
    plain = _sft(tmp_path, "ddp", None)
    assert ours.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-5, msg=name)


# ---- Lightning -------------------------------------------------------------------------


def _lightning(tmp: Path, name: str, stage: int, *args: str) -> tuple[dict, list[dict]]:
    """`tests/client_scripts/lightning_ds.py` as its users start it (`python script.py`,
    Lightning starts the second process); returns rank 0's final weights and record."""
    pytest.importorskip("lightning")
    from safetensors.torch import load_file

    command = [sys.executable, str(SCRIPTS / "lightning_ds.py"), "--stage", str(stage)]
    command += ["--out", str(tmp / name), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return load_file(tmp / f"{name}.safetensors"), json.loads((tmp / f"{name}.json").read_text())


@pytest.mark.slow  # four Lightning runs a stage
@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_strategy_trains_as_ddp_resumes_and_converts(tmp_path, stage):
    """Lightning's DeepSpeedStrategy (a scheduler from `configure_optimizers`, which
    Lightning steps itself after detaching the engine's) against Lightning's DDP, run
    through and resumed from `save_checkpoint`: equal lrs, weights within 1e-5; the
    checkpoint converts to the fp32 weights it holds. (Lightning's own DDP resume does
    not repeat its uninterrupted run after the first resumed step, so the reference for
    a resume is Lightning's DDP resume.)"""
    from safetensors.torch import load_file

    for name, args in (("", ()), ("resumed-", ("--save_at", "3"))):
        plain, plain_record = _lightning(tmp_path, f"{name}ddp", 0, *args)
        ours, record = _lightning(tmp_path, f"{name}zero", stage, *args)
        assert [r["lr"] for r in record] == [r["lr"] for r in plain_record]
        assert len({r["lr"] for r in record}) == len(record)  # the schedule moved every step
        for key, value in plain.items():
            torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-5, msg=key)
    converted = load_file(tmp_path / "resumed-zero.fp32" / "model.safetensors")
    at_save = load_file(tmp_path / "resumed-zero.at_save.safetensors")
    assert converted.keys() == at_save.keys()
    for key, value in at_save.items():
        assert torch.equal(converted[key], value), key
