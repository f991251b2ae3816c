"""The DeepSpeed surface real scripts call: the `deepspeed` namespace, `get_accelerator`,
`deepspeed.comm`, `zero.Init`/`GatheredParameters`, engine accessors, the optimizer
`initialize` returns, `no_sync`, `destroy`, config keys of current DeepSpeed, the
launcher's flags, errors that name what went wrong across ranks, DeepSpeed's memory
estimators and `see_memory_usage`, `runtime.activation_checkpointing.checkpointing`, and
`ops.lamb.FusedLamb`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fzero
from fzero import compat
from fzero.config import ConfigError
from tests._dist import run_world
from tests.models import Net, global_batch

ROOT = Path(__file__).resolve().parent.parent
MICRO, LR = 2, 1e-2


@pytest.fixture
def deepspeed():
    """`import deepspeed` served by fzero for one test."""
    was = compat.installed()
    compat.install()
    import deepspeed

    yield deepspeed
    if not was:
        compat.uninstall()


def test_namespace_serves_fzero_and_names_what_it_lacks(deepspeed):
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.utils import logger

    assert deepspeed.initialize is fzero.initialize
    assert deepspeed.DeepSpeedEngine is fzero.Engine
    assert deepspeed.zero.GatheredParameters and deepspeed.zero.Init
    assert "+fzero." in deepspeed.__version__
    assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.get_local_rank() == 0
    assert logger.name == "fzero"
    accelerator = get_accelerator()
    assert accelerator.device_name() == "cpu" and accelerator.current_device_name() == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.is_bf16_supported() and accelerator.device_count() == 1
    accelerator.manual_seed(3)
    first = torch.rand(2)
    accelerator.manual_seed(3)
    assert torch.equal(first, torch.rand(2))
    params = [nn.Parameter(torch.ones(2))]
    assert isinstance(DeepSpeedCPUAdam(params, lr=0.1), torch.optim.AdamW)
    assert isinstance(FusedAdam(params, adam_w_mode=False), torch.optim.Adam)
    with pytest.raises(ImportError, match=r"Mixture of Experts.*not supported by fzero") as error:
        import deepspeed.moe.layer
    assert not isinstance(error.value, ModuleNotFoundError)
    with pytest.raises(ImportError, match=r"pipeline parallelism.*not supported by fzero"):
        from deepspeed.pipe import PipelineModule  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        import deepspeed.no_such_module


def test_uninstall_forgets_the_served_modules(deepspeed):
    compat.uninstall()
    assert not compat.installed() and "deepspeed" not in sys.modules
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("deepspeed")
    compat.install()  # the fixture's teardown expects it


def test_package_metadata_answers_with_a_version_that_says_fzero(deepspeed):
    """Transformers and Accelerate look DeepSpeed up by distribution metadata."""
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__
    assert importlib.metadata.version("DeepSpeed").startswith("0.19.8+fzero.")
    summary = importlib.metadata.distribution("deepspeed").metadata["Summary"]
    assert "fzero" in summary
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    assert DeepSpeedEngine is fzero.Engine
    for name in VALID_LR_SCHEDULES:  # every name Accelerate accepts, fzero builds
        assert fzero.optim.schedule_from_name(name, {}) is not None


def test_import_fzero_as_deepspeed_has_the_top_level_names():
    for name in ("initialize", "init_distributed", "zero", "comm", "accelerator"):
        assert hasattr(fzero, name), name


# ---- the engine's DeepSpeed surface ---------------------------------------------------------


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        **extra,
    }


def _micro_step(engine, rank, world, step, backward=None):
    x, y = global_batch(step, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
    (backward or engine.backward)(loss)
    return loss


def surface_cases(rank: int, world: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = Net()
        engine, optimizer, _, scheduler = fzero.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage)
        )
        assert engine.lr_scheduler is scheduler
        assert engine.zero_optimization_stage() == stage
        assert engine.zero_optimization() == (stage > 0)
        assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
        assert engine.get_global_grad_norm() is None
        assert engine.get_mom() == [(0.9, 0.999)]
        for step in range(4):
            if step == 2:  # a script edits the lr: the next step uses it
                optimizer.param_groups[0]["lr"] = LR / 4
            _micro_step(engine, rank, world, step)
            optimizer.step()  # DeepSpeed scripts call the optimizer's step
        out[("lr-edit", stage)] = engine.state_dict()
        out[("norm", stage)] = engine.get_global_grad_norm()
        saved = optimizer.state_dict()
        before = engine.state_dict()
        for step in range(4, 6):
            _micro_step(engine, rank, world, step)
            engine.step()
        after = engine.state_dict()
        optimizer.load_state_dict(saved)
        restored = engine.state_dict()
        for step in range(4, 6):
            _micro_step(engine, rank, world, step)
            engine.step()
        out[("state-dict", stage)] = (before, restored, after, engine.state_dict())
        engine.destroy()
        if rank == 0:  # the module is whole again and free of the engine's hooks
            x, _ = global_batch(0, MICRO)
            out[("destroyed", stage)] = (model(x), engine.module is model)
    return out


def reference_lr_edit(world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["lr"] = LR / 4
        x, y = global_batch(step, MICRO * world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())))
        opt.step()
    return {"state": model.state_dict(), "norm": norms[-1].item()}


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_param_groups_state_dict_accessors_and_destroy(world):
    results = run_world(surface_cases, world)
    reference = reference_lr_edit(world)
    for stage in range(4):
        for name, value in reference["state"].items():
            torch.testing.assert_close(
                results[("lr-edit", stage)][name], value, rtol=1e-5, atol=1e-6
            )
        assert results[("norm", stage)] == pytest.approx(reference["norm"], rel=1e-5)
        before, restored, after, again = results[("state-dict", stage)]
        for name in before:
            assert torch.equal(restored[name], before[name]), (stage, name)
            assert torch.equal(again[name], after[name]), (stage, name)
        output, same_module = results[("destroyed", stage)]
        assert same_module
        expected = Net()
        expected.load_state_dict(again)
        torch.testing.assert_close(output, expected(global_batch(0, MICRO)[0]), rtol=0, atol=0)


def no_sync_case(rank: int, world: int, stage: int) -> dict | str:
    results = {}
    for use_no_sync in (False, True):
        torch.manual_seed(0)
        config = {**_config(stage), "train_micro_batch_size_per_gpu": MICRO}
        engine = fzero.shard(Net(), config=config)
        if stage >= 2:
            try:
                with engine.no_sync():
                    pass
            except RuntimeError as error:
                return str(error)
        for step in range(3):
            if use_no_sync:  # two micro-batches summed locally, reduced with the third
                with engine.no_sync():
                    _micro_step(engine, rank, world, 10 + step)
                    _micro_step(engine, rank, world, 20 + step)
            else:
                for extra in (10, 20):
                    _micro_step(engine, rank, world, extra + step)
            _micro_step(engine, rank, world, step)
            engine.step()
        results[use_no_sync] = engine.state_dict()
    return results


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_sums_locally_and_reduces_at_the_next_backward(stage):
    results = run_world(no_sync_case, 2, stage)
    for name, value in results[False].items():
        torch.testing.assert_close(results[True][name], value, rtol=1e-6, atol=1e-7)


def test_no_sync_is_refused_at_stage_2():
    assert "incompatible with gradient partitioning of ZeRO stage 2" in run_world(
        no_sync_case, 1, 2
    )


def autocast_case(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    config = _config(1, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    engine = fzero.shard(Net(), config=config)
    x, y = global_batch(0, MICRO)
    output = engine(x)
    loss = nn.functional.mse_loss(output.float(), y)
    engine.backward(loss)
    engine.step()
    return {"dtype": str(output.dtype), "params": str(next(engine.module.parameters()).dtype)}


def test_torch_autocast_runs_the_forward_in_bf16_over_fp32_parameters():
    result = run_world(autocast_case, 1)
    assert result == {"dtype": "torch.bfloat16", "params": "torch.float32"}


def test_config_keys_of_current_deepspeed():
    for off in (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False}},
        {"bf16": {"enabled": True, "bf16_optimizer_states": False}},
        {"torch_autocast": {"enabled": False, "dtype": "float16"}},
    ):
        fzero.load_config(off)
    with pytest.raises(ConfigError) as error:
        fzero.load_config({"bf16": {"enabled": True, "immediate_grad_update": True}})
    message = str(error.value)
    assert "not supported yet by fzero" in message and "\n" not in message
    assert "Known keys" not in message and "known keys" not in message
    with pytest.raises(ConfigError, match="did you mean 'bf16_optimizer_states'"):
        fzero.load_config({"bf16": {"bf16_optimizer_state": True}})
    # DeepSpeed's bf16 example ships both, with torch's dtype name
    both = {
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
        "bf16": {"enabled": True},
    }
    assert fzero.load_config(both).torch_autocast.enabled
    with pytest.raises(ConfigError, match=r"'torch_autocast\.dtype' 'float16' is not supported"):
        fzero.load_config({"torch_autocast": {"enabled": True, "dtype": "float16"}})


# ---- errors that name ranks --------------------------------------------------------------


def different_dirs_case(rank: int, world: int, root: str) -> str:
    engine = fzero.shard(Net(), config=_config(1))
    try:
        engine.save_checkpoint(os.path.join(root, f"rank{rank}"))
    except ValueError as error:
        return str(error)
    return "saved"


def test_ranks_passing_different_checkpoint_dirs_are_told_so(tmp_path):
    message = run_world(different_dirs_case, 2, str(tmp_path))
    assert "save_checkpoint: ranks passed different arguments" in message
    assert "rank0" in message and "rank1" in message


def test_a_rank_that_never_arrives_is_named(tmp_path):
    script = textwrap.dedent(
        """
        import time
        import torch
        from torch import nn
        import fzero
        from tests.models import Net, global_batch

        fzero.comm.init_distributed()
        rank = fzero.comm.get_rank()
        engine = fzero.shard(Net(), stage=2, config={"train_micro_batch_size_per_gpu": 2})
        for step in range(4):
            if rank == 1 and step == 2:
                time.sleep(30)  # stuck in its data loader
            x, y = global_batch(step, 4)
            loss = nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[:2])
            engine.backward(loss)
            engine.step()
        """
    )
    path = tmp_path / "hung_rank.py"
    path.write_text(script)
    # The timeout is also the ranks' rendezvous bound: 10 s leaves a loaded machine time to
    # start both processes, and rank 1 sleeps well past it.
    env = {**os.environ, "FZERO_TIMEOUT_S": "10", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fzero.cli", "run", "-n", "2", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - start < 60
    assert re.search(
        r"fzero backward of engine Net \(micro-step 2\): rank\(s\) \[1\] did not arrive",
        done.stderr,
    ), done.stderr[-3000:]


def test_a_rank_that_skips_a_state_dict_is_named(tmp_path):
    """Rank 1 never calls `engine.state_dict()` (then `fzero.state_dict`): rank 0's error
    names the operation and the missing rank after the collective timeout, not silence."""
    script = textwrap.dedent(
        """
        import sys, time
        import torch
        import fzero
        from tests.models import Net

        fzero.comm.init_distributed()
        rank = fzero.comm.get_rank()
        functional = sys.argv[1] == "functional"
        if functional:
            model = Net()
            plan = fzero.partition.plan(fzero.partition.describe(model), world_size=2, stage=3)
            state = fzero.init(model, plan, fzero.optim.adamw())
        else:
            engine = fzero.shard(Net(), stage=3, config={"train_micro_batch_size_per_gpu": 2})
        if rank == 1:
            time.sleep(30)  # skips the call
        elif functional:
            fzero.state_dict(state)
        else:
            engine.state_dict()
        """
    )
    path = tmp_path / "skipping_rank.py"
    path.write_text(script)
    # 10 s: the ranks' rendezvous is bounded by the timeout too (a loaded machine's start)
    env = {**os.environ, "FZERO_TIMEOUT_S": "10", "PYTHONPATH": str(ROOT)}
    missing = r"\(micro-step 0\): rank\(s\) \[1\] did not arrive"
    patterns = {
        "engine": r"fzero state_dict of engine Net " + missing,
        "functional": r"fzero fzero.state_dict " + missing,
    }
    # both doors' runs at once: each mostly waits for its timeout
    runs = {
        door: subprocess.Popen(
            [sys.executable, "-m", "fzero.cli", "run", "-n", "2", str(path), door],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for door in patterns
    }
    try:
        for door, run in runs.items():
            _, stderr = run.communicate(timeout=120)
            assert run.returncode != 0, door
            assert re.search(patterns[door], stderr), stderr[-3000:]
    finally:
        for run in runs.values():
            run.kill()
            run.communicate()


# ---- the launcher -----------------------------------------------------------------------


def test_launcher_flags_map_to_the_entry_environment(capsys, monkeypatch):
    from fzero.cli import main  # what `python -m fzero.cli` runs, in this process

    monkeypatch.chdir(ROOT)
    assert main(["run", "--dry-run", "--as-deepspeed", "--bind_cores_to_rank",
                 "--bind_core_list", "0-3", "-n", "2", "train.py", "--x"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    assert "FZERO_AS_DEEPSPEED=1" in line and "FZERO_LOCAL_RANK_ARG=1" in line
    assert "'FZERO_CORE_LISTS=0,1;2,3'" in line
    assert line.endswith("-m fzero.cli.launch_entry train.py --x")
    code = main(["run", "--dry-run", "--bind_core_list", "0-3", "train.py"])
    assert code == 2 and "--bind_core_list needs --bind_cores_to_rank" in capsys.readouterr().err


def test_ranks_get_local_rank_and_their_cores(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(
        textwrap.dedent(
            """
            import argparse, json, os, sys
            import deepspeed
            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, required=True)
            parser.add_argument("--out")
            args = parser.parse_args()
            with open(f"{args.out}.{args.local_rank}", "w") as f:
                json.dump({"cores": sorted(os.sched_getaffinity(0)),
                           "omp": os.environ.get("OMP_NUM_THREADS"),
                           "module": deepspeed.__name__}, f)
            """
        )
    )
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("binding two ranks needs two cores")
    out = str(tmp_path / "r")
    subprocess.run(
        [sys.executable, "-m", "fzero.cli", "run", "--as-deepspeed", "--bind_cores_to_rank",
         "-n", "2", str(script), "--out", out],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    half = len(cores) // 2
    for rank in range(2):
        report = json.loads(Path(f"{out}.{rank}").read_text())
        assert report["cores"] == cores[rank * half : (rank + 1) * half]
        assert report["omp"] == str(half) and report["module"] == "fzero.compat.deepspeed"


def forward_only_case(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    expected = model(global_batch(0, MICRO)[0])
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}}
    engine, optimizer, _, _ = fzero.initialize(model=model, config=config)
    output = engine(global_batch(0, MICRO)[0])
    try:
        engine.backward(output.sum())
        message = "trained"
    except RuntimeError as error:
        message = str(error)
    return {
        "same_output": torch.equal(output, expected),
        "message": message,
        "optimizer": optimizer is engine.optimizer,
        "module_attribute": [n for n, _ in engine.named_parameters()][:1],
    }


def log_level_case(rank: int, world: int) -> dict:
    import logging

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "log_level": "error",
        "disable_python_gc": True,
    }
    engine, *_ = fzero.initialize(model=Net(), config=config)
    return {
        "level": logging.getLogger("fzero").level,
        "collected": type(engine.collect_python_gc()).__name__,
        "average": engine.gradient_average,
    }


def test_log_level_sets_the_logger_level_and_python_gc_is_collected_on_request():
    """`log_level` sets the level of the logger fzero and `deepspeed.utils.logger` log
    through when the engine is built, as DeepSpeed sets its own; `collect_python_gc()`
    (for `disable_python_gc` scripts) collects; `gradient_average` is an attribute."""
    import logging

    result = run_world(log_level_case, 1)
    assert result == {"level": logging.ERROR, "collected": "int", "average": True}


def _set_group_values(groups: list[dict], step: int) -> None:
    """What a script's own schedule of other hyper-parameters writes at step 2."""
    if step == 2:
        groups[0]["weight_decay"] = 0.3
        groups[0]["betas"] = (0.5, 0.9)


