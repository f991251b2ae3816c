"""Stochastic rounding to bf16: each value goes to one of its two bf16 neighbours with
probability by distance, so the rounding error is zero on average. Optimizer moments
kept in bf16 need it: Adam's second moment moves by (1 - beta2) = 0.1% of itself a step,
under half a bf16 ulp (0.2%), so round-to-nearest would leave it where it is.

The random bits are a counter-based hash of (seed, element index) — splitmix64 — so a
result depends on the seed and the values only, and `fzero.native.bf16_stochastic_`
computes the same bits in one pass.

fzero's updates over bf16 masters and optimizer states seed each tensor by its name, the
step and the kind of state (`rounding_seed`), and each element by its position in the
tensor: the same bits whatever the plan, stage, unit or world size, so a plain loop over
whole tensors reproduces them.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

__all__ = ["ROUNDING_STRIDE", "bf16_stochastic", "rounding_seed"]

ROUNDING_STRIDE = 0x9E3779B97F4A7C15
"""How far the seed moves per element (splitmix64's golden gamma): `bf16_stochastic` of
`x[a:]` with `seed + a * ROUNDING_STRIDE` (mod 2^64) draws the bits it draws for those
elements of `x` with `seed`, so a tensor rounds alike in one piece or in many."""
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _noise(numel: int, seed: int, device: torch.device) -> Tensor:
    """The top 16 bits of splitmix64(seed + (i + 1) * ROUNDING_STRIDE) for i < numel, int64 (the
    products wrap modulo 2^64, as the C kernel's uint64_t arithmetic does)."""
    z = torch.arange(1, numel + 1, dtype=torch.int64, device=device)
    z = z.mul_(_signed(ROUNDING_STRIDE)).add_(_signed(seed))
    z = (z ^ _shift_right(z, 30)).mul_(_signed(_MIX1))
    z = (z ^ _shift_right(z, 27)).mul_(_signed(_MIX2))
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 48)


def bf16_stochastic(x: Tensor, seed: int, out: Tensor | None = None) -> Tensor:
    """`x` (fp32) rounded to bf16 stochastically, the random bits drawn from `seed` and
    each element's index (the same seed and values give the same result). Non-finite
    values round to nearest. Into `out` (bf16, `x`'s shape) when given."""
    if x.dtype != torch.float32:
        raise TypeError(f"bf16_stochastic rounds fp32 values, found {x.dtype}")
    bits = x.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # unsigned
    # adding the noise below the kept bits, then dropping them: the kept value moves up
    # a step with probability (dropped bits) / 2^16 (sign-magnitude: away from zero for
    # either sign)
    kept = _shift_right(bits.add_(_noise(x.numel(), seed, x.device)), 16)
    rounded = (kept << 16).to(torch.int32).view(torch.float32).reshape(x.shape)
    rounded = torch.where(torch.isfinite(x), rounded, x)
    if out is None:
        return rounded.to(torch.bfloat16)
    return out.copy_(rounded)


def rounding_seed(step: int, name: str, kind: int) -> int:
    """The seed fzero rounds tensor `name` (its fully qualified name) with after update
    `step` (1 for the first): `kind` 0 for the bf16 master (the parameter), then 1, 2, ...
    for the optimizer state's bf16 tensors in field order (Adam: `exp_avg`,
    `exp_avg_sq`). Element i of the tensor's flat view goes where
    `bf16_stochastic(flat, rounding_seed(step, name, kind))[i]` sends it, whichever
    part of the tensor a rank holds (a part from element t on rounds with the seed moved
    by t x golden: `bf16_stochastic` hashes seed + (i + 1) x golden)."""
    base = ((step * 1_000_003 + zlib.crc32(name.encode())) * 16 + kind) * 0x2545F4914F6CDD1D
    return base % 2**64
