"""Native kernels bound through cffi: C for the CPU (OpenMP, SIMD by runtime dispatch),
CUDA for GPUs.

The C kernels are built from `native_src/` during `pip install`; the CUDA kernels
(`native_src/fzero_kernels.cu`) are compiled by NVRTC at first use (`fzero.native._cuda`).
Each wrapper picks the kernel by its tensors' device. `available(device)` says whether
that device's kernels loaded (`why(device)` says why not); `FZERO_NATIVE=0` turns all of
them off. Every kernel has a pure-torch twin in `fzero.optim` that it matches (see
tests/test_native.py and tests/test_cuda_source.py), so switching them off changes
speed, not results. Each wrapper checks its arguments (dtype, device, contiguity,
sizes, aliasing) before the call: a bad one is a `ValueError` naming it. A kernel's
arguments are written once, as (C type, value) pairs in its prototype's order, and
passed to whichever device runs it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fzero.native import _cuda

__all__ = [
    "adagrad_",
    "adam_",
    "available",
    "bf16_stochastic_",
    "dequantize_int8_",
    "dequantize_mean_int4_",
    "dequantize_mean_int8_",
    "lamb_apply_",
    "lamb_direction_",
    "lion_",
    "quantize_int4_",
    "quantize_int8_",
    "segment_sq_sums",
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

Args = list[tuple[str, Any]]  # (C type, value) per kernel argument; pointers as tensors


def _device_type(device: torch.device | str | None) -> str:
    return "cpu" if device is None else torch.device(device).type


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels for `device` (default: the CPU's) loaded and are not switched
    off. The CUDA kernels are checked (NVRTC, driver, a compile) at the first call."""
    kind = _device_type(device)
    if kind == "cuda":
        return _cuda.available()
    return kind == "cpu" and _lib is not None


def why(device: torch.device | str | None = None) -> str:
    """'loaded', or why `device`'s tensors take the torch path."""
    kind = _device_type(device)
    if kind == "cuda":
        return _cuda.why()
    return _WHY if kind == "cpu" else f"no native kernels for {kind} tensors"


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _buffer(
    name: str,
    tensor: Tensor,
    numel: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, found {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}; the other buffers are on {device}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {tensor.device}; native kernels take CPU or CUDA tensors")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tensor.stride()})")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel}")
    return tensor


def _buffers(numel: int, **tensors: Tensor) -> torch.device:
    """Check `tensors` (fp32, contiguous, `numel` elements, one device); their device."""
    first = next(iter(tensors.values()))
    device = first.device if isinstance(first, Tensor) else None
    for name, tensor in tensors.items():
        _buffer(name, tensor, numel, device=device)
    assert device is not None
    return device


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


def _out(out: Tensor | None, numel: int, device: torch.device) -> tuple[Tensor | None, int]:
    if out is None:
        return None, 0
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out has dtype {out.dtype}; allowed: torch.bfloat16, torch.float16")
    return _buffer("out", out, numel, out.dtype, device), _OUT_KINDS[out.dtype]


def _require(device: torch.device) -> None:
    if not available(device):
        raise RuntimeError(f"fzero native kernels for {device.type}: {why(device)}")


def _pointer(value: Tensor | None) -> int:
    return 0 if value is None else value.data_ptr()