def group_values_case(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    config = {k: v for k, v in _config(stage).items() if k != "optimizer"}
    engine, *_ = fzero.initialize(model=model, optimizer=optimizer, config=config)
    for step in range(4):
        _set_group_values(engine.optimizer.param_groups, step)
        _micro_step(engine, rank, world, step)
        engine.step()
    return engine.state_dict(dtype=torch.float32)


@pytest.mark.parametrize("stage", [0, 3])
def test_hyper_parameters_a_script_sets_in_a_param_group_are_read_each_step(stage):
    """A script that changes a group's weight decay and betas mid-run (its own schedule,
    or DeepSpeed's OneCycle writing betas) trains as torch.optim does: the engine reads
    its groups at every step (it read only the lr); checked against DeepSpeed in
    tests/deepspeed_reference/schedulers.py."""
    got = run_world(group_values_case, 2, stage)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(4):
        _set_group_values(optimizer.param_groups, step)
        x, y = global_batch(step, MICRO * 2)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_on_device_and_deepspeeds_other_top_level_names(deepspeed):
    """`deepspeed.OnDevice` builds on its device in its dtype inside the block only
    (DeepSpeed 0.19.8's own fails on this torch: its Tensor.__new__ patch no longer
    fits); `init_inference` and DeepSpeed's names fzero does not serve say what they are,
    and stay False to `hasattr` (clients' feature checks)."""
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = nn.Linear(3, 4)
        index = torch.zeros(2, dtype=torch.int64)
    assert model.weight.device.type == "meta" and model.weight.dtype == torch.bfloat16
    assert index.device.type == "meta" and index.dtype == torch.int64  # not floating: kept
    with deepspeed.OnDevice(dtype=torch.float16, device="cpu"):
        assert nn.Linear(2, 2).weight.dtype == torch.float16
    with deepspeed.utils.init_on_device.OnDevice(dtype=torch.float16, enabled=False):
        assert nn.Linear(2, 2).weight.dtype == torch.float32
    after = nn.Linear(2, 2).weight
    assert after.device.type == "cpu" and after.dtype == torch.float32
    assert deepspeed.get_accelerator() is not None and deepspeed.logger.name == "fzero"
    with pytest.raises(NotImplementedError, match=r"init_inference .*not supported by fzero"):
        deepspeed.init_inference(nn.Linear(2, 2))
    assert not hasattr(deepspeed, "PipelineModule")
    with pytest.raises(AttributeError, match="InferenceEngine is DeepSpeed-Inference"):
        deepspeed.InferenceEngine  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        deepspeed.nope  # noqa: B018


def test_deepspeed_config_reads_a_config_as_deepspeeds_does(deepspeed, tmp_path):
    """`DeepSpeedConfig(path or dict)` (DeepSpeed's monitor tutorial builds its
    `MonitorMaster` from one): batch sizes resolved over world size 1 without a process
    group, DeepSpeed's defaults (clipping 1.0) and names (`optimizer_name` lower-cased
    for its own optimizers); what fzero refuses is refused; an attribute fzero does not
    serve says so. (`make test-deepspeed` runs the tutorial's monitor under both.)"""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    assert deepspeed.DeepSpeedConfig is DeepSpeedConfig
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": {"type": '
        '"AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}, "csv_monitor": '
        f'{{"enabled": true, "output_path": "{tmp_path}", "job_name": "run"}}}}'
    )
    config = DeepSpeedConfig(str(path))
    sizes = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
             config.gradient_accumulation_steps, config.world_size)  # fmt: skip
    assert sizes == (8, 4, 2, 1)
    assert (config.zero_optimization_stage, config.zero_enabled) == (2, True)
    assert (config.optimizer_name, config.optimizer_params) == ("adamw", {"lr": 0.1})
    assert config.gradient_clipping == 1.0 and config.scheduler_name is None
    assert config.monitor_config.enabled and config.monitor_config.csv_monitor.enabled
    assert not config.monitor_config.tensorboard.enabled
    with pytest.raises(AttributeError, match=r"DeepSpeedConfig\.pipeline is not served"):
        config.pipeline  # noqa: B018
    with pytest.raises(DeepSpeedConfigError, match="train_micro_batch_size_per_gpu needs"):
        DeepSpeedConfig({"steps_per_print": 5})
    with pytest.raises(DeepSpeedConfigError, match="hybrid_engine"):
        DeepSpeedConfig({"train_batch_size": 2, "hybrid_engine": {"enabled": True}})


