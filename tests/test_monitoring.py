"""Watching a run (`fzero.monitoring`): what each monitor writes reads back equal to the
metrics (TensorBoard through `tensorboard`'s reader, the CSV monitor's columns, the
W&B offline run), the communication summary's bytes equal `comm_volume`, the FLOPs
profiler's counts equal the analytic count of a Linear stack, and `fzero plot` draws
the panels."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fzero
from fzero import monitoring
from fzero.config import ConfigError, load_config
from fzero.monitoring import _runs
from tests._dist import run_world
from tests.models import Awkward, Net, global_batch

MICRO = 2


def _tokens(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (size, 5), generator=gen), torch.randint(
        0, 11, (size, 5), generator=gen
    )


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, 11), targets.reshape(-1))


def monitored_case(rank: int, world: int, root: str) -> dict:
    """4 optimizer steps of 2 micro-batches at stage 3 with every monitor fzero can run
    here on, a metrics file, a report every 2 steps; rank 0's per-step mean losses."""
    os.chdir(root)  # W&B writes ./wandb
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "metrics_file": f"{root}/metrics.jsonl",
        "tensorboard": {"enabled": True, "output_path": f"{root}/tb", "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": f"{root}/csv", "job_name": "run"},
        "wandb": {"enabled": True, "project": "fzero-test", "group": "g", "team": None},
    }
    torch.manual_seed(0)
    engine = fzero.shard(Awkward(), config=config)
    step_losses, lrs = [], []
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(4):
            window = []
            for micro in range(2):
                x, y = _tokens(10 * step + micro, MICRO * world)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = _lm_loss(engine(x[rows]), y[rows])
                window.append(loss.item())
                engine.backward(loss)
                engine.step()
            step_losses.append(sum(window) / 2)
            lrs.append(engine.get_lr()[0])
    engine.destroy()
    return {"losses": step_losses, "lrs": lrs, "batch": engine.train_batch_size()}


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file: a 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte header: crc32c,
    length, type 1 full / 2 first / 3 middle / 4 last), which wandb-core writes and
    `wandb sync` reads."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, parts, at = [], [], 7
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header: padding
            at += block - at % block
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        chunk, at = data[at + 7 : at + 7 + length], at + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            parts.append(chunk)
        elif kind == 4:
            records.append(b"".join([*parts, chunk]))
            parts = []
    return records


def _wandb_history(root: Path) -> dict[str, list[tuple[int, float]]]:
    """The metrics of the offline W&B run under `root`, decoded with W&B's protobuf."""
    from wandb.proto import wandb_internal_pb2

    (path,) = root.rglob("run-*.wandb")
    found: dict[str, list[tuple[int, float]]] = {}
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        step = items.get("_step", record.history.step.num)
        for key, value in items.items():
            if not key.startswith("_"):
                found.setdefault(key, []).append((step, value))
    return found


