"""The attributes DeepSpeed's ZeRO-3 puts on every parameter (`ds_shape`, `ds_numel`,
`ds_status`, `ds_id`, `ds_persist`, `ds_active_sub_modules`), which clients read: set
when a model is partitioned at construction (`fzero.core.partitioned`) and when an
engine builds stage-3 units. One `ds_id` counter serves both, as DeepSpeed's one."""

from __future__ import annotations

import itertools
import weakref

import torch

from fzero.core.layout import ZeroParamStatus

__all__ = ["DESCRIBED", "ZeroParamStatus", "describe_zero3_param"]

_PARAM_IDS = itertools.count()  # DeepSpeed's `ds_id`: one counter for the process

# Every parameter described so far (`fzero.engine.zero3_attributes` answers `ds_*`
# lookups of re-created tensors from it)
DESCRIBED: weakref.WeakSet[torch.nn.Parameter] = weakref.WeakSet()


def describe_zero3_param(
    p: torch.nn.Parameter, shape: tuple[int, ...], *, persistent: bool, available: bool
) -> None:
    """The attributes DeepSpeed's ZeRO-3 sets on every parameter, which clients read
    (`ds_shape`/`ds_numel`: the whole tensor's; `ds_status`; `ds_id`; `ds_persist`;
    `ds_active_sub_modules`): Transformers and Lightning count parameters with
    `ds_numel`, PEFT sizes adapters with `ds_shape`, TRL gathers by `ds_status`. A
    parameter keeps the `ds_id` it was first given."""
    p.ds_shape = torch.Size(shape)
    p.ds_numel = int(torch.Size(shape).numel())
    p.ds_persist = persistent
    p.ds_active_sub_modules = set()
    p.ds_status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE
    if "ds_id" not in p.__dict__:  # (a WeakSet compares a parameter added twice: once)
        p.ds_id = next(_PARAM_IDS)
        DESCRIBED.add(p)