def test_repeating_loader_starts_its_loader_again(deepspeed):
    """`deepspeed.runtime.dataloader.RepeatingLoader`: past the loader's end it starts a
    new pass; `DeepSpeedDataLoader` says where the same loader is."""
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader

    data = torch.utils.data.TensorDataset(torch.arange(5))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    batches = [batch[0].tolist() for _, batch in zip(range(5), RepeatingLoader(loader))]
    assert batches == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    with pytest.raises(NotImplementedError, match=r"engine\.deepspeed_io\(dataset\)"):
        DeepSpeedDataLoader(data, batch_size=2)


def tput_case(rank, world):
    compat.install()
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=config)
    timer = engine.tput_timer
    seen = [(timer.batch_size, timer.initialized, timer.avg_samples_per_sec())]
    for _ in range(7):
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
    seen.append((timer.micro_step_count, timer.global_step_count, timer.avg_samples_per_sec()))
    timer.update_epoch_count()
    seen.append((timer.epoch_count, timer.micro_step_count))
    seen.append((engine.has_moe_layers, str(engine.communication_data_type)))
    engine.destroy()
    return seen


def test_tput_timer_counts_as_deepspeeds():
    """`engine.tput_timer` (DeepSpeed-Chat calls `update_epoch_count()` each epoch):
    micro-steps, optimizer steps at the boundary, epochs; the rate once steps are timed
    (`make test-deepspeed` compares the counts with DeepSpeed's). DeepSpeed's
    `has_moe_layers` and `communication_data_type` answer too."""
    before, after, epoch, other = run_world(tput_case, 1)
    assert before == (4, False, float("-inf"))
    assert after[:2] == (7, 3) and after[2] > 0
    assert epoch == (1, 0)
    assert other == (False, "torch.float32")  # fzero reduces in fp32 unless told


