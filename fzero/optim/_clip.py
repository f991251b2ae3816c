"""Global-norm gradient clipping math, given each rank's partial sum of squares.

Under sharding every rank sums the squares of the gradient elements it owns;
one all-reduce of that scalar gives every rank the same global norm. The
coefficient matches `torch.nn.utils.clip_grad_norm_`: max_norm / (norm + 1e-6),
capped at 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["clip_coefficient", "global_norm"]


def global_norm(partial_sq_sums: Iterable[float]) -> float:
    """sqrt of the summed per-rank (or per-tensor) sums of squares."""
    return math.sqrt(sum(float(x) for x in partial_sq_sums))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their norm is at most `max_norm` (1 if already)."""
    if max_norm <= 0:
        raise ValueError(f"max_norm is {max_norm}; it must be > 0")
    if not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
