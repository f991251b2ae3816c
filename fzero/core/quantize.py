"""Quantized collectives (ZeRO++, Wang et al. 2023): qwZ, stage 3's parameter all-gathers,
and qgZ, stages 2-3's gradient reductions, in blockwise int8.

A shard is cut into blocks of `BLOCK` elements; each block travels as int8 codes
`round(x / s)` with one fp32 scale `s = max|x| / 127` (symmetric, round to nearest:
deterministic), 1.016 bytes per element instead of 2 (bf16) or 4 (fp32). Every rank
dequantizes every part, its own included, so all ranks compute with the same weights.
Only the gathered copies are approximate: masters, the optimizer and the shards at rest
stay exact.

qgZ replaces a reduce-scatter: each rank quantizes the part of its gradients every other
rank owns (blocks never straddle two ranks' parts), one all-to-all sends each part to its
owner, which dequantizes the parts it receives and sums them in fp32: each rank moves
about a quarter of the fp32 bytes, and the rounding error of each rank's contribution is
at most half a step of its block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fzero import comm, native

__all__ = [
    "BLOCK",
    "dequantize_",
    "dequantize_mean_",
    "quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
]

BLOCK = 256


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def quantize(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Flat `x` as (int8 codes, padded to whole blocks with 0; fp32 scale per block),
    pure. A block's scale is max|x| / 127 (NaN if an element is NaN); a code is
    round(x / scale) half to even (x / 1 in an all-zero block), NaN as 0, in [-127, 127].
    `fzero.native.quantize_int8_` is its twin, bit for bit."""
    flat = x.reshape(-1).float()
    blocks = _blocks(flat.numel(), block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, block)
    scales = rows.abs().amax(dim=1) / 127.0
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / divisors[:, None]).nan_to_num_(0.0).clamp_(-127, 127)
    codes = codes.to(torch.int8).view(-1)
    codes[flat.numel() :] = 0
    return codes, scales


def dequantize_(out: Tensor, codes: Tensor, scales: Tensor, block: int = BLOCK) -> Tensor:
    """`codes` x their block's scale into flat `out` (its dtype, rounded to nearest),
    pure; `fzero.native.dequantize_int8_` is its twin."""
    values = codes.view(-1, block).float() * scales[:, None]
    return out.view(-1).copy_(values.view(-1)[: out.numel()])


def dequantize_mean_(out: Tensor, codes: Tensor, scales: Tensor, parts: int) -> Tensor:
    """The mean of `parts` dequantized rows of `codes` (each whole blocks), summed in row
    order in fp32, into fp32 `out` (its numel per row), pure;
    `fzero.native.dequantize_mean_int8_` is its twin."""
    rows = codes.view(parts, -1)
    scale_rows = scales.view(parts, -1)
    total = torch.empty_like(out)
    dequantize_(total, rows[0], scale_rows[0])
    part = torch.empty_like(out)
    for r in range(1, parts):
        total.add_(dequantize_(part, rows[r], scale_rows[r]))
    return out.copy_(total.div_(parts))


def _quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize` through the native kernel where it runs on `x`'s device."""
    if not native.available(x.device):
        return quantize(x)
    flat = x.reshape(-1).float().contiguous()
    blocks = _blocks(flat.numel(), BLOCK)
    codes = torch.empty(blocks * BLOCK, dtype=torch.int8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
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


def _dequantize_mean(out: Tensor, codes: Tensor, scales: Tensor, parts: int) -> None:
    if native.available(out.device):
        native.dequantize_mean_int8_(codes, scales, out, parts)
    else:
        dequantize_mean_(out, codes, scales, parts)


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


def quantized_all_gather(out: Tensor, shard: Tensor) -> _Dequantizing:
    """Start all-gathering equal `shard`s into `out` as int8 blocks (`wait()` on the
    result finishes and writes `out`, every part dequantized, this rank's included)."""
    world = out.numel() // shard.numel()
    codes, scales = _quantize(shard)
    all_codes = torch.empty(world * codes.numel(), dtype=torch.int8, device=out.device)
    all_scales = torch.empty(world * scales.numel(), dtype=torch.float32, device=out.device)
    if world == 1:
        all_codes.copy_(codes)
        all_scales.copy_(scales)
        return _Dequantizing([], out, all_codes, all_scales, 1)
    works = [
        comm.all_gather_into(all_codes, codes.to(out.device), async_op=True),
        comm.all_gather_into(all_scales, scales.to(out.device), async_op=True),
    ]
    return _Dequantizing(works, out, all_codes, all_scales, world)


def quantized_reduce_scatter(
    parts: Tensor, keep: Callable[[Tensor], None], *, world: int
) -> list[tuple[Any, Callable[[], None]]]:
    """Start averaging `parts` (world x n fp32, row r destined for rank r) over ranks as
    int8 blocks; `keep(mine)` then receives this rank's averaged n elements. Returns the
    collectives in flight, each with what runs after it (`fzero.core.reduce.Pending`)."""
    n = parts.shape[1]
    rows = [_quantize(row) for row in parts]
    codes = torch.stack([c for c, _ in rows])
    scales = torch.stack([s for _, s in rows])
    got_codes = torch.empty_like(codes)
    got_scales = torch.empty_like(scales)
    works = [
        comm.all_to_all_into(got_codes.view(-1), codes.view(-1), async_op=True),
        comm.all_to_all_into(got_scales.view(-1), scales.view(-1), async_op=True),
    ]

    def finish() -> None:
        mine = torch.empty(n, dtype=torch.float32, device=parts.device)
        _dequantize_mean(mine, got_codes.view(-1), got_scales.view(-1), world)
        keep(mine)

    return [(works[0], _nothing), (works[1], finish)]


def _nothing() -> None:
    pass