def test_deepspeeds_timers_time_and_log(deepspeed, capsys):
    """`deepspeed.utils.timer`: named timers summing their intervals in ms until reset,
    a running one counted to now and left running, `log`'s line; refusing a double
    start (`make test-deepspeed` compares the arithmetic with DeepSpeed's)."""
    from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer, trim_mean

    timers = SynchronizedWallClockTimer()
    for _ in range(2):
        timers("fwd").start()
        time.sleep(0.01)
        timers("fwd").stop()
    assert timers("fwd").elapsed(reset=False) >= 20.0
    timers.log(["fwd", "missing"], normalizer=2.0)
    assert re.fullmatch(r"time \(ms\) \| fwd: \d+\.\d\d\n", capsys.readouterr().out)
    assert timers("fwd").elapsed() == 0  # log reset it
    timers("bwd").start()
    with pytest.raises(RuntimeError, match="bwd timer has already been started"):
        timers("bwd").start()
    assert timers("bwd").elapsed() >= 0 and timers("bwd").started_
    assert trim_mean([9.0, 1.0, 2.0, 3.0], 0.25) == 2.5
    assert NoopTimer()("x").elapsed() == 0


def test_the_safe_globals_scripts_import_are_served(deepspeed):
    """Scripts on torch >= 2.6 import DeepSpeed's `LossScaler` and `ZeroStageEnum` at
    start for `torch.serialization.add_safe_globals`; the dynamic scaler halves after
    its hysteresis and grows after a window of clean steps (DeepSpeed 0.19's rule)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])
    assert ZeroStageEnum(3) is ZeroStageEnum.weights is ZeroStageEnum.max_stage
    scaler = DynamicLossScaler(16, 2, 1, 2, False)
    scales = []
    for overflow in (True, True, False, False, False, True):
        scaler.update_scale(overflow)
        scales.append(scaler.cur_scale)
    assert scales == [16, 8, 8, 8, 16, 16]
    with pytest.raises(Exception, match="loss scale already at minimum"):
        at_min = DynamicLossScaler(1, 2, 1, 1, False)
        at_min.update_scale(True)


def test_move_to_device_moves_nested_tensors_and_in_place_where_asked(deepspeed):
    """`deepspeed.runtime.utils.move_to_device`: tensors in nested lists, tuples and
    dicts on the device, other values as they are; a tensor `criterion_func` accepts
    keeps its identity (its data swapped), as DeepSpeed's."""
    from deepspeed.runtime.utils import move_to_device

    pair, other, asked = torch.ones(2), torch.zeros(1), []

    def criterion(t: torch.Tensor) -> bool:
        asked.append(t.numel())
        return t.numel() == 2

    moved = move_to_device({"a": [pair, 3], "b": (other,)}, "cpu", criterion)
    assert isinstance(moved["b"], tuple) and moved["a"][1] == 3
    assert moved["a"][0] is pair and torch.equal(moved["b"][0], other)
    assert sorted(asked) == [1, 2]  # every tensor, and only tensors, asked


