"""`deepspeed.moe.utils`: DeepSpeed's pure helpers over parameters and param groups.

A parameter is an expert (MoE) parameter when it carries `allreduce=False`, which only
DeepSpeed's MoE layers set; fzero serves no MoE layer, so for the models it trains
these helpers return the groups unchanged (as DeepSpeed's do for a model without MoE
layers), and a group that does hold expert parameters is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` has MoE layers, how many experts): never, under fzero."""
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert parameter carries `allreduce=False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared, expert) parameters."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shared, expert) gradients of the parameters that have one, in their dtype."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | None = 178956971,
) -> list[dict[str, Any]]:
    """DeepSpeed's regrouping for MoE optimizers: a dict becomes `[dict]`, a tuple a list;
    without expert parameters the groups come back as they are (each `params` a list).
    Expert parameters are refused: fzero trains no MoE layer."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(
            f"param_groups is a {type(param_groups).__name__}; allowed: dict, tuple or list "
            "of param-group dicts"
        )
    for index, group in enumerate(param_groups):
        params = list(group["params"])
        experts = [p for p in params if is_moe_param(p)]
        if experts:
            raise NotImplementedError(
                f"param group {index} holds {len(experts)} expert (MoE) parameters "
                f"(allreduce=False, e.g. shape {tuple(experts[0].shape)}): Mixture of "
                "Experts is not supported by fzero"
            )
        group["params"] = params
    return param_groups
