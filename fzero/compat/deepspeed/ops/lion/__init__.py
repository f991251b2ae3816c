"""`deepspeed.ops.lion`: Lion is not among fzero's optimizers; refused by name."""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedCPULion", "FusedLion"]


def _refuse(name: str) -> Any:
    raise NotImplementedError(
        f"deepspeed.ops.lion.{name}: Lion is not supported by fzero; allowed optimizers: "
        "Adam, AdamW, Lamb, SGD (torch.optim.Adam/AdamW/SGD as client optimizers, or the "
        "config's optimizer block)"
    )


def DeepSpeedCPULion(*_: Any, **__: Any) -> Any:  # DeepSpeed's name
    """Refused: fzero's optimizers are Adam, AdamW, LAMB and SGD."""
    return _refuse("DeepSpeedCPULion")


def FusedLion(*_: Any, **__: Any) -> Any:  # DeepSpeed's name
    """Refused: fzero's optimizers are Adam, AdamW, LAMB and SGD."""
    return _refuse("FusedLion")
