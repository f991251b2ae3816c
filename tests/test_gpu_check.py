"""`benchmarks/gpu_check.py --smoke`: the device script's checks, tiny, on the CPU, so
the script that runs once on a GPU machine has run before it gets there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke_runs_every_check_on_the_cpu():
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = run.stdout.split("\ncheck ")[1]
    for check in ("adam/adamw vs twin", "copy-out", "sgd", "lamb", "sum of squares",
                  "stochastic", "AdamW over", "plain PyTorch", "stage 3", "cpu offload",
                  "checkpoint cpu -> CPU", "checkpoint CPU -> cpu"):  # fmt: skip
        assert check in table, check
    assert "failed: []" in run.stdout
