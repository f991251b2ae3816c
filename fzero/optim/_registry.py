"""Optimizers and schedules by the names a DeepSpeed config uses (case-insensitive)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from fzero.optim._adam import adam
from fzero.optim._base import Optimizer
from fzero.optim._lamb import lamb
from fzero.optim._schedules import (
    LRRangeTest,
    OneCycle,
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupExpDecayExp,
    WarmupLR,
)
from fzero.optim._sgd import sgd

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_PARAMS",
    "SCHEDULES",
    "SCHEDULE_PARAMS",
    "optimizer_from_name",
    "schedule_from_name",
]

OPTIMIZERS = ("adam", "adamw", "lamb", "sgd")
# DeepSpeed's switches that pick an implementation of Adam there and change nothing here
_IMPLEMENTATION_ONLY = ("torch_adam", "fused")


def _arguments(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


# What an `optimizer` block's `params` may hold, per type (the one list: the config
# validates against it, `optimizer_from_name` builds from it)
OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    "adam": frozenset(_arguments(adam) - {"decoupled"} | {"adam_w_mode", *_IMPLEMENTATION_ONLY}),
    "adamw": frozenset(_arguments(adam) - {"decoupled"} | {"adam_w_mode", *_IMPLEMENTATION_ONLY}),
    "lamb": frozenset(_arguments(lamb)),
    "sgd": frozenset(_arguments(sgd)),
}
SCHEDULES = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "warmupcosinelr": WarmupCosineLR,
    "onecycle": OneCycle,
    "lrrangetest": LRRangeTest,
    "warmupexpdecayexp": WarmupExpDecayExp,
}
SCHEDULE_PARAMS: dict[str, frozenset[str]] = {
    name: frozenset(f.name for f in dataclasses.fields(cls)) for name, cls in SCHEDULES.items()
}


def optimizer_from_name(name: str, params: Mapping[str, Any]) -> Optimizer:
    """Build an optimizer from a DeepSpeed `optimizer` block's `type` and `params`.

    As in DeepSpeed, type `Adam` uses decoupled weight decay (AdamW) unless
    `adam_w_mode` is false; `AdamW` is always decoupled; `torch_adam` and
    `fused` only pick an implementation there and change nothing here.
    """
    key = name.lower()
    p = {k: v for k, v in params.items() if k not in _IMPLEMENTATION_ONLY}
    if key in ("adam", "adamw"):
        decoupled = key == "adamw" or bool(p.pop("adam_w_mode", True))
        if key == "adamw":
            p.pop("adam_w_mode", None)
        return adam(**p, decoupled=decoupled)
    if key == "lamb":
        return lamb(**p)
    if key == "sgd":
        return sgd(**p)
    raise ValueError(f"optimizer type {name!r} is unknown; allowed: Adam, AdamW, Lamb, SGD")


def schedule_from_name(name: str, params: Mapping[str, Any]) -> Schedule:
    """Build a schedule from a DeepSpeed `scheduler` block's `type` and `params`."""
    cls = SCHEDULES.get(name.lower().replace("_", ""))
    if cls is None:
        raise ValueError(
            f"scheduler type {name!r} is unknown; allowed: WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle, LRRangeTest, WarmupExpDecayExp"
        )
    return cls(**params)
