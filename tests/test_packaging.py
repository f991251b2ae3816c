"""A built wheel carries what runs from it: the CUDA source and the header it shares with
the C kernels sit beside `fzero/native/_cuda.py`, which finds and compiles them there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_built_wheel_ships_and_compiles_the_cuda_source(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
         str(ROOT)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("fzero-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert {"fzero/native/fzero_kernels.cu", "fzero/native/fzero_common.h"} <= names
        archive.extractall(tmp_path / "installed")
    # the wheel's own _cuda module (standard library only at import), not the checkout's
    path = tmp_path / "installed" / "fzero" / "native" / "_cuda.py"
    spec = importlib.util.spec_from_file_location("wheel_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert Path(module.SOURCE_PATH) == path.parent / "fzero_kernels.cu"
    try:
        module.nvrtc()
    except OSError as error:
        pytest.skip(f"NVRTC cannot be loaded ({error}); pip install nvidia-cuda-nvrtc")
    assert ".entry fz_adam(" in module.compile_source("sm_90").decode()
