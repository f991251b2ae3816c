"""Quantized collectives (ZeRO++, Wang et al. 2023): qwZ, stage 3's parameter all-gathers,
and qgZ, stages 2-3's gradient reductions, in blockwise int8 (and int4 for gradients).

A shard is cut into blocks of `BLOCK` elements; each block travels as int8 codes
`round(x / s)` with one fp32 scale `s = max|x| / 127` (symmetric, round to nearest:
deterministic), 1.016 bytes per element instead of 2 (bf16) or 4 (fp32). Every rank
dequantizes every part, its own included, so all ranks compute with the same weights.
Only the gathered copies are approximate: masters, the optimizer and the shards at rest
stay exact.

int4 (`bits=4`, gradients only) is the same with `s = max|x| / 7` and codes in [-7, 7],
two to a byte: element 2k of a block in the low nibble of byte k, element 2k + 1 in the
high one, each in two's complement; 0.516 bytes per element. The range is symmetric, as
int8's is: DeepSpeed's int4 clamps to [-8, 7] with `s = 2 max|x| / 16`, so its largest
positive value of a block rounds down to 7/8 of itself; here every value is within half
a step of its block.

qgZ replaces a reduce-scatter: each rank quantizes the part of its gradients every other
rank owns (blocks never straddle two ranks' parts), one all-to-all sends each part to its
owner, which dequantizes the parts it receives and sums them in fp32: each rank moves
about a quarter (int8) or an eighth (int4) of the fp32 bytes, and the rounding error of
each rank's contribution is at most half a step of its block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fzero import comm, native

__all__ = [
    "BITS",
    "BLOCK",
    "code_bytes",
    "dequantize_",
    "dequantize_mean_",
    "quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
]

BLOCK = 256
BITS = (4, 8)  # code widths: int8 (qwZ, qgZ) and int4 (qgZ)
_LIMIT = {8: 127, 4: 7}  # the largest code: symmetric ranges [-limit, limit]


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits is {bits!r}; allowed: {list(BITS)}")


def code_bytes(numel: int, bits: int = 8, block: int = BLOCK) -> int:
    """Bytes of the codes of `numel` elements: whole blocks, `bits` per element."""
    _check_bits(bits)
    return _blocks(numel, block) * block * bits // 8


def quantize(x: Tensor, block: int = BLOCK, *, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Flat `x` as (codes, padded to whole blocks with 0; fp32 scale per block), pure.
    A block's scale is max|x| / limit (127 for int8, 7 for int4; NaN if an element is
    NaN); a code is round(x / scale) half to even (x / 1 in an all-zero block), NaN as 0,
    in [-limit, limit]. int8 codes are an int8 tensor of one code per element; int4
    codes a uint8 tensor of two per byte (see the module docstring).
    `fzero.native.quantize_int8_` and `quantize_int4_` are its twins, bit for bit."""
    _check_bits(bits)
    limit = _LIMIT[bits]
    flat = x.reshape(-1).float()
    blocks = _blocks(flat.numel(), block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, block)
    scales = rows.abs().amax(dim=1) / float(limit)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / divisors[:, None]).nan_to_num_(0.0).clamp_(-limit, limit)
    codes = codes.to(torch.int16).view(-1)
    codes[flat.numel() :] = 0
    if bits == 8:
        return codes.to(torch.int8), scales
    pairs = codes.view(-1, 2)
    return ((pairs[:, 0] & 0xF) | ((pairs[:, 1] & 0xF) << 4)).to(torch.uint8), scales


def _codes(codes: Tensor, bits: int) -> Tensor:
    """One code per element, as int16 (int4's nibbles unpacked and sign-extended)."""
    if bits == 8:
        return codes.view(-1).to(torch.int16)
    packed = codes.view(-1).to(torch.int16)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)
    return (nibbles ^ 8) - 8


def dequantize_(
    out: Tensor, codes: Tensor, scales: Tensor, block: int = BLOCK, *, bits: int = 8
) -> Tensor:
    """`codes` (`bits` wide, as `quantize` makes them) x their block's scale into flat
    `out` (its dtype, rounded to nearest), pure; `fzero.native.dequantize_int8_` is its
    twin for int8."""
    _check_bits(bits)
    values = _codes(codes, bits).view(-1, block).float() * scales[:, None]
    return out.view(-1).copy_(values.view(-1)[: out.numel()])


def dequantize_mean_(
    out: Tensor, codes: Tensor, scales: Tensor, parts: int, *, bits: int = 8
) -> Tensor:
    """The mean of `parts` dequantized rows of `codes` (each whole blocks, `bits` wide),
    summed in row order in fp32, into fp32 `out` (its numel per row), pure;
    `fzero.native.dequantize_mean_int8_` and `dequantize_mean_int4_` are its twins."""
    rows = codes.view(parts, -1)
    scale_rows = scales.view(parts, -1)
    total = torch.empty_like(out)
    dequantize_(total, rows[0], scale_rows[0], bits=bits)
    part = torch.empty_like(out)
    for r in range(1, parts):
        total.add_(dequantize_(part, rows[r], scale_rows[r], bits=bits))
    return out.copy_(total.div_(parts))


