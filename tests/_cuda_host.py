"""fzero's CUDA kernels (`native_src/fzero_kernels.cu`) compiled for the host by g++,
run as one thread of one block, so the arithmetic of every elementwise kernel can be
checked against the pure twins on a machine without a GPU (`tests/test_native.py`
runs its twin tests through it). `HostKernels.run` stands in for `fzero.native._run`:
it receives the (C type, value) argument list the CUDA launch would get, checks the
types against the kernel's prototype in the source, and calls the host build.

What this cannot check (thread cooperation in the two-pass sum of squares, the device's
own fmaf/sqrt/division, launches) is what `benchmarks/gpu_check.py` checks on a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from fzero.native import _cuda

PRELUDE = r"""
#include <math.h>
#include <string.h>
#include <cmath>
using std::isfinite;
struct fz_dim3 { unsigned int x, y, z; };
static fz_dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static const fz_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline void __syncthreads() {}
extern "C" void fz_host_block_y(unsigned int y) { blockIdx.y = y; }
"""
# the host build runs these; the reductions need a block of threads (gpu_check.py)
ELEMENTWISE = (
    "fz_adam", "fz_lamb_direction", "fz_lamb_apply", "fz_sgd", "fz_adagrad", "fz_lion",
    "fz_bf16_stochastic",
    "fz_dequantize_int8", "fz_dequantize_mean_int8", "fz_dequantize_mean_int4",
)  # fmt: skip
_CTYPES = {
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
}
_TYPE_NAMES = {
    "fz_i64": "int64_t",
    "fz_i8": "int8_t",
    "fz_u8": "uint8_t",
    "fz_u64": "uint64_t",
    "fz_u16": "uint16_t",
    "fz_u32": "uint32_t",
}


def prototypes(text: str) -> dict[str, list[str]]:
    """Each extern "C" kernel's parameter types, normalised as fzero.native writes them
    ("float *", "int64_t", ...; const and __restrict__ dropped)."""
    found = {}
    pattern = r'extern "C" __global__ void (\w+)\(([^)]*)\)'
    for name, params in re.findall(pattern, text):
        kinds = []
        for param in params.split(","):
            words = param.replace("*", " * ").replace("const", " ").replace("__restrict__", " ")
            *kind, _ = words.split()
            base = " ".join(_TYPE_NAMES.get(w, w) for w in kind if w != "*")
            kinds.append(base + " *" * kind.count("*"))
        found[name] = kinds
    return found


class HostKernels:
    """The host build of the CUDA source and a stand-in for `fzero.native._run`."""

    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        self.prototypes = prototypes(_cuda.source())

    def run(self, name: str, device: Any, args: list[tuple[str, Any]], elements: int = 0) -> None:
        segments = 1
        if name == "fz_lamb_apply":  # the C kernel's segment count is the CUDA grid's y
            segments = args[5][1]
            args = args[:5] + args[6:]
        kinds = [kind for kind, _ in args]
        if kinds != self.prototypes[name]:
            raise TypeError(f"{name}: fzero.native passes {kinds}; the kernel takes "
                            f"{self.prototypes[name]}")  # fmt: skip
        function = getattr(self.lib, name)
        function.argtypes = [
            ctypes.c_void_p if kind.endswith("*") else _CTYPES[kind] for kind in kinds
        ]
        values = [
            (value.data_ptr() if value is not None else None) if kind.endswith("*") else value
            for kind, value in args
        ]
        for y in range(segments):
            self.lib.fz_host_block_y(y)
            function(*values)


@functools.cache
def host_kernels() -> HostKernels:
    """Compile the CUDA source for the host once per test session."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) to build the CUDA source for the host")
    directory = tempfile.mkdtemp(prefix="fzero-cuda-host-")
    prelude = os.path.join(directory, "prelude.h")
    with open(prelude, "w") as f:
        f.write(PRELUDE)
    library = os.path.join(directory, "libfzero_cuda_host.so")
    subprocess.run(
        [compiler, "-std=c++17", "-O2", "-ffp-contract=off", "-fno-math-errno", "-fPIC",
         "-shared", "-include", prelude, "-I", os.path.dirname(_cuda.SOURCE_PATH), "-x", "c++",
         _cuda.SOURCE_PATH, "-o", library],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return HostKernels(library)