def test_each_monitor_reads_back_equal_to_the_metrics(tmp_path, offline_wandb):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    result = run_world(monitored_case, 2, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    batch = result["batch"]
    assert [r["samples"] for r in records] == [2 * batch, 4 * batch]

    tb = _runs.read_run(tmp_path / "tb")
    csv_run = _runs.read_run(tmp_path / "csv")
    wandb_run = _wandb_history(tmp_path)
    assert len(list((tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1  # rank 0 only
    # DeepSpeed's events: the step's mean loss at the samples before it, lr after it
    expected_loss = [(step * batch, loss) for step, loss in enumerate(result["losses"])]
    expected_lr = [((step + 1) * batch, lr) for step, lr in enumerate(result["lrs"])]
    for run in (tb.series, csv_run.series):
        assert [x for x, _ in run["train_loss"]] == [x for x, _ in expected_loss]
        assert [y for _, y in run["train_loss"]] == pytest.approx(
            [y for _, y in expected_loss], rel=1e-6
        )
        assert [x for x, _ in run["lr"]] == [x for x, _ in expected_lr]
        assert [y for _, y in run["lr"]] == pytest.approx([y for _, y in expected_lr], rel=1e-6)
    wandb_loss = wandb_run["Train/Samples/train_loss"]
    assert [y for _, y in wandb_loss] == pytest.approx([y for _, y in expected_loss], rel=1e-12)
    # fzero's figures at each report equal the metrics file's
    names = {
        "tokens_per_s": "tokens_per_second",
        "tflops": "tflops",
        "mfu": "mfu",
        "memory_mb": "model_state_MB",
        "memory_plan_mb": "model_state_plan_MB",
        "peak_memory_mb": "peak_memory_MB",
        "samples_per_s": "samples_per_second",
    }
    for record in records:
        x = float(record["samples"])
        for key, series in names.items():
            assert dict(tb.series[series])[x] == pytest.approx(record[key], rel=1e-6), key
            assert dict(csv_run.series[series])[x] == record[key], key
            assert dict(wandb_run[f"Train/Samples/{series}"])[x] == record[key], key
        for axes, megabytes in record["comm_mb_per_step"].items():
            assert dict(csv_run.series[f"comm_MB_per_step_{axes}"])[x] == megabytes
        for timer, ms in record["ms"].items():
            assert dict(csv_run.series[f"elapsed_time_ms_{timer}"])[x] == ms
    assert records[0]["comm_mb_per_step"]["world"] > 0
    # the CSV monitor's columns are DeepSpeed's
    with open(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv") as f:
        assert next(csv.reader(f)) == ["step", "train_loss"]


def test_a_missing_monitor_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "comet_ml" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"'comet'.*package 'comet_ml'.*pip install"):
        fzero.monitor({"comet": {"enabled": True, "project": "p"}})


def test_the_comet_monitor_logs_through_comet_ml_every_interval(monkeypatch):
    """Against comet_ml's API (`start`, `set_name`, `log_metric`, `end`) as a recorder:
    the events DeepSpeed's scheduler lets through (a name again only after
    `samples_log_interval` more samples)."""
    calls: list[tuple] = []

    class Experiment:
        def set_name(self, name):
            calls.append(("set_name", name))

        def log_metric(self, name, value, step):
            calls.append(("log_metric", name, value, step))

        def end(self):
            calls.append(("end",))

    fake = type(sys)("comet_ml")
    fake.__spec__ = importlib_spec = type(sys)("spec")  # find_spec needs a spec
    del importlib_spec
    fake.start = lambda **kwargs: calls.append(("start", kwargs)) or Experiment()
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "comet_ml" else real(n, *a)
    )
    mon = fzero.monitor(
        comet={"samples_log_interval": 10, "project": "p", "experiment_name": "e", "online": False}
    )
    mon.write_events([("a", 1.0, 0), ("a", 2.0, 5), ("a", 3.0, 10), ("b", 4.0, 5)])
    mon.close()
    assert calls[0][0] == "start" and calls[0][1]["project"] == "p"
    assert calls[0][1]["online"] is False
    assert calls[1:] == [
        ("set_name", "e"),
        ("log_metric", "a", 1.0, 0),
        ("log_metric", "a", 3.0, 10),
        ("log_metric", "b", 4.0, 5),
        ("end",),
    ]


def test_train_step_users_log_metrics_through_fzero_monitor(tmp_path):
    mon = fzero.monitor(csv_monitor={"output_path": str(tmp_path), "job_name": "fn"})
    metrics = {"loss": torch.tensor(2.5), "lr": [0.1], "grad_norm": 3.0, "loss_scale": 1.0}
    events = mon.log(metrics, samples=8, samples_before=0)
    events += mon.log({**metrics, "loss": 2.0}, samples=16, samples_before=8, tokens=40)
    mon.close()
    run = _runs.read_run(tmp_path / "fn")
    assert run.series["train_loss"] == [(0.0, 2.5), (8.0, 2.0)]
    assert run.series["lr"] == [(8.0, 0.1), (16.0, 0.1)]
    assert run.series["grad_norm"] == [(8.0, 3.0), (16.0, 3.0)]
    assert [x for x, _ in run.series["tokens_per_second"]] == [16.0]


# ---- the communication logger ----------------------------------------------------------


def comms_case(rank: int, world: int, stage: int, precision: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 100 if stage == 3 else 0,
        },
        "comms_logger": {"enabled": True, "prof_all": True},
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    torch.manual_seed(0)
    engine = fzero.shard(Net(), config=config)

    def steps(count: int, first: int) -> None:
        for i in range(first, first + count):
            for _ in range(2):
                x, y = global_batch(i, MICRO * world)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                engine.backward(nn.functional.mse_loss(engine(x[rows]).float(), y[rows]))
                engine.step()

    steps(2, 0)
    logger = monitoring.comms_logger()
    logger.reset()
    steps(3, 2)
    rows = [
        (r.operation, r.purpose, r.axes, r.count, r.bytes, r.modelled_count, r.modelled_bytes)
        for r in logger.rows()
    ]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        from fzero.compat.deepspeed import comm as ds_comm

        summary = ds_comm.log_summary(show_straggler=True, return_dict=True)
    engine.destroy()
    gradients = summary["summary"]["all_reduce"]["gradient norm | world"]
    return {
        "rows": rows,
        "printed": out.getvalue(),
        "summary": gradients["count"] == 3 and gradients["straggler_ms"] >= 0,
        "stragglers": summary["straggler_analysis"] is not None,
    }


@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "fp16"), (3, "fp32")])
def test_the_comms_summary_bytes_equal_comm_volume(stage, precision):
    result = run_world(comms_case, 2, stage, precision)
    rows = result["rows"]
    assert rows
    for operation, purpose, axes, count, size, model_count, model_bytes in rows:
        assert model_bytes is not None, (operation, purpose)  # every collective is modelled
        assert (count, size) == (model_count, model_bytes), (operation, purpose, axes)
    purposes = {r[1] for r in rows}
    assert "gradients" in purposes and "gradient norm" in purposes
    if stage == 3:
        assert "parameters for forward" in purposes
    else:
        assert "parameters after the update" in purposes
    assert (
        "fzero communication summary" in result["printed"] and "straggler ms" in result["printed"]
    )
    assert result["summary"] and result["stragglers"]


