"""Stochastic rounding to bf16: each value goes to one of its two bf16 neighbours with
probability by distance, so the rounding error is zero on average. Optimizer moments
kept in bf16 need it: Adam's second moment moves by (1 - beta2) = 0.1% of itself a step,
under half a bf16 ulp (0.2%), so round-to-nearest would leave it where it is.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bf16_stochastic"]


def bf16_stochastic(x: Tensor, seed: int, out: Tensor | None = None) -> Tensor:
    """`x` (fp32) rounded to bf16 stochastically, the random bits drawn from `seed`
    (the same seed and values give the same result). Non-finite values round to
    nearest. Into `out` (bf16, `x`'s shape) when given."""
    if x.dtype != torch.float32:
        raise TypeError(f"bf16_stochastic rounds fp32 values, found {x.dtype}")
    generator = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randint(
        0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device
    )
    # adding up to one bf16 ulp below the kept bits, then dropping them: the kept value
    # moves up a step with probability (dropped bits) / 2^16 (sign-magnitude, so away
    # from zero for either sign)
    bits = noise.add_(x.view(torch.int32)).bitwise_and_(-65536)
    rounded = bits.view(torch.float32)
    rounded = torch.where(torch.isfinite(x), rounded, x)
    if out is None:
        return rounded.to(torch.bfloat16)
    return out.copy_(rounded)