def _quantize(x: Tensor, bits: int = 8) -> tuple[Tensor, Tensor]:
    """`quantize` through the native kernel where it runs on `x`'s device."""
    if not native.available(x.device):
        return quantize(x, bits=bits)
    flat = x.reshape(-1).float().contiguous()
    blocks = _blocks(flat.numel(), BLOCK)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    if bits == 4:
        codes = torch.empty(code_bytes(flat.numel(), 4), dtype=torch.uint8, device=x.device)
        native.quantize_int4_(flat, codes, scales)
    else:
        codes = torch.empty(blocks * BLOCK, dtype=torch.int8, device=x.device)
        native.quantize_int8_(flat, codes, scales)
    return codes, scales


def _dequantize_rows(out: Tensor, codes: Tensor, scales: Tensor, parts: int) -> None:
    if native.available(out.device) and out.is_contiguous():
        native.dequantize_int8_(codes, scales, out, parts)
        return
    for part, row, scale_row in zip(
        out.view(parts, -1), codes.view(parts, -1), scales.view(parts, -1)
    ):
        dequantize_(part, row, scale_row)


def _dequantize_mean(out: Tensor, codes: Tensor, scales: Tensor, parts: int, bits: int) -> None:
    if not native.available(out.device):
        dequantize_mean_(out, codes, scales, parts, bits=bits)
    elif bits == 4:
        native.dequantize_mean_int4_(codes, scales, out, parts)
    else:
        native.dequantize_mean_int8_(codes, scales, out, parts)


class _Dequantizing:
    """Two all-gathers in flight (codes, scales of `parts` equal parts); `wait` ends
    them and dequantizes each part into its place in `out`."""

    def __init__(
        self, works: list[Any], out: Tensor, codes: Tensor, scales: Tensor, parts: int
    ) -> None:
        self.works, self.out, self.codes, self.scales, self.parts = (
            works, out, codes, scales, parts,
        )  # fmt: skip

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        _dequantize_rows(self.out, self.codes, self.scales, self.parts)


_PARAMS = "parameters (int8)"  # what a qwZ gather moves, as comm_volume names it


def quantized_all_gather(out: Tensor, shard: Tensor, group: Any = None) -> _Dequantizing:
    """Start all-gathering equal `shard`s into `out` as int8 blocks (`wait()` on the
    result finishes and writes `out`, every part dequantized, this rank's included) over
    `group` (None: every process)."""
    world = out.numel() // shard.numel()
    codes, scales = _quantize(shard)
    all_codes = torch.empty(world * codes.numel(), dtype=torch.int8, device=out.device)
    all_scales = torch.empty(world * scales.numel(), dtype=torch.float32, device=out.device)
    if world == 1:
        all_codes.copy_(codes)
        all_scales.copy_(scales)
        return _Dequantizing([], out, all_codes, all_scales, 1)
    works = [
        comm.all_gather_into(
            all_codes, codes.to(out.device), async_op=True, what=_PARAMS, group=group
        ),
        comm.all_gather_into(
            all_scales, scales.to(out.device), async_op=True, what=_PARAMS, group=group
        ),
    ]
    return _Dequantizing(works, out, all_codes, all_scales, world)


def quantized_reduce_scatter(
    parts: Tensor,
    keep: Callable[[Tensor], None],
    *,
    world: int,
    bits: int = 8,
    group: Any = None,
) -> list[tuple[Any, Callable[[], None]]]:
    """Start averaging `parts` (world x n fp32, row r destined for rank r) over ranks as
    int8 (`bits` 8) or int4 (`bits` 4) blocks; `keep(mine)` then receives this rank's
    averaged n elements. Returns the collectives in flight, each with what runs after it
    (`fzero.core.reduce.Pending`)."""
    _check_bits(bits)
    what = f"gradients (int{bits})"
    n = parts.shape[1]
    rows = [_quantize(row, bits) for row in parts]
    codes = torch.stack([c for c, _ in rows])
    scales = torch.stack([s for _, s in rows])
    got_codes = torch.empty_like(codes)
    got_scales = torch.empty_like(scales)
    works = [
        comm.all_to_all_into(
            got_codes.view(-1), codes.view(-1), async_op=True, what=what, group=group
        ),
        comm.all_to_all_into(
            got_scales.view(-1), scales.view(-1), async_op=True, what=what, group=group
        ),
    ]

    def finish() -> None:
        mine = torch.empty(n, dtype=torch.float32, device=parts.device)
        _dequantize_mean(mine, got_codes.view(-1), got_scales.view(-1), world, bits)
        keep(mine)

    return [(works[0], _nothing), (works[1], finish)]


def _nothing() -> None:
    pass
