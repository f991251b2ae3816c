"""Native CPU kernels (C, OpenMP, SIMD by runtime dispatch) bound through cffi.

Built from `native_src/` during `pip install`. `available()` says whether they loaded
(`why()` says why not, logged once); `FZERO_NATIVE=0` turns them off. Every kernel
has a pure-torch twin in `fzero.optim` that it matches (see tests/test_native.py), so
switching them off changes speed, not results. Each wrapper checks its arguments
(dtype, device, contiguity, sizes, aliasing) before the call: a bad one is a
`ValueError` naming it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "adam_",
    "available",
    "bf16_stochastic_",
    "lamb_apply_",
    "lamb_direction_",
    "sgd_",
    "sq_sum",
    "stream_floor_",
    "why",
]

log = logging.getLogger("fzero")

_OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2}

try:
    if os.environ.get("FZERO_NATIVE", "1") == "0":
        raise ImportError("FZERO_NATIVE=0")
    from fzero.native import _kernels

    _lib, _ffi = _kernels.lib, _kernels.ffi
    _WHY = "loaded"
except ImportError as error:  # no compiler at install time, or switched off
    _lib = _ffi = None
    _WHY = f"native kernels unavailable ({error}); using the torch path"
    log.info("fzero: %s", _WHY)


def available() -> bool:
    """Whether the compiled kernels loaded (and are not switched off)."""
    return _lib is not None


def why() -> str:
    """'loaded', or why the torch path is used."""
    return _WHY


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _buffer(name: str, tensor: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, found {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; native kernels take CPU tensors")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tensor.stride()})")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")
    return tensor


def _buffers(numel: int, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        _buffer(name, tensor, numel)


def _no_alias(**tensors: Tensor | None) -> None:
    spans = []
    for name, t in tensors.items():
        if t is not None and t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{first} and {second} overlap in memory; they must be distinct")


def _ptr(tensor: Tensor | None, kind: str = "float *"):
    if tensor is None:
        return _ffi.NULL
    return _ffi.cast(kind, tensor.data_ptr())


def _out(out: Tensor | None, numel: int) -> tuple[Tensor | None, int]:
    if out is None:
        return None, 0
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out has dtype {out.dtype}; allowed: torch.bfloat16, torch.float16")
    return _buffer("out", out, numel, out.dtype), _OUT_KINDS[out.dtype]


def _require() -> None:
    if _lib is None:
        raise RuntimeError(f"fzero native kernels: {_WHY}")


def _f32(value: float) -> float:
    """A Python float rounded to fp32, as torch rounds a scalar for a float32 op."""
    return float(torch.tensor(value, dtype=torch.float32))


def adam_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
) -> None:
    """One Adam(W) step in place (`step` is 1-based), as `fzero.optim.adam_update_`;
    gradients times `grad_scale` first; `out` (bf16/fp16) gets the updated params."""
    _require()
    n = param.numel()
    _buffers(n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    out, out_kind = _out(out, n)
    _no_alias(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, out=out)
    beta1, beta2 = betas
    if bias_correction:
        step_size, c2sqrt = lr / (1 - beta1**step), math.sqrt(1 - beta2**step)
    else:
        step_size, c2sqrt = lr, 1.0
    _lib.fz_adam(
        _ptr(param), _ptr(grad), _ptr(exp_avg), _ptr(exp_avg_sq), n, _f32(grad_scale),
        int(bool(decoupled and weight_decay)), _f32(1 - lr * weight_decay),
        _f32(0.0 if decoupled else weight_decay), _f32(1 - beta1), _f32(beta2),
        _f32(1 - beta2), _f32(c2sqrt), _f32(eps), _f32(-step_size), _ptr(out, "void *"),
        out_kind, _threads(),
    )  # fmt: skip


def lamb_direction_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    update: Tensor,
    *,
    step: int,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> None:
    """LAMB's moments in place and its direction into `update`, as `lamb_direction_`."""
    _require()
    n = param.numel()
    _buffers(n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, update=update)
    _no_alias(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, update=update)
    beta1, beta2 = betas
    c1, c2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    _lib.fz_lamb_direction(
        _ptr(param), _ptr(grad), _ptr(exp_avg), _ptr(exp_avg_sq), _ptr(update), n,
        _f32(grad_scale), _f32(beta1), _f32(1 - beta1), _f32(beta2), _f32(1 - beta2),
        _f32(c1), _f32(c2), _f32(eps), _f32(weight_decay), _threads(),
    )  # fmt: skip


