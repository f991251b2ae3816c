"""The NVMe swap file's host buffers: their size for a unit's partition, and bf16 moments
carried inside fp32 buffers ([Note: bf16 moments in their fp32 buffers]), for
`fzero.core.residency`."""

from __future__ import annotations

import torch
from torch import Tensor

from fzero import native
from fzero.core import nvme as _nvme
from fzero.optim import ROUNDING_STRIDE, bf16_stochastic

__all__ = [
    "BF16_PAGE",
    "CHUNK",
    "narrow_in_place",
    "packed",
    "round_bf16_into",
    "swap_buffer_numel",
    "widen_packed",
]

# [Note: bf16 moments in their fp32 buffers]
#
# With bf16 moments in the swap file, each moment is read into the upper part of its
# kind's fp32 swap buffer (from the first 4 KiB boundary at or after element n of the
# buffer's bf16 view, n the partition's elements) and widened to fp32 into the buffer's
# first n elements, CHUNK elements at a time in ascending order through a small fp32
# buffer: chunk [a, b) writes bytes [4a, 4b), and the bf16 chunks not yet read start at
# byte 2n + 2b >= 4b. Written back, the fp32 moment is rounded (stochastically) into the
# buffer's bf16 view from element 0, chunk by chunk in ascending order through a small
# bf16 buffer: chunk [a, b) writes bytes [2a, 2b), below the fp32 elements not yet read
# (from byte 4b). Each chunk's rounding draws the bits the whole partition's would
# (each tensor's part with its seed moved by a x `fzero.optim.ROUNDING_STRIDE`: `bf16_stochastic`
# hashes seed + (i + 1) x the stride), and widening is exact, so the values are those of
# separate bf16 buffers, bit for bit; a unit in the step holds 4 bytes per element per
# moment instead of 5. A bf16 master travels the same way, rounded to nearest on the way
# out (the step has rounded it stochastically already: exact then).
CHUNK = 1 << 20  # elements widened or rounded at a time (4 MiB of fp32)
BF16_PAGE = _nvme.ALIGN // 2  # bf16 elements per 4 KiB


def swap_buffer_numel(largest: int) -> int:
    """Elements of each fp32 swap buffer for partitions of up to `largest` elements:
    whole 4 KiB pages, and room for a bf16 moment of `largest` elements read into the
    upper part at a 4 KiB boundary, with its read rounded up to whole pages."""
    return -(-largest // 1024) * 1024 + 2048


def packed(buffer: Tensor, numel: int) -> Tensor:
    """Where a bf16 moment of `numel` elements is read into fp32 swap `buffer` (see the
    Note above): `numel` bf16 elements from the first 4 KiB boundary at or after element
    `numel` of the buffer's bf16 view."""
    start = -(-numel // BF16_PAGE) * BF16_PAGE
    return buffer.view(torch.bfloat16)[start : start + numel]


def widen_packed(buffer: Tensor, numel: int) -> Tensor:
    """The bf16 moment `packed(buffer, numel)` holds, widened to fp32 into the buffer's
    first `numel` elements (in place, in ascending chunks; exact); returns them."""
    source, wide = packed(buffer, numel), buffer[:numel]
    chunk = torch.empty(min(numel, CHUNK), dtype=torch.float32)
    for start in range(0, numel, CHUNK):
        stop = min(numel, start + CHUNK)
        part = chunk[: stop - start].copy_(source[start:stop])
        wide[start:stop].copy_(part)
    return wide


def round_bf16_into(tensor: Tensor, out: Tensor, seed: int | None) -> Tensor:
    """fp32 `tensor` rounded stochastically into bf16 `out` (native kernel when built),
    the bits drawn from `seed` and each element's index; with `seed` None, to nearest
    (even), as `Tensor.to` rounds."""
    if seed is None:
        return out.copy_(tensor)
    if native.available():
        return native.bf16_stochastic_(tensor, out, seed)
    return bf16_stochastic(tensor, seed, out=out)


def narrow_in_place(buffer: Tensor, numel: int, spans: list[tuple[int, int, int]] | None) -> Tensor:
    """The fp32 moment in `buffer`'s first `numel` elements rounded stochastically into
    the buffer's bf16 view from element 0 (in place, in ascending chunks: see the Note
    above), elements [a, b) of each of `spans` with its seed as
    `fzero.core.precision.rounding_spans` gives them (`spans` None: to nearest, for a
    master); returns that bf16 view."""
    wide, out = buffer[:numel], buffer.view(torch.bfloat16)[:numel]
    chunk = torch.empty(min(numel, CHUNK), dtype=torch.bfloat16)
    for start in range(0, numel, CHUNK):
        stop = min(numel, start + CHUNK)
        if spans is None:
            part = round_bf16_into(wide[start:stop], chunk[: stop - start], None)
        else:
            part = chunk[: stop - start]
            for a, b, seed in spans:
                lo, hi = max(a, start), min(b, stop)
                if lo < hi:  # the span's elements in this chunk, seeded from element lo
                    at = (seed + (lo - a) * ROUNDING_STRIDE) % 2**64
                    round_bf16_into(wide[lo:hi], part[lo - start : hi - start], at)
        out[start:stop].copy_(part)
    return out