def _blocks(elements: int, cap: int) -> int:
    """Blocks of `_cuda.THREADS` covering `elements` (at least one), at most `cap`."""
    return max(1, min(-(-elements // _cuda.THREADS), cap))


def _launch(name: str, device: torch.device, grid: tuple[int, int], args: Args) -> None:
    """CUDA kernel `name` on `device`'s current stream; tensors in `args` as pointers."""
    values = [(kind, _pointer(v) if kind.endswith("*") else v) for kind, v in args]
    stream = torch.cuda.current_stream(device).cuda_stream
    _cuda.launch(name, device.index or 0, stream, grid, values)


def _run(name: str, device: torch.device, args: Args, elements: int = 0) -> None:
    """Kernel `name` with `args` on `device`: the C kernel (with the thread count
    appended), or the CUDA kernel over `elements` (grid-stride)."""
    if device.type == "cuda":
        if elements:
            _launch(name, device, (_blocks(elements, _cuda.MAX_BLOCKS), 1), args)
        return
    values = [_ffi.cast(kind, _pointer(v)) if kind.endswith("*") else v for kind, v in args]
    getattr(_lib, name)(*values, _threads())


def _segments(
    segments: Sequence[tuple[int, int]], numel: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Checked segment bounds as int64 tensors (starts, stops) on `device`."""
    for a, b in segments:
        if not 0 <= a <= b <= numel:
            raise ValueError(f"segment ({a}, {b}) is outside [0, {numel}]")
    if device.type == "cuda" and len(segments) > _cuda.MAX_BLOCKS_Y:  # blockIdx.y: segment
        raise ValueError(
            f"{len(segments)} segments; a CUDA launch takes at most {_cuda.MAX_BLOCKS_Y}"
        )
    starts = torch.tensor([a for a, _ in segments], dtype=torch.int64, device=device)
    stops = torch.tensor([b for _, b in segments], dtype=torch.int64, device=device)
    return starts, stops


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
    n = param.numel()
    device = _buffers(n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _require(device)
    out, out_kind = _out(out, n, device)
    _no_alias(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, out=out)
    beta1, beta2 = betas
    if bias_correction:
        step_size, c2sqrt = lr / (1 - beta1**step), math.sqrt(1 - beta2**step)
    else:
        step_size, c2sqrt = lr, 1.0
    args = [
        ("float *", param), ("float *", grad), ("float *", exp_avg), ("float *", exp_avg_sq),
        ("int64_t", n), ("float", _f32(grad_scale)),
        ("int", int(bool(decoupled and weight_decay))), ("float", _f32(1 - lr * weight_decay)),
        ("float", _f32(0.0 if decoupled else weight_decay)), ("float", _f32(1 - beta1)),
        ("float", _f32(beta2)), ("float", _f32(1 - beta2)), ("float", _f32(c2sqrt)),
        ("float", _f32(eps)), ("float", _f32(-step_size)), ("void *", out), ("int", out_kind),
    ]  # fmt: skip
    _run("fz_adam", device, args, n)


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
    n = param.numel()
    device = _buffers(
        n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, update=update
    )
    _require(device)
    _no_alias(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, update=update)
    beta1, beta2 = betas
    c1, c2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    args = [
        ("float *", param), ("float *", grad), ("float *", exp_avg), ("float *", exp_avg_sq),
        ("float *", update), ("int64_t", n), ("float", _f32(grad_scale)),
        ("float", _f32(beta1)), ("float", _f32(1 - beta1)), ("float", _f32(beta2)),
        ("float", _f32(1 - beta2)), ("float", _f32(c1)), ("float", _f32(c2)),
        ("float", _f32(eps)), ("float", _f32(weight_decay)),
    ]  # fmt: skip
    _run("fz_lamb_direction", device, args, n)


def lamb_apply_(
    param: Tensor,
    update: Tensor,
    segments: Sequence[tuple[int, int]],
    scales: Sequence[float],
    out: Tensor | None = None,
) -> None:
    """`param[a:b] += scale * update[a:b]` per segment (scale = -lr x trust ratio)."""
    n = param.numel()
    device = _buffers(n, param=param, update=update)
    _require(device)
    out, out_kind = _out(out, n, device)
    _no_alias(param=param, update=update, out=out)
    if len(segments) != len(scales):
        raise ValueError(f"segments has {len(segments)} entries, scales {len(scales)}")
    starts, stops = _segments(segments, n, device)
    if not segments:
        return
    values = torch.tensor(list(scales), dtype=torch.float32, device=device)
    pointers = [
        ("float *", param), ("float *", update), ("int64_t *", starts), ("int64_t *", stops),
        ("float *", values),
    ]  # fmt: skip
    if device.type == "cuda":  # one launch: blockIdx.y is the segment
        blocks = _blocks(max(b - a for a, b in segments), _cuda.MAX_BLOCKS)
        grid = (blocks, len(segments))
        _launch("fz_lamb_apply", device, grid, [*pointers, ("void *", out), ("int", out_kind)])
        return
    segment_count = ("int64_t", len(segments))
    _run("fz_lamb_apply", device, [*pointers, segment_count, ("void *", out), ("int", out_kind)])


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
    n = param.numel()
    device = _buffers(n, param=param, grad=grad, momentum_buffer=momentum_buffer)
    _require(device)
    out, out_kind = _out(out, n, device)
    _no_alias(param=param, grad=grad, momentum_buffer=momentum_buffer, out=out)
    args = [
        ("float *", param), ("float *", grad), ("float *", momentum_buffer), ("int64_t", n),
        ("float", _f32(grad_scale)), ("float", _f32(weight_decay)), ("float", _f32(momentum)),
        ("float", _f32(1 - dampening)), ("int", int(first)), ("int", int(nesterov)),
        ("float", _f32(-lr)), ("void *", out), ("int", out_kind),
    ]  # fmt: skip
    _run("fz_sgd", device, args, n)


def adagrad_(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
) -> None:
    """One Adagrad step in place at step size `lr` (torch's `clr`: lr / (1 + (step - 1)
    x lr_decay)), as `fzero.optim.adagrad_update_`; gradients times `grad_scale` first;
    `out` (bf16/fp16) gets the updated params."""
    n = param.numel()
    device = _buffers(n, param=param, grad=grad, state_sum=state_sum)
    _require(device)
    out, out_kind = _out(out, n, device)
    _no_alias(param=param, grad=grad, state_sum=state_sum, out=out)
    args = [
        ("float *", param), ("float *", grad), ("float *", state_sum), ("int64_t", n),
        ("float", _f32(grad_scale)), ("float", _f32(weight_decay)), ("float", _f32(-lr)),
        ("float", _f32(eps)), ("void *", out), ("int", out_kind),
    ]  # fmt: skip
    _run("fz_adagrad", device, args, n)


def lion_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
) -> None:
    """One Lion step in place, as `fzero.optim.lion_update_`; gradients times
    `grad_scale` first; `out` (bf16/fp16) gets the updated params."""
    n = param.numel()
    device = _buffers(n, param=param, grad=grad, exp_avg=exp_avg)
    _require(device)
    out, out_kind = _out(out, n, device)
    _no_alias(param=param, grad=grad, exp_avg=exp_avg, out=out)
    beta1, beta2 = betas
    args = [
        ("float *", param), ("float *", grad), ("float *", exp_avg), ("int64_t", n),
        ("float", _f32(grad_scale)), ("float", _f32(beta1)), ("float", _f32(1 - beta1)),
        ("float", _f32(beta2)), ("float", _f32(1 - beta2)), ("int", int(weight_decay != 0)),
        ("float", _f32(1 - lr * weight_decay)), ("float", _f32(-lr)), ("void *", out),
        ("int", out_kind),
    ]  # fmt: skip
    _run("fz_lion", device, args, n)


def sq_sum(grad: Tensor) -> tuple[float, bool]:
    """(sum of squares in float64, any inf/NaN) of `grad`, in one pass (CUDA: a
    deterministic two-pass reduction, then one synchronising read)."""
    device = _buffers(grad.numel(), grad=grad)
    _require(device)
    n = grad.numel()
    if device.type == "cuda":
        blocks = _blocks(n, _cuda.REDUCE_BLOCKS)
        partials = torch.zeros(blocks, dtype=torch.float64, device=device)
        flags = torch.zeros(blocks, dtype=torch.int32, device=device)
        _launch(
            "fz_sq_sum_partial",
            device,
            (blocks, 1),
            [("float *", grad), ("int64_t", n), ("double *", partials), ("int *", flags)],
        )
        _launch("fz_sq_sum_final", device, (1, 1),
                [("double *", partials), ("int *", flags), ("int", blocks)])  # fmt: skip
        return float(partials[0].item()), bool(flags[0].item())
    total = torch.zeros(1, dtype=torch.float64)
    bad = torch.zeros(1, dtype=torch.int32)
    _run("fz_sq_sum", device, [("float *", grad), ("int64_t", n), ("double *", total),
                               ("int *", bad)])  # fmt: skip
    return float(total[0]), bool(bad[0])


def segment_sq_sums(values: Tensor, segments: Sequence[tuple[int, int]]) -> Tensor:
    """Sum of squares (float64, on `values`' device) of `values[a:b]` for each segment, as
    `fzero.optim.segment_sq_sums` (LAMB's per-tensor norms); one pass, deterministic."""
    device = _buffers(values.numel(), values=values)
    _require(device)
    starts, stops = _segments(segments, values.numel(), device)
    out = torch.zeros(len(segments), dtype=torch.float64, device=device)
    if not segments:
        return out
    bounds = [("float *", values), ("int64_t *", starts), ("int64_t *", stops)]
    if device.type == "cuda":
        blocks = _blocks(max(b - a for a, b in segments), _cuda.SEGMENT_BLOCKS)
        partials = torch.empty(len(segments) * blocks, dtype=torch.float64, device=device)
        _launch(
            "fz_segment_sq_partial",
            device,
            (blocks, len(segments)),
            [*bounds, ("double *", partials)],
        )
        _launch("fz_segment_sq_final", device, (1, len(segments)),
                [("double *", partials), ("int", blocks), ("double *", out)])  # fmt: skip
        return out
    _run("fz_segment_sq_sums", device,
         [*bounds, ("int64_t", len(segments)), ("double *", out)])  # fmt: skip
    return out


def stream_floor_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
    """Touch the 28 bytes per element any Adam step must move, with minimal arithmetic
    (the memory floor `benchmarks/cpu_adam.py` compares against)."""
    n = param.numel()
    device = _buffers(n, param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _require(device)
    args = [
        ("float *", param), ("float *", grad), ("float *", exp_avg), ("float *", exp_avg_sq),
        ("int64_t", n),
    ]  # fmt: skip
    _run("fz_stream_floor", device, args, n)


def bf16_stochastic_(x: Tensor, out: Tensor, seed: int) -> Tensor:
    """`x` (fp32) rounded to bf16 stochastically into `out`, the random bits drawn from
    `seed` and each element's index (`fzero.optim.bf16_stochastic`'s bits, one pass)."""
    n = x.numel()
    device = _buffers(n, x=x)
    _require(device)
    _buffer("out", out, n, torch.bfloat16, device)
    _no_alias(x=x, out=out)
    args = [("float *", x), ("uint16_t *", out), ("int64_t", n), ("uint64_t", seed % 2**64)]
    _run("fz_bf16_stochastic", device, args, n)
    return out


QBLOCK = 256  # elements per scale of the int8 and int4 kernels (FZ_QBLOCK)
_DEQUANT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def quantize_int8_(x: Tensor, codes: Tensor, scales: Tensor) -> None:
    """Blockwise int8 of fp32 `x` into `codes` (int8, whole blocks of 256, the padding 0)
    and `scales` (fp32, one per block), as `fzero.core.quantize.quantize`."""
    n = x.numel()
    device = _buffers(n, x=x)
    _require(device)
    blocks = -(-n // QBLOCK)
    _buffer("codes", codes, blocks * QBLOCK, torch.int8, device)
    _buffer("scales", scales, blocks, torch.float32, device)
    args = [("float *", x), ("int64_t", n), ("int8_t *", codes), ("float *", scales)]
    _run("fz_quantize_int8", device, args, n)


def quantize_int4_(x: Tensor, codes: Tensor, scales: Tensor) -> None:
    """Blockwise int4 of fp32 `x` into `codes` (uint8, two codes a byte, whole blocks of
    256, the padding 0) and `scales` (fp32, one per block), as
    `fzero.core.quantize.quantize` with bits=4."""
    n = x.numel()
    device = _buffers(n, x=x)
    _require(device)
    blocks = -(-n // QBLOCK)
    _buffer("codes", codes, blocks * QBLOCK // 2, torch.uint8, device)
    _buffer("scales", scales, blocks, torch.float32, device)
    args = [("float *", x), ("int64_t", n), ("uint8_t *", codes), ("float *", scales)]
    _run("fz_quantize_int4", device, args, n)


def _dequant_args(
    codes: Tensor, scales: Tensor, n: int, parts: int, bits: int = 8
) -> tuple[torch.device, Args]:
    """Checked arguments of a dequantize kernel: codes (int8, or uint8 with two int4
    codes a byte), scales, n, parts and the row stride in elements."""
    device = codes.device
    per_byte = 8 // bits
    elements = codes.numel() * per_byte
    if parts < 1 or elements % parts or (elements // parts) % QBLOCK:
        raise ValueError(
            f"codes has {codes.numel()} bytes; expected {parts} rows of whole {QBLOCK}-blocks "
            f"of int{bits} codes"
        )
    stride = elements // parts
    if n > stride:
        raise ValueError(f"n is {n}; a row of codes holds {stride}")
    kind = torch.int8 if bits == 8 else torch.uint8
    _buffer("codes", codes, codes.numel(), kind, device)
    _buffer("scales", scales, elements // QBLOCK, torch.float32, device)
    _require(device)
    pointer = "int8_t *" if bits == 8 else "uint8_t *"
    args: Args = [(pointer, codes), ("float *", scales), ("int64_t", n), ("int64_t", parts)]
    return device, [*args, ("int64_t", stride)]


def dequantize_int8_(codes: Tensor, scales: Tensor, out: Tensor, parts: int) -> None:
    """`parts` rows of int8 `codes` back into `out` (`parts` x n, fp32, bf16 or fp16,
    rounded to nearest), as `fzero.core.quantize.dequantize_` row by row."""
    if out.dtype not in _DEQUANT_KINDS:
        raise ValueError(f"out has dtype {out.dtype}; allowed: {list(_DEQUANT_KINDS)}")
    n = out.numel() // parts
    device, args = _dequant_args(codes, scales, n, parts)
    _buffer("out", out, parts * n, out.dtype, device)
    _run(
        "fz_dequantize_int8",
        device,
        [*args, ("void *", out), ("int", _DEQUANT_KINDS[out.dtype])],
        parts * n,
    )


def dequantize_mean_int8_(codes: Tensor, scales: Tensor, out: Tensor, parts: int) -> None:
    """The mean over `parts` rows of int8 `codes`, summed in row order in fp32, into
    fp32 `out` (qgZ's owner side), as `fzero.core.quantize.dequantize_mean_`."""
    n = out.numel()
    device, args = _dequant_args(codes, scales, n, parts)
    _buffer("out", out, n, torch.float32, device)
    _run("fz_dequantize_mean_int8", device, [*args, ("float *", out)], n)


def dequantize_mean_int4_(codes: Tensor, scales: Tensor, out: Tensor, parts: int) -> None:
    """The mean over `parts` rows of packed int4 `codes` (uint8, two a byte), summed in
    row order in fp32, into fp32 `out` (qgZ with 4 bits), as
    `fzero.core.quantize.dequantize_mean_` with bits=4."""
    n = out.numel()
    device, args = _dequant_args(codes, scales, n, parts, bits=4)
    _buffer("out", out, n, torch.float32, device)
    _run("fz_dequantize_mean_int4", device, [*args, ("float *", out)], n)
