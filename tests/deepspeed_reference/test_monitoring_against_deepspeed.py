"""The monitor blocks against DeepSpeed itself: tests/ds_scripts/gpt_monitored.py, a GPT
trained with `tensorboard`, `csv_monitor`, `comms_logger` and `flops_profiler` on, run
on 2 processes under DeepSpeed (torchrun) and under fzero (`fzero run --as-deepspeed`).
Every event DeepSpeed writes, fzero writes under the same name at the same sample
counts, with the same values (to fp32 rounding of two Adam kernels), the script's own
events (a `MonitorMaster` of `DeepSpeedConfig(path).monitor_config`, `engine.monitor`)
too; both print their communication summary and FLOPs profile, at the same step. Run by
`make test-deepspeed`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fzero.monitoring import read_run
from tests.deepspeed_reference.test_against_deepspeed import (
    DEEPSPEED_PYTHON,
    ROOT,
    _launch,
    _port,
    _script_argv,
)

pytestmark = [
    pytest.mark.deepspeed_reference,
    pytest.mark.skipif(not DEEPSPEED_PYTHON, reason="FZERO_DEEPSPEED_PYTHON is not set"),
]

SCRIPT = ROOT / "tests" / "ds_scripts" / "gpt_monitored.py"


def _config(out: Path) -> dict:
    logs = {"output_path": str(out / "logs"), "job_name": "gpt"}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_max_lr": 3e-3},
        },
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "tensorboard": {"enabled": True, **logs},
        "csv_monitor": {"enabled": True, **logs},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False},
    }


def _run(python: str, out: Path, fzero: bool) -> str:
    out.mkdir()
    config = out / "ds_config.json"
    config.write_text(json.dumps(_config(out)))
    port = str(_port())
    launcher = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", port]  # fmt: skip
    if fzero:
        launcher = [python, "-m", "fzero.cli", "run", "--as-deepspeed", "-n", "2",
                    "--master_port", port]  # fmt: skip
    done = _launch(
        python,
        [*launcher, *_script_argv(python, str(SCRIPT)), "--deepspeed_config", str(config),
         "--steps", "6", "--out", str(out / "result.json")],
        cwd=ROOT, timeout=1800,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def test_the_monitors_write_deepspeeds_events(tmp_path):
    theirs_text = _run(DEEPSPEED_PYTHON, tmp_path / "deepspeed", fzero=False)
    ours_text = _run(sys.executable, tmp_path / "fzero", fzero=True)
    theirs = read_run(tmp_path / "deepspeed" / "logs" / "gpt").series  # TensorBoard's files
    ours = read_run(tmp_path / "fzero" / "logs" / "gpt").series
    # DeepSpeed 0.19.8 writes lr (and the timers); its docs' train_loss no longer (fzero does)
    assert "lr" in theirs and "train_loss" in ours
    # the script's own events, through DeepSpeedConfig's MonitorMaster and engine.monitor
    assert "Custom/last_loss" in theirs and "Custom/batch_size" in theirs
    for name, points in theirs.items():
        if name.startswith("elapsed_time_ms"):  # timers: DeepSpeed's own names
            continue
        assert name in ours, name
        assert [x for x, _ in ours[name]] == [x for x, _ in points], name
        values = pytest.approx([y for _, y in points], rel=1e-4, abs=1e-6)
        assert [y for _, y in ours[name]] == values, name
    assert "Comm. Op" in theirs_text and "fzero communication summary" in ours_text
    assert "DeepSpeed Flops Profiler" in theirs_text and "fzero Flops Profiler" in ours_text
    assert "Profile Summary at step 3:" in theirs_text and "Profile Summary at step 3:" in ours_text