def test_purposes_are_comm_volumes_words():
    assert monitoring.purpose_of("updated parameters of unit 3 'b'", "step of engine N", False) == (
        "parameters after the update"
    )
    assert monitoring.purpose_of("parameters of unit 0 'a'", "forward of engine N", False) == (
        "parameters for forward"
    )
    assert monitoring.purpose_of("parameters of unit 0 'a'", "", True) == "parameters for backward"
    assert monitoring.purpose_of("parameters (int8)", "backward of N", False) == (
        "parameters for backward (int8)"
    )
    assert monitoring.purpose_of("gradients of units [1, 2]", "", True) == "gradients"
    assert monitoring.purpose_of("gradients of units [1] across replicas", "", True) == (
        "gradients across replicas"
    )
    assert monitoring.purpose_of("gradients (int4)", "", True) == "gradients (int4)"
    assert monitoring.purpose_of("LAMB norms", "", False) == "LAMB tensor norms"
    assert monitoring.purpose_of("", "", False) == "unnamed"


def test_comms_logger_keys_are_deepspeeds():
    block = load_config(
        {"comms_logger": {"enabled": True, "verbose": False, "prof_all": False, "debug": False,
                          "prof_ops": ["all_reduce", "all_gather_into_tensor"]}}
    ).comms_logger  # fmt: skip
    logger = monitoring.CommsLogger(block)
    assert logger.prof_ops == ["all_reduce", "all_gather"]
    assert logger.wants("all_gather", "", "") and not logger.wants("reduce_scatter", "", "")
    with pytest.raises(ValueError, match=r"prof_ops names 'broadcast'.*allowed"):
        logger.start_profiling_op(["broadcast"])
    assert monitoring.bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert monitoring.bus_bandwidth_factor("all_gather", 4) == 0.75