def test_initialize_without_an_optimizer_runs_forward_only():
    result = run_world(forward_only_case, 2)
    assert result["same_output"] and result["optimizer"]
    assert "has no optimizer" in result["message"] and "runs forward only" in result["message"]
    assert result["module_attribute"] == ["embed.weight"]  # engine.x falls back to module.x


def test_nccl_on_a_machine_without_gpus_uses_gloo():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run_world(_nccl_case, 1) == "gloo"


def _nccl_case(rank: int, world: int) -> str:
    compat.install()
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    return torch.distributed.get_backend()


def consolidated_16bit_case(rank: int, world: int) -> dict:
    from tests.models import Awkward

    config = {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}}
    engine = fzero.shard(Awkward(), stage=3, optimizer=fzero.optim.adam(lr=0.1), config=config)
    whole = engine._zero3_consolidated_16bit_state_dict()
    trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    return {
        "gather": engine.zero_gather_16bit_weights_on_model_save(),
        "whole": None if whole is None else list(whole),
        "trainable": None if trainable is None else list(trainable),
        "keys": list(engine.module.state_dict()),
    }


def test_zero3_consolidated_16bit_state_dict_as_transformers_calls_it():
    result = run_world(consolidated_16bit_case, 2)
    assert result["gather"] and result["whole"] == result["keys"]
    assert set(result["whole"]) - set(result["trainable"]) == {"frozen.weight", "frozen.bias"}


