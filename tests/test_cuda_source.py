"""The CUDA kernels without a GPU: NVRTC compiles every one to PTX for sm_80 and sm_90
(so a syntax or type error in the .cu fails CI), the device selection says why CUDA
tensors take the torch path, and a launch packs its arguments as the kernel's
prototype says. Their arithmetic is checked against the pure twins in test_native.py
(the source built for the host); on a GPU, `benchmarks/gpu_check.py` runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fzero import native
from fzero.native import _cuda
from tests._cuda_host import prototypes


def _nvrtc_or_skip():
    try:
        return _cuda.nvrtc()
    except OSError as error:  # the dev extra installs it; say so if it is missing
        pytest.skip(f"NVRTC cannot be loaded ({error}); pip install nvidia-cuda-nvrtc")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_to_ptx(arch):
    _nvrtc_or_skip()
    ptx = _cuda.compile_source(arch).decode()
    assert f".target {arch}" in ptx
    entries = {name for name in _cuda.KERNELS if f".entry {name}(" in ptx}
    assert entries == set(_cuda.KERNELS)
    assert set(prototypes(_cuda.source())) == set(_cuda.KERNELS)
    # --fmad=false: the only fused multiply-adds are the source's fmaf calls; IEEE
    # division and square root
    adam = ptx.split(".entry fz_adam(")[1].split(".entry")[0]
    assert "mad." not in adam and "div.rn.f32" in adam and "sqrt.rn.f32" in adam
    assert "div.approx" not in ptx and "sqrt.approx" not in ptx


def test_a_compile_error_names_the_source_and_prints_the_log():
    _nvrtc_or_skip()
    broken = _cuda.source().replace("fz_i64 n, float grad_scale", "fz_i64 n float grad_scale", 1)
    with pytest.raises(
        _cuda.CudaError,
        match=r"(?s)could not compile .*fzero_kernels.cu for compute_90:.*error: expected",
    ):
        _cuda.compile_source("sm_90", text=broken)
    with pytest.raises(ValueError, match="output 'elf' is not allowed"):
        _cuda.compile_source("sm_90", "elf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_cuda_tensors_take_the_torch_path_and_why_says_so():
    assert not native.available("cuda") and native.why("cuda") == "no CUDA device"
    assert native.available("cpu") == native.available()
    assert native.why("meta") == "no native kernels for meta tensors"
    code = "import fzero.native as n; print(n.available('cuda'), n.why('cuda'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "FZERO_NATIVE": "0"}, check=True)  # fmt: skip
    assert run.stdout.split() == ["False", "FZERO_NATIVE=0"]


class _Launches:
    """The driver's cuLaunchKernel, recording what it was given (parameters read during
    the call, as the driver copies them)."""

    def __init__(self, ffi, kinds):
        self.ffi, self.kinds, self.calls = ffi, kinds, []

    def cuCtxGetCurrent(self, out):
        out[0] = self.ffi.NULL  # another thread's: launch makes the device's current
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(("current", int(self.ffi.cast("uintptr_t", context))))
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        values = [self.ffi.cast(f"{k} *", params[i])[0] for i, k in enumerate(self.kinds)]
        self.calls.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values))
        return 0


def test_a_launch_passes_each_argument_as_its_c_type(monkeypatch):
    """CUDA mocked away at the driver: what `launch` hands cuLaunchKernel (grid, block,
    stream, each parameter's bytes) is what the kernel's prototype reads."""
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(_cuda._DRIVER_CDEF)
    args = [("float *", 0x1000), ("uint16_t *", 0x2000), ("int64_t", 2**40 + 3),
            ("uint64_t", 2**64 - 1)]  # fmt: skip
    launches = _Launches(ffi, [kind for kind, _ in args])
    driver = type("Driver", (), {"ffi": ffi, "lib": launches, "check": lambda *a: None})()
    monkeypatch.setitem(_cuda._state, "driver", driver)
    module = {
        "fz_bf16_stochastic": ffi.cast("CUfunction", 77),
        "_context": ffi.cast("CUcontext", 9),
    }
    monkeypatch.setitem(_cuda._state, 5, module)
    assert [k for k, _ in args] == prototypes(_cuda.source())["fz_bf16_stochastic"]
    _cuda.launch("fz_bf16_stochastic", 5, 1234, (7, 1), args)
    assert launches.calls[0] == ("current", 9)
    (function, grid, block, shared, stream, read) = launches.calls[1]
    assert int(ffi.cast("uintptr_t", function)) == 77 and grid == (7, 1, 1)
    assert block == (_cuda.THREADS, 1, 1) and shared == 0
    assert int(ffi.cast("uintptr_t", stream)) == 1234
    assert [int(ffi.cast("uintptr_t", v)) for v in read[:2]] == [0x1000, 0x2000]
    assert read[2:] == [2**40 + 3, 2**64 - 1]
