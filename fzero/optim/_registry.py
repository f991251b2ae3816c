"""Optimizers and schedules by the names a DeepSpeed config uses (case-insensitive)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
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
    "OPTIMIZER_HINTS",
    "OPTIMIZER_PARAMS",
    "SCHEDULES",
    "SCHEDULE_HINTS",
    "SCHEDULE_PARAMS",
    "check_fixed_params",
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
# (`torch_adam` also changes AdamW's default weight decay: `_TORCH_ADAMW_DECAY`)
_IMPLEMENTATION_ONLY = ("torch_adam", "fused", "foreach")
# Keys DeepSpeed's optimizers take that fzero's run only at the value given here (the
# reason says why): accepted at it, refused otherwise
_FIXED = {
    "amsgrad": (
        False,
        "fzero's Adam and LAMB, as DeepSpeed's FusedAdam and FusedLamb, have no AMSGrad variant",
    ),
    "eps_inside_sqrt": (
        False,
        "fzero's LAMB adds eps to the square root of the second moment, FusedLamb's default",
    ),
    "fp32_optimizer_states": (
        True,
        "bf16 moments are the config's 'bf16.bf16_optimizer_states' in fzero",
    ),
}
_ADAM_FIXED = ("amsgrad", "fp32_optimizer_states")
_LAMB_FIXED = ("amsgrad", "eps_inside_sqrt")
# torch.optim.AdamW's default weight decay: what DeepSpeed builds for Adam in AdamW mode
# with `torch_adam` true and no `weight_decay` given (FusedAdam's default is 0.0)
_TORCH_ADAMW_DECAY = 0.01


def _arguments(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


# What an `optimizer` block's `params` may hold, per type (the one list: the config
# validates against it, `optimizer_from_name` builds from it)
OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    "adam": frozenset(
        _arguments(adam) - {"decoupled"} | {"adam_w_mode", *_IMPLEMENTATION_ONLY, *_ADAM_FIXED}
    ),
    "adamw": frozenset(
        _arguments(adam) - {"decoupled"} | {"adam_w_mode", *_IMPLEMENTATION_ONLY, *_ADAM_FIXED}
    ),
    "lamb": frozenset(_arguments(lamb) | set(_LAMB_FIXED)),
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


_BUILDERS = {"adam": adam, "adamw": adam, "lamb": lamb, "sgd": sgd, "muon": muon,
             "adagrad": adagrad, "lion": lion}  # fmt: skip


OPTIMIZER_HINTS: dict[str, dict[str, Any]] = {
    kind: typing.get_type_hints(build) for kind, build in _BUILDERS.items()
}
"""Each optimizer type's params by their annotated types (the config checks a block's
values against them)."""
SCHEDULE_HINTS: dict[str, dict[str, Any]] = {
    kind: typing.get_type_hints(cls) for kind, cls in SCHEDULES.items()
}
"""Each schedule type's params by their annotated types."""


def _refuse_auto(block: str, params: Mapping[str, Any]) -> None:
    """Raise naming a param still "auto" (Transformers' placeholder, resolved before an
    optimizer or schedule is built)."""
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise ValueError(
                f"'{block}.params.{key}' is still \"auto\"; resolve it (fzero.resolve_auto, "
                "or Transformers' Trainer does) or give a value"
            )


def check_fixed_params(params: Mapping[str, Any]) -> None:
    """Raise ValueError for an optimizer param fzero runs only at one value (`amsgrad`
    and `eps_inside_sqrt` false, `fp32_optimizer_states` true) given another, naming it,
    the value, and why."""
    for key, (allowed, why) in _FIXED.items():
        if key in params and params[key] != allowed:
            raise ValueError(
                f"'optimizer.params.{key}' is {params[key]!r}; allowed: {allowed!r} ({why})"
            )


def optimizer_from_name(name: str, params: Mapping[str, Any]) -> Optimizer:
    """Build an optimizer from a DeepSpeed `optimizer` block's `type` and `params`
    (`type` one of Adam, AdamW, Lamb, SGD, Muon, Adagrad, Lion, any case).

    As in DeepSpeed, type `Adam` uses decoupled weight decay (AdamW) unless
    `adam_w_mode` is false; `AdamW` is always decoupled; `fused` and `foreach` only
    pick an implementation there and change nothing here, and `torch_adam` likewise
    but for the default weight decay in AdamW mode: torch.optim.AdamW's 0.01, which
    DeepSpeed then builds (else FusedAdam's 0.0). `amsgrad` (false), LAMB's
    `eps_inside_sqrt` (false) and `fp32_optimizer_states` (true) are accepted at the value
    fzero runs (`check_fixed_params`).
    """
    key = name.lower()
    check_fixed_params(params)
    _refuse_auto("optimizer", params)
    p = {k: v for k, v in params.items() if k not in (*_IMPLEMENTATION_ONLY, *_FIXED)}
    if key in ("adam", "adamw"):
        decoupled = key == "adamw" or bool(p.pop("adam_w_mode", True))
        if key == "adamw":
            p.pop("adam_w_mode", None)
        if decoupled and params.get("torch_adam") and "weight_decay" not in p:
            p["weight_decay"] = _TORCH_ADAMW_DECAY
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
    key = name.lower().replace("_", "")
    cls = SCHEDULES.get(key)
    if cls is None:
        raise ValueError(
            f"scheduler type {name!r} is unknown; allowed: WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle, LRRangeTest, WarmupExpDecayExp"
        )
    _refuse_auto("scheduler", params)
    return cls(**params)