def zero_init_before_the_engine(rank, world):
    """`zero.Init` partitions at construction (rank 0's values where ranks built
    differently); `GatheredParameters(modifier_rank=1)` leaves rank 1's edit in every
    rank's partition; without a modifier, edits are dropped (DeepSpeed's re-partition);
    a meta parameter with a modifier is refused by name."""
    from fzero import compat

    compat.install()
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp

    deepspeed.init_distributed()
    torch.manual_seed(rank)  # different weights on each rank: rank 0's are kept
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        layer = torch.nn.Linear(3, 2)
    partitioned = layer.weight.numel() == 0 and tuple(layer.weight.ds_shape) == (2, 3)
    status = layer.weight.ds_status.name
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, torch.bfloat16)
    with torch.no_grad():
        with deepspeed.zero.GatheredParameters([layer.weight, layer.bias]):
            built = (layer.weight.tolist(), layer.bias.tolist())
        with deepspeed.zero.GatheredParameters([layer.weight, layer.bias], modifier_rank=1):
            if rank == 1:
                layer.weight.fill_(7.0)
        with deepspeed.zero.GatheredParameters([layer.bias]):
            layer.bias.fill_(float(rank) + 5)
        with deepspeed.zero.GatheredParameters([layer.weight, layer.bias]):
            after = (layer.weight.tolist(), layer.bias.tolist())
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    try:
        with deepspeed.zero.GatheredParameters([meta.weight], modifier_rank=0):
            pass
        refused = ""
    except ValueError as error:
        refused = str(error)
    return partitioned, status, wrapped is torch.arange, built, after, refused


def test_gathered_parameters_before_the_engine_keep_the_modifiers_edits():
    partitioned, status, unwrapped, built, after, refused = run_world(
        zero_init_before_the_engine, 2
    )
    assert partitioned and status == "NOT_AVAILABLE" and unwrapped
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 2)
    assert built == (plain.weight.tolist(), plain.bias.tolist())  # rank 0's construction
    assert after[0] == [[7.0] * 3] * 2  # rank 1's edit, on rank 0
    assert after[1] == plain.bias.tolist()  # no modifier: the edit is dropped
    assert "modifier_rank=0) got parameter 0 (shape (2, 3)) on the meta device" in refused


def exclude_frozen(rank, world, root):
    """A frozen layer under a trainable head (PEFT's shape)."""
    from fzero.checkpoint import CheckpointError
    from fzero.checkpoint._format import read_index

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model[0].requires_grad_(False)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
        return fzero.shard(model, optimizer=fzero.optim.adamw(lr=0.1), config=config)

    def step(engine, i):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        return loss.item()

    engine = build()
    step(engine, 0)
    path = engine.save_checkpoint(root, exclude_frozen_parameters=True)
    keys = [t["key"] for t in read_index(path)["tensors"]]
    again = build()
    try:
        again.load_checkpoint(root)
        strict = "no error"
    except CheckpointError as error:
        strict = str(error)
    again.load_checkpoint(root, load_module_strict=False)
    return keys, strict, [step(engine, 1)], [step(again, 1)]


def test_save_checkpoint_can_leave_frozen_parameters_out(tmp_path):
    keys, strict, losses, resumed = run_world(exclude_frozen, 1, str(tmp_path))
    assert keys == ["1.weight", "1.bias"]
    assert "missing ['0.bias', '0.weight']" in strict
    assert resumed == losses


def optimizer_refusals(rank, world):
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    engine, optimizer, _, _ = fzero.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={**config, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
    )
    messages = []
    for call in (
        lambda: optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]}),
        lambda: optimizer.register_step_pre_hook(lambda *a: None),
        lambda: optimizer.register_load_state_dict_post_hook(lambda *a: None),
    ):
        try:
            call()
            messages.append("")
        except NotImplementedError as error:
            messages.append(str(error))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    scheduler.step()
    return messages, optimizer.param_groups[0]["lr"]


def test_engine_optimizer_refuses_what_it_cannot_do_by_name():
    """torch.optim.Optimizer methods the engine's optimizer has no meaning for say so;
    torch's schedulers still drive it."""
    messages, lr = run_world(optimizer_refusals, 1)
    assert messages[0].startswith("EngineOptimizer.add_param_group: fzero's engine plans")
    assert messages[1].startswith("EngineOptimizer.register_step_pre_hook: the engine's")
    assert messages[2].startswith("EngineOptimizer.register_load_state_dict_post_hook")
    assert lr == pytest.approx(0.05)


# ---- DeepSpeed's memory estimators, see_memory_usage, the checkpointing path, FusedLamb ----

# `f"{OffloadDeviceEnum.cpu:4}"` as DeepSpeed's tables print it on this Python
_CPU = "cpu " if sys.version_info < (3, 11) else "OffloadDeviceEnum.cpu"


