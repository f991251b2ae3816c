"""A device's peak FLOP/s, the denominator of MFU (model FLOPs utilisation, PaLM,
Chowdhery et al. 2022, appendix B): NVIDIA's dense tensor-core figures for the parts in
the table, and for anything else (every CPU) the best rate this process measures for a
square matrix product in the run's dtype — the machine's own attainable peak, at the
threads the process has (on a machine its ranks share, each rank's share of it)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

__all__ = ["NVIDIA_PEAKS", "Peak", "measure_matmul_flops", "peak_flops"]


@dataclass(frozen=True)
class Peak:
    """FLOP/s one device can do, and where the figure comes from."""

    flops: float
    source: str


# NVIDIA datasheets, dense (without structured sparsity), per GPU, FLOP/s: bf16/fp16
# tensor cores, tf32 tensor cores, fp32 without them. The most specific name first.
NVIDIA_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    ("H200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 NVL", {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    ("H100 PCIe", {"bf16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM5 (HBM3)
    ("A100", {"bf16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12}),
)


def _kind(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    """The peak FLOP/s of `device` for matrix products in `dtype`: the table's for the
    NVIDIA parts it names (fp32 as tf32 when `torch.backends.cuda.matmul.allow_tf32`),
    else measured (`measure_matmul_flops`, once per process and setting)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, figures in NVIDIA_PEAKS:
            if part in name:
                kind = _kind(dtype)
                return Peak(figures[kind], f"{name}, {kind} dense (datasheet)")
    flops, size = measure_matmul_flops(device.type, dtype, torch.get_num_threads())
    return Peak(flops, f"measured: {size}x{size} {dtype} matmul on {device.type}")


_ENOUGH_S = 0.05  # a product this long is timed well; larger ones cost time for nothing
_LARGEST = 2048


@functools.cache
def measure_matmul_flops(device_type: str, dtype: torch.dtype, threads: int) -> tuple[float, int]:
    """(FLOP/s, n): the best of three products of two n-square matrices, 2 n^3 FLOPs
    each, on `device_type` with the process's `threads` (a cache key: a change of
    threads measures again), n doubling from 128 until one product takes 50 ms (or n is
    2048) — about a second where the kernels are fast, and no minutes where they
    are slow (bf16 on a CPU without bf16 instructions)."""
    device = torch.device(device_type)
    size = 128
    while _best_of(device, dtype, size, 1) < _ENOUGH_S and size < _LARGEST:
        size *= 2
    return 2 * size**3 / _best_of(device, dtype, size, 3), size


def _best_of(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    torch.mm(a, b)  # warm: first-use costs are not the device's rate
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return best