def lamb_apply_(
    param: Tensor,
    update: Tensor,
    segments: Sequence[tuple[int, int]],
    scales: Sequence[float],
    out: Tensor | None = None,
) -> None:
    """`param[a:b] += scale * update[a:b]` per segment (scale = -lr x trust ratio)."""
    _require()
    n = param.numel()
    _buffer("param", param, n)
    _buffer("update", update, n)
    out, out_kind = _out(out, n)
    _no_alias(param=param, update=update, out=out)
    if len(segments) != len(scales):
        raise ValueError(f"segments has {len(segments)} entries, scales {len(scales)}")
    for a, b in segments:
        if not 0 <= a <= b <= n:
            raise ValueError(f"segment ({a}, {b}) is outside [0, {n}]")
    starts = torch.tensor([a for a, _ in segments], dtype=torch.int64)
    stops = torch.tensor([b for _, b in segments], dtype=torch.int64)
    values = torch.tensor(list(scales), dtype=torch.float32)
    _lib.fz_lamb_apply(
        _ptr(param), _ptr(update), _ptr(starts, "int64_t *"), _ptr(stops, "int64_t *"),
        _ptr(values), len(segments), _ptr(out, "void *"), out_kind, _threads(),
    )  # fmt: skip


def sgd_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    first: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
) -> None:
    """One SGD step in place, as `fzero.optim.sgd_update_` (`first`: the first step)."""
    _require()
    n = param.numel()
    _buffers(n, param=param, grad=grad, momentum_buffer=momentum_buffer)
    out, out_kind = _out(out, n)
    _no_alias(param=param, grad=grad, momentum_buffer=momentum_buffer, out=out)
    _lib.fz_sgd(
        _ptr(param), _ptr(grad), _ptr(momentum_buffer), n, _f32(grad_scale), _f32(weight_decay),
        _f32(momentum), _f32(1 - dampening), int(first), int(nesterov), _f32(-lr),
        _ptr(out, "void *"), out_kind, _threads(),
    )  # fmt: skip


def sq_sum(grad: Tensor) -> tuple[float, bool]:
    """(sum of squares in float64, any inf/NaN) of `grad`, in one pass."""
    _require()
    _buffer("grad", grad, grad.numel())
    total = _ffi.new("double *")
    bad = _ffi.new("int *")
    _lib.fz_sq_sum(_ptr(grad), grad.numel(), total, bad, _threads())
    return float(total[0]), bool(bad[0])


def stream_floor_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
    """Touch the 28 bytes per element any Adam step must move, with minimal arithmetic
    (the memory floor `benchmarks/cpu_adam.py` compares against)."""
    _require()
    n = param.numel()
    _buffers(n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _lib.fz_stream_floor(_ptr(param), _ptr(grad), _ptr(exp_avg), _ptr(exp_avg_sq), n, _threads())


def bf16_stochastic_(x: Tensor, out: Tensor, seed: int) -> Tensor:
    """`x` (fp32) rounded to bf16 stochastically into `out`, the random bits drawn from
    `seed` and each element's index (`fzero.optim.bf16_stochastic`'s bits, one pass)."""
    _require()
    n = x.numel()
    _buffer("x", x, n)
    _buffer("out", out, n, torch.bfloat16)
    _no_alias(x=x, out=out)
    _lib.fz_bf16_stochastic(_ptr(x), _ptr(out, "uint16_t *"), n, seed % 2**64, _threads())
    return out