# ---- the FLOPs profiler ----------------------------------------------------------------

B, SIZES = 4, (16, 32, 8)


def _linear_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]))


def test_flops_of_a_linear_stack_equal_the_analytic_count():
    model = _linear_stack()
    profiler = monitoring.FlopsProfiler(model)
    profiler.start_profile()
    loss = model(torch.randn(B, SIZES[0])).sum()
    profiler.forward_done()
    loss.backward()
    profiler.stop_profile()
    first, second = 2 * B * SIZES[0] * SIZES[1], 2 * B * SIZES[1] * SIZES[2]
    assert profiler.get_total_flops() == first + second
    assert profiler.get_total_macs() == (first + second) // 2
    # backward: both weight gradients, and the second layer's input gradient (the
    # first layer's input needs none)
    assert profiler.get_total_backward_flops() == first + 2 * second
    assert profiler.get_total_params() == sum(p.numel() for p in model.parameters())
    by_name = {p.name: p for p in profiler.profiles()}
    assert by_name["0"].forward_flops == first and by_name["2"].forward_flops == second
    assert by_name["1"].forward_flops == 0 and by_name["0"].depth == 1
    assert by_name[""].forward_seconds >= by_name["0"].forward_seconds > 0
    text = profiler.print_model_profile(output_file=None)
    assert "fwd flops per GPU:" in text and "(0): Linear(" in text
    profiler.end_profile()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_get_model_profile_is_deepspeeds_call(capsys):
    flops, macs, params = monitoring.get_model_profile(
        _linear_stack(), input_shape=(B, SIZES[0]), print_profile=False, as_string=False
    )
    assert flops == 2 * B * (SIZES[0] * SIZES[1] + SIZES[1] * SIZES[2]) and macs == flops // 2
    assert params == SIZES[0] * SIZES[1] + SIZES[1] + SIZES[1] * SIZES[2] + SIZES[2]
    assert capsys.readouterr().out == ""
    as_text = monitoring.get_model_profile(
        _linear_stack(), input_shape=(B, SIZES[0]), print_profile=False
    )
    assert as_text == (monitoring.format_number(flops), monitoring.format_number(macs, "MACs"),
                       monitoring.format_number(params))  # fmt: skip


