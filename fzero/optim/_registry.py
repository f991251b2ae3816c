"""Optimizers and schedules by the names a DeepSpeed config uses (case-insensitive)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from fzero.optim._adagrad import adagrad
from fzero.optim._adam import adam
from fzero.optim._base import Optimizer
from fzero.optim._lamb import lamb
from fzero.optim._lion import lion
from fzero.optim._muon import muon
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

OPTIMIZERS = ("adam", "adamw", "lamb", "sgd", "muon", "adagrad", "lion")
_ALLOWED = "Adam, AdamW, Lamb, SGD, Muon, Adagrad, Lion"
# DeepSpeed's Muon block: `lr` (both groups unless `muon_lr`/`adam_lr`), `momentum`,
# `weight_decay`, `betas`, `eps`, `ns_method` ("standard" here; DeepSpeed's default
# "gram" is its own Newton-Schulz variant)
_MUON_DEEPSPEED = {"muon_lr", "ns_method"}
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
    "muon": frozenset(_arguments(muon) | _MUON_DEEPSPEED),
    # DeepSpeed hands these to torch.optim.Adagrad (or, offloaded, DeepSpeedCPUAdagrad)
    # and to FusedLion (or DeepSpeedCPULion): the same names
    "adagrad": frozenset(_arguments(adagrad)),
    "lion": frozenset(_arguments(lion)),
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
    """Build an optimizer from a DeepSpeed `optimizer` block's `type` and `params`
    (`type` one of Adam, AdamW, Lamb, SGD, Muon, Adagrad, Lion, any case).

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
    if key == "muon":
        return _muon_from(p)
    if key == "adagrad":
        return adagrad(**p)
    if key == "lion":
        return lion(**p)
    raise ValueError(f"optimizer type {name!r} is unknown; allowed: {_ALLOWED}")


def _muon_from(params: dict[str, Any]) -> Optimizer:
    """DeepSpeed's Muon block: `lr` is both groups' unless `muon_lr` / `adam_lr` say;
    without any, the reference's 0.02 and 3e-4."""
    method = params.pop("ns_method", "standard")
    if method != "standard":
        raise ValueError(
            f"optimizer.params.ns_method is {method!r}; fzero runs the reference's "
            "Newton-Schulz iteration: allowed: 'standard'"
        )
    lr = params.pop("lr", None)
    muon_lr, adam_lr = params.pop("muon_lr", lr), params.pop("adam_lr", lr)
    if muon_lr is not None:
        params["lr"] = muon_lr
    if adam_lr is not None:
        params["adam_lr"] = adam_lr
    if "exclude" in params:
        params["exclude"] = tuple(params["exclude"])
    return muon(**params)


def schedule_from_name(name: str, params: Mapping[str, Any]) -> Schedule:
    """Build a schedule from a DeepSpeed `scheduler` block's `type` and `params`."""
    cls = SCHEDULES.get(name.lower().replace("_", ""))
    if cls is None:
        raise ValueError(
            f"scheduler type {name!r} is unknown; allowed: WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle, LRRangeTest, WarmupExpDecayExp"
        )
    return cls(**params)
