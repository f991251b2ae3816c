"""The `step` of DeepSpeed's optimizer ops that fzero serves as torch optimizers over its
functional ones (`lion`, `lamb`): each parameter with a gradient moved in place by the
group's rule, its moments kept in the torch optimizer's state under the state's field
names (`step`, `exp_avg`, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fzero.optim import Optimizer

__all__ = ["step_each"]


@torch.no_grad()
def step_each(
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], float] | None,
    rule_of: Callable[[dict[str, Any]], Optimizer],
    state_type: Any,
) -> float | None:
    """One step of every parameter with a gradient, by `rule_of(group)`'s in-place
    update over a `state_type` (a step count, then moments shaped as the parameter);
    sparse gradients refused, as DeepSpeed's ops refuse them. Returns the closure's loss."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        rule = rule_of(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
            state = optimizer.state[p]
            if not state:
                moments = [torch.zeros_like(p) for _ in state_type._fields[1:]]
                state.update(state_type(0, *moments)._asdict())
            state["step"] = rule.update_(p.grad, state_type(**state), p).step
    return loss