def test_memory_estimators_give_deepspeeds_figures_for_a_known_model(deepspeed, capsys):
    """nn.Linear(1000, 1000) and a second Parameter over its weight's storage: 1,001,000
    parameters, the largest layer all of them; the figures worked out from DeepSpeed's
    formulas (`tests/deepspeed_reference/estimators.py` runs DeepSpeed beside)."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    model, n = nn.Sequential(nn.Linear(1000, 1000), nn.Module()), 1_001_000
    model[1].alias = nn.Parameter(model[0].weight.detach())  # the same storage: counted once
    assert stage3.model_to_params(model) == (n, n) and stage_1_and_2.model_to_params(model) == n
    # ZeRO-3, 4 GPUs on 2 nodes: both offloaded (18 bytes a parameter on a node's CPU,
    # the largest layer's 4 on the GPU); none offloaded (18 over 8 GPUs)
    assert stage3.estimate_zero3_model_states_mem_needs(n, n, 4, 2) == (13_513_500, 4 * n, 4 * n)
    assert stage3.estimate_zero3_model_states_mem_needs(
        n, n, 4, 2, cpu_offload=False, cpu_offload_params=False, zero_init=False
    ) == (n * 4 * 4 * 1.5, 4 * n + 2_252_250, 4 * n)
    assert stage3.estimate_zero3_model_states_mem_needs(1e9, 1e8)[2] == 4e8  # of its type
    assert stage_1_and_2.estimate_zero2_model_states_mem_needs(n) == (n * 16 * 1.5, 2 * n)
    assert stage_1_and_2.estimate_zero2_model_states_mem_needs(
        n, 4, cpu_offload=False, additional_buffer_factor=2
    ) == (n * 4 * 4 * 2, 2 * n + 4_504_500)
    capsys.readouterr()
    assert stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(model, 8) is None
    assert capsys.readouterr().out == (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        "HW: Setup with 1 node, 8 GPUs per node.\n"
        "SW: Model with 1M total params.\n"
        "  per CPU  |  per GPU |   Options\n"
        f"    0.04GB |   0.00GB | offload_optimizer={_CPU}\n"
        "    0.04GB |   0.00GB | offload_optimizer=none\n"
    )
    assert stage3.estimate_zero3_model_states_mem_needs_all_cold(2e9, 1e8, 1, 2) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [
        "HW: Setup with 2 nodes, 1 GPU per node.",
        "SW: Model with 2000M total params, 100M largest layer params.",
    ]
    assert (
        lines[4]
        == f"   25.15GB |   0.37GB | offload_param={_CPU}, offload_optimizer={_CPU}, zero_init=1"
    )
    assert (
        lines[-1]
        == "   11.18GB |  17.14GB | offload_param=none, offload_optimizer=none, zero_init=0"
    )
    assert len(lines) == 10


def test_see_memory_usage_prints_deepspeeds_lines_only_when_forced_on_rank_0(
    deepspeed, capsys, monkeypatch
):
    from deepspeed.runtime.utils import see_memory_usage

    see_memory_usage("not forced")
    assert capsys.readouterr().out == ""
    see_memory_usage("forced", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "forced" and len(lines) == 3
    gap, number = " " * 9, r"\d+\.\d+"  # the CPU: this process's resident memory, no CUDA
    assert re.fullmatch(
        rf"MA {number} GB{gap}Max_MA {number} GB{gap}CA {number} GB{gap}Max_CA \d+ GB ", lines[1]
    ), lines[1]
    assert float(lines[1].split()[1]) > 0
    assert re.fullmatch(rf"CPU Virtual Memory:  used = {number} GB, percent = {number}%", lines[2])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    see_memory_usage("rank 1", force=True)
    assert capsys.readouterr().out == ""


def test_activation_checkpointing_is_deepspeed_checkpointing_by_every_path(deepspeed):
    """As in DeepSpeed, where `deepspeed.checkpointing` is this module (Megatron-style
    code imports it by its `runtime` path): one module object, however reached."""
    import deepspeed.checkpointing
    import deepspeed.runtime.activation_checkpointing.checkpointing as by_path
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

    served = deepspeed.checkpointing
    assert by_path is checkpointing is served is fzero.checkpointing is compat.checkpointing
    assert checkpoint is compat.checkpointing.checkpoint
    compat.uninstall()  # forgets them all, served by `fzero.compat.checkpointing` or not
    assert not [name for name in sys.modules if name.split(".")[0] == "deepspeed"]
    compat.install()  # the fixture's teardown expects it


def _deepspeed_fused_lamb_(p, g, m, v, step, *, lr, betas, eps, wd, max_coeff, min_coeff, bc):
    """One step of DeepSpeed's FusedLamb kernel on one tensor, transcribed in torch
    (`csrc/lamb/fused_lamb_cuda_kernel.cu`, eps outside the square root): the moments
    uncorrected, the bias correction in the step size, the trust ratio of that update."""
    b1, b2 = betas
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    update = m / (v.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm().item(), update.norm().item()
    coeff = 1.0
    if w_norm != 0 and u_norm != 0:
        coeff = max(min(w_norm / u_norm, max_coeff), min_coeff)
    step_size = lr * (1 - b2**step) ** 0.5 / (1 - b1**step) if bc else lr
    p.sub_(step_size * coeff * update)


FUSED_LAMB = {"lr": 2e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.05}
# the BERT tutorial's clamp: the ratios of Net's tensors meet both bounds
FUSED_LAMB_CLAMP = {"max_coeff": 0.3, "min_coeff": 0.01}


def _lamb_runs(bias_correction: bool) -> tuple[nn.Module, nn.Module]:
    """Net after 4 steps of FusedLamb (fzero's Lamb) and after 4 of DeepSpeed's kernel,
    from the same weights."""
    from fzero.compat.deepspeed.ops.lamb import FusedLamb

    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    opt = FusedLamb(
        ours.parameters(), **FUSED_LAMB, **FUSED_LAMB_CLAMP, bias_correction=bias_correction
    )
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in theirs.parameters()]
    hp = {**FUSED_LAMB, "wd": FUSED_LAMB["weight_decay"], **FUSED_LAMB_CLAMP}
    hp.pop("weight_decay")
    for step in range(1, 5):
        x, y = global_batch(step, 8)
        for model in (ours, theirs):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            opt.step()
            for p, (m, v) in zip(theirs.parameters(), moments):
                _deepspeed_fused_lamb_(p, p.grad, m, v, step, **hp, bc=bias_correction)
    return ours, theirs


def test_fused_lamb_steps_as_deepspeeds_kernel_and_refuses_what_fzero_would_run_differently():
    for bias_correction in (True, False):  # DeepSpeed's kernel corrects in the step size
        ours, theirs = _lamb_runs(bias_correction=bias_correction)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    from fzero.compat.deepspeed.ops.lamb import FusedLamb

    params = list(Net().parameters())
    refused = {
        "eps_inside_sqrt=True": {"eps_inside_sqrt": True},
        "max_grad_norm=1.0": {"max_grad_norm": 1.0},
    }
    for name, kwargs in refused.items():
        with pytest.raises(NotImplementedError, match=rf"FusedLamb: {name} .*allowed: "):
            FusedLamb(params, **kwargs)
    with pytest.raises(RuntimeError, match="AMSGrad"):  # DeepSpeed's own refusal
        FusedLamb(params, amsgrad=True)
    with pytest.raises(ValueError, match=r"min_coeff 0\.5 and max_coeff 0\.3"):
        FusedLamb(params, max_coeff=0.3, min_coeff=0.5)
    with pytest.raises(NotImplementedError, match="max_grad_norm=3"):  # a group's own
        FusedLamb([{"params": params[:2], "max_grad_norm": 3}])
    opt = FusedLamb(params[:2])
    with pytest.raises(NotImplementedError, match="max_grad_norm=2"):
        opt.add_param_group({"params": params[2:], "max_grad_norm": 2})
    assert len(opt.param_groups) == 1


def fused_lamb_case(rank: int, world: int) -> dict:
    """FusedLamb handed to `initialize` at stage 3 (each tensor's norms across ranks)."""
    from fzero.compat.deepspeed.ops.lamb import FusedLamb

    torch.manual_seed(0)
    model = Net()
    opt = FusedLamb(model.parameters(), **FUSED_LAMB, **FUSED_LAMB_CLAMP)
    engine, _, _, _ = fzero.initialize(model=model, optimizer=opt, config=_config(3))
    for step in range(3):
        _micro_step(engine, rank, world, step)
        engine.step()
    return {"name": engine.functional_optimizer.name, "state": engine.state_dict()}


def test_fused_lamb_handed_to_initialize_trains_as_it_steps_alone():
    from fzero.compat.deepspeed.ops.lamb import FusedLamb

    result = run_world(fused_lamb_case, 2)
    torch.manual_seed(0)
    model = Net()
    opt = FusedLamb(model.parameters(), **FUSED_LAMB, **FUSED_LAMB_CLAMP)
    for step in range(3):
        x, y = global_batch(step, MICRO * 2)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert result["name"] == "lamb"
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6)


def _batches(indices: list[int], size: int, drop_last: bool = False) -> list[list[int]]:
    stop = len(indices) - len(indices) % size if drop_last else len(indices)
    return [indices[i : i + size] for i in range(0, stop, size)]


def deepspeed_io_case(rank: int, world: int) -> list[str]:
    """`engine.deepspeed_io` and `initialize`'s `training_data` loader on this rank,
    checked against this rank's `DistributedSampler` part; the errors it raises."""
    data = torch.utils.data.TensorDataset(torch.arange(11).float().unsqueeze(1), torch.arange(11))
    shuffled = list(torch.utils.data.DistributedSampler(data, world, rank))
    ordered = list(torch.utils.data.DistributedSampler(data, world, rank, shuffle=False))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, loader, _ = fzero.initialize(
        model=nn.Linear(1, 1), config=config, training_data=data
    )
    labels = lambda rows: torch.stack([row[1] for row in rows])  # noqa: E731
    got = {
        "initialize": [b[1].tolist() for b in loader],
        "default": [b[1].tolist() for b in engine.deepspeed_io(data)],
        "eval": [b[1].tolist() for b in engine.deepspeed_io(data, route="eval")],
        "sized": [b.tolist() for b in engine.deepspeed_io(data, batch_size=4, collate_fn=labels)],
    }
    expected = {
        "initialize": _batches(shuffled, 2),
        "default": _batches(shuffled, 2),
        "eval": _batches(ordered, 2),
        "sized": _batches(shuffled, 4),
    }
    errors = []
    for bad in ({"route": "test"}, {"dataset": [1, 2]}):
        try:
            engine.deepspeed_io(**{"dataset": data, **bad})
        except ValueError as error:
            errors.append(str(error))
    engine.destroy()
    dropping = {**config, "dataloader_drop_last": True}
    engine, *_ = fzero.initialize(model=nn.Linear(1, 1), config=dropping)
    got["drop_last"] = [b[1].tolist() for b in engine.deepspeed_io(data)]
    expected["drop_last"] = _batches(shuffled, 2, drop_last=True)
    engine.destroy()
    for key, value in expected.items():
        assert got[key] == value, (rank, key, got[key], value)
    assert shuffled != ordered  # the training route really shuffles
    return errors


def test_deepspeed_io_splits_the_data_over_the_ranks_as_deepspeeds_loader():
    """Each rank reads its `DistributedSampler` part (seed 0: shuffled for training, in
    order for eval), in micro-batches unless told otherwise, through the script's
    `collate_fn`; `initialize`'s loader is the same; the last short batch goes with
    `dataloader_drop_last`; bad arguments are named. (The same batches as DeepSpeed's
    loader: `make test-deepspeed`.)"""
    errors = run_world(deepspeed_io_case, 2)
    assert errors == [
        "deepspeed_io: route is 'test'; allowed: train, eval, predict",
        "deepspeed_io: dataset is a list; expected a torch.utils.data.Dataset "
        "(map-style or iterable)",
    ]