def profiled_engine_case(rank: int, world: int, path: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": B,
        "steps_per_print": 2,
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": path},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine = fzero.shard(_linear_stack(), config=config)
    modules = list(engine.module.modules())
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(B, SIZES[0], generator=gen)
            engine.backward(engine(x).square().mean())
            engine.step()
    after = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    return {"printed": out.getvalue(), "hooks_left": after != hooks}


def test_the_engine_profiles_the_configured_step(tmp_path):
    path = tmp_path / "flops.txt"
    result = run_world(profiled_engine_case, 1, str(path))
    text = path.read_text()
    first, second = 2 * B * SIZES[0] * SIZES[1], 2 * B * SIZES[1] * SIZES[2]
    assert "Profile Summary at step 2:" in text  # DeepSpeed's label: global_steps after it
    line = next(x for x in text.splitlines() if x.startswith("fwd flops per GPU:"))
    assert line.split(":")[1].strip() == monitoring.format_number(first + second)
    line = next(x for x in text.splitlines() if x.startswith("bwd flops per GPU (counted):"))
    assert line.split(":")[1].strip() == monitoring.format_number(first + 2 * second)
    assert "MFU = FLOPS per GPU / peak:" in text
    assert not result["hooks_left"]
    # later reports count FLOPs per sample as profiled: forward + backward
    assert "(counted)" in result["printed"]


def test_peak_table_names_the_nvidia_parts():
    parts = dict(monitoring.NVIDIA_PEAKS)
    assert parts["A100"]["bf16"] == 312e12 and parts["H100"]["bf16"] == 989.4e12
    assert parts["H200"]["bf16"] == 989.4e12
    peak = monitoring.peak_flops(torch.device("cpu"), torch.float32)
    assert peak.flops > 1e8 and peak.source.startswith("measured")


# ---- fzero plot ------------------------------------------------------------------------


def _metrics_file(path: Path, scale: float) -> None:
    with open(path, "w") as f:
        for step in (2, 4, 6):
            record = {
                "step": step,
                "samples": 8 * step,
                "loss": scale / step,
                "lr": [1e-3 * step],
                "tokens_per_s": 100.0 * step,
                "tflops": 0.01 * step,
                "mfu": 0.001 * step,
                "memory_mb": 6.0,
                "memory_plan_mb": 6.0,
                "comm_mb_per_step": {"world": 1.5, "local": 0.5},
            }
            f.write(json.dumps(record) + "\n")


def test_fzero_plot_draws_each_panel(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fzero.cli import main

    _metrics_file(tmp_path / "a.jsonl", 4.0)
    csv_dir = tmp_path / "csv"
    mon = fzero.monitor(csv_monitor={"output_path": str(csv_dir), "job_name": "b"})
    for step in range(1, 4):
        mon.log({"loss": 3.0 / step, "lr": [0.01]}, samples=8 * step)
    mon.close()
    out = tmp_path / "plot.png"
    assert main(["plot", str(tmp_path / "a.jsonl"), f"csv={csv_dir / 'b'}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = monitoring.plot_runs(
        [_runs.read_run(tmp_path / "a.jsonl"), _runs.read_run(csv_dir / "b", "csv")],
        tmp_path / "again.png",
    )
    assert list(drawn) == list(monitoring.PANELS)
    assert drawn["loss"] == ["a: train_loss", "csv: train_loss"]
    assert drawn["communication per mesh axis"] == ["a: local MB/step", "a: world MB/step"]
    assert drawn["model-state memory vs plan"] == ["a: held MB", "a: plan MB"]
    assert drawn["model FLOPs"] == ["a: TFLOP/s", "a: MFU %"]
    assert main(["plot", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "no such file or directory" in capsys.readouterr().err


# ---- config and logs -------------------------------------------------------------------


def test_deepspeeds_monitor_example_config_parses():
    """The config of DeepSpeed's monitor tutorial (docs/_tutorials/monitor.md)."""
    logs = {"output_path": "output/ds_logs/", "job_name": "train_bert"}
    config = load_config(
        {
            "tensorboard": {"enabled": True, **logs},
            "wandb": {"enabled": True, "team": "my_team", "group": "my_group", "project": "p"},
            "comet": {"enabled": True, "project": "my_project", "experiment_name": "my_experiment"},
            "csv_monitor": {"enabled": True, **logs},
            "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
            "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1,
                               "top_modules": 1, "detailed": True, "output_file": None},
        }
    )  # fmt: skip
    assert config.wandb.team == "my_team" and config.tensorboard.job_name == "train_bert"
    assert config.comet.experiment_name == "my_experiment" and config.flops_profiler.enabled
    with pytest.raises(ConfigError, match=r"'tensorboard.output_dir'.*did you mean 'output_path'"):
        load_config({"tensorboard": {"enabled": True, "output_dir": "x"}})


def test_info_lines_come_from_rank_zero_unless_asked(monkeypatch):
    import logging

    from fzero._logs import RankZeroInfo

    info = logging.LogRecord("fzero", logging.INFO, "", 0, "hello", (), None)
    warning = logging.LogRecord("fzero", logging.WARNING, "", 0, "careful", (), None)
    # the rank as a launched process without a process group yet reads it (this pytest
    # process may hold a one-rank group from an earlier test)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("FZERO_LOG_ALL_RANKS", raising=False)
    assert not RankZeroInfo().filter(info) and RankZeroInfo().filter(warning)
    monkeypatch.setenv("FZERO_LOG_ALL_RANKS", "1")
    assert RankZeroInfo().filter(info)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("FZERO_LOG_ALL_RANKS")
    assert RankZeroInfo().filter(info)
    assert any(isinstance(f, RankZeroInfo) for f in logging.getLogger("fzero").filters)


def test_the_progress_bar_keeps_other_output_above_it(capsys):
    pytest.importorskip("tqdm")
    stdout = sys.stdout
    bar = monitoring.ProgressBar("Net", total=4)
    print("a line of the script")
    bar.update(1, 2.5)
    print("another", end="")
    print(" line")
    bar.close()
    assert sys.stdout is stdout
    out, err = capsys.readouterr()
    assert out == "a line of the script\nanother line\n"
    assert "fzero Net" in err and "1/4" in err and "loss=2.5000" in err


def _csv_config(tmp_path: Path) -> dict:
    return {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}


def test_deepspeeds_names_are_served(tmp_path):
    from fzero import compat

    was = compat.installed()
    compat.install()
    try:
        import deepspeed.comm as dist
        from deepspeed.monitor.monitor import MonitorMaster, csvMonitor
        from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile

        assert FlopsProfiler is monitoring.FlopsProfiler
        assert get_model_profile is monitoring.get_model_profile
        assert dist.comms_logger is monitoring.comms_logger()
        assert callable(dist.log_summary) and callable(dist.configure)
        config = load_config(_csv_config(tmp_path))
        master = MonitorMaster(config)
        assert master.enabled
        master.write_events([("Train/Samples/custom", 1.5, 8)])
        csvMonitor(config.csv_monitor).write_events([("Train/Samples/custom", 2.5, 16)])
        engine = fzero.shard(
            nn.Linear(2, 2), config={**_csv_config(tmp_path), "steps_per_print": 0}
        )
        engine.monitor.write_events([("Train/Samples/custom", 3.5, 24)])  # DeepSpeed's name
        engine.destroy()
        rows = (tmp_path / "j" / "Train_Samples_custom.csv").read_text().splitlines()
        assert rows == ["step,custom", "8,1.5", "16,2.5", "24,3.5"]
    finally:
        if not was:
            compat.uninstall()


def test_fzero_run_passes_log_all_ranks():
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fzero.cli",
            "run",
            "--log-all-ranks",
            "--dry-run",
            "-n",
            "2",
            "t.py",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.startswith("FZERO_LOG_ALL_RANKS=1 ")


def nvme_case(rank: int, world: int, root: str) -> list[dict]:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1,
        "metrics_file": f"{root}/metrics.jsonl",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": root},
        },
    }
    engine = fzero.shard(Net(), config=config)
    built = engine.nvme.bytes_read, engine.nvme.bytes_written
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(2):
            x, y = global_batch(step, MICRO)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    moved = engine.nvme.bytes_read - built[0], engine.nvme.bytes_written - built[1]
    engine.destroy()
    return [json.loads(line) for line in open(f"{root}/metrics.jsonl")], moved


def test_the_report_has_nvme_rates(tmp_path):
    """The swap file's bytes over each report's wall time: summed back over the reports,
    what the two steps read and wrote (not what building the engine wrote)."""
    records, (read, written) = run_world(nvme_case, 1, str(tmp_path))
    assert read > 0 and written > 0
    for record in records:
        assert record["nvme_read_mb_per_s"] > 0 and record["nvme_write_mb_per_s"] > 0
    for key, moved in (("nvme_read_mb_per_s", read), ("nvme_write_mb_per_s", written)):
        total = sum(r[key] * r["seconds"] for r in records) * 1e6
        assert total == pytest.approx(moved, rel=1e-9), key


def test_the_comms_logger_does_not_keep_an_engine_alive():
    """The process-wide logger holds each engine's `comm_volume` weakly: a dropped
    engine is freed and its model leaves the summary."""
    import gc
    import weakref

    from fzero.monitoring._comms import CommsLogger

    class Engine:
        def comm_volume(self) -> list:
            return []

    logger, engine = CommsLogger(), Engine()
    logger.attach("engine", engine.comm_volume)
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    assert logger._models["engine"]() is None
