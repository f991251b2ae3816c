"""The attributes DeepSpeed's ZeRO-3 sets on every parameter (`fzero.core.zero3_params`,
which the engine sets when it builds stage-3 units), and their answer for tensors
autograd re-creates from a stage-3 parameter."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from fzero.core.layout import ZeroParamStatus
from fzero.core.zero3_params import DESCRIBED, describe_zero3_param

__all__ = ["AliasAnswers", "ZeroParamStatus", "describe_zero3_param"]


# [Note: ds_* attributes of re-created tensors] A custom autograd.Function that saved a
# stage-3 parameter gets, from `ctx.saved_tensors`, a new tensor over the parameter's data
# (torch re-creates every tensor a saved-tensor hook hands back, subclass and attributes
# dropped), where DeepSpeed's gets the parameter itself; TRL's chunked log-prob backward
# reads `weight.ds_status` on it. No value fzero can return from its hook carries the
# attributes, so while an engine that gathers parameters again in backward lives, a
# failed attribute lookup on a tensor asks `_zero3_attribute_of_alias`: the only patch of
# torch fzero makes, installed by the first such engine and removed when the last one is
# destroyed (or collected).
_ANSWERING: weakref.WeakSet[object] = weakref.WeakSet()  # the engines that need it


class AliasAnswers:
    """The handle an engine holds while re-created tensors answer `ds_*` attributes as the
    stage-3 parameter they alias; `remove()` (the engine's `destroy`) ends its need."""

    def __init__(self, owner: object) -> None:
        _ANSWERING.add(owner)
        if torch.Tensor.__dict__.get("__getattr__") is not _zero3_attribute_of_alias:
            torch.Tensor.__getattr__ = _zero3_attribute_of_alias  # type: ignore[attr-defined]
        self._owner = weakref.ref(owner)
        self._finalizer = weakref.finalize(owner, _withdraw)

    def remove(self) -> None:
        owner = self._owner()
        if owner is not None:
            _ANSWERING.discard(owner)
        self._finalizer.detach()
        _withdraw()


def _withdraw() -> None:
    """Remove the patch once no engine needs it."""
    # the living engines only: an engine being collected has its reference cleared but
    # may still count in the set's length until the set's own callback has run
    alive = any(True for _ in _ANSWERING)
    if not alive and torch.Tensor.__dict__.get("__getattr__") is _zero3_attribute_of_alias:
        del torch.Tensor.__getattr__


def _zero3_attribute_of_alias(tensor: Tensor, name: str) -> Any:
    """A `ds_*` attribute of the stage-3 parameter a plain tensor aliases, for names a
    tensor lacks (Python calls this only when normal lookup fails).

    With DeepSpeed, a custom `autograd.Function` that saved a parameter gets the
    parameter object back from `ctx.saved_tensors`. fzero's stage-3 saved-tensor hook
    gathers the parameter again in backward, and torch then hands the Function a new
    tensor over the parameter's data: TRL's chunked log-prob backward reads
    `weight.ds_status` on it. Such a tensor answers as the parameter whose whole data it
    shares (same address and shape); any other tensor raises AttributeError as before."""
    if name.startswith("ds_") and tensor.numel() > 0:
        for p in list(DESCRIBED):
            if (
                p is not tensor
                and name in p.__dict__
                and p.data.data_ptr() == tensor.data_ptr()
                and p.data.shape == tensor.shape
            ):
                return p.__dict__[name]
    raise AttributeError(f"'{type(tensor).__name__}' object has no attribute '{name}'")
