"""`deepspeed.ops.adagrad`: Adagrad is not among fzero's optimizers; refused by name."""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedCPUAdagrad"]


def DeepSpeedCPUAdagrad(*_: Any, **__: Any) -> Any:  # DeepSpeed's name
    """Refused: fzero's optimizers are Adam, AdamW, LAMB and SGD."""
    raise NotImplementedError(
        "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad: Adagrad is not supported by fzero; "
        "allowed optimizers: Adam, AdamW, Lamb, SGD (torch.optim.Adam/AdamW/SGD as client "
        "optimizers, or the config's optimizer block)"
    )
