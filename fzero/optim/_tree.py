"""Any pytree of tensors (optax, torchopt): a per-tensor optimizer mapped over a structure.

`init(params)` returns the structure of `params` with each tensor's state in its place;
`update(grads, state, params)` takes the same structure three times and returns it
twice (new params, new state); `update_` writes the params in place and returns the new
state. A single tensor is its own structure: a leaf optimizer's behaviour, unchanged.
Structures are `torch.utils._pytree`'s: dicts, lists, tuples, namedtuples, nested.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

from fzero.optim._base import Optimizer

__all__ = ["over_trees"]


def _is_state(value: Any) -> bool:
    """A leaf optimizer's state (a NamedTuple with a `step`), kept whole when flattening."""
    return isinstance(value, tuple) and "step" in getattr(type(value), "_fields", ())


def _flatten_params(params: Any) -> tuple[list[Tensor], Any]:
    leaves, spec = pytree.tree_flatten(params)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"params leaf {index} is a {type(leaf).__name__}; expected a tree of tensors"
            )
    return leaves, spec


def _leaves_like(tree: Any, spec: Any, what: str) -> list[Any]:
    leaves, found = pytree.tree_flatten(tree, is_leaf=_is_state)
    if found != spec:
        raise ValueError(f"{what} has structure {found}; params have {spec}")
    return leaves


def _per_leaf(
    fn: Any, grads: Any, state: Any, params: Any, overrides: dict[str, Any]
) -> tuple[list[Any], Any]:
    """`fn(grad, state, param, **overrides)` for each leaf of `params`, and its structure."""
    leaves, spec = _flatten_params(params)
    grad_leaves = _leaves_like(grads, spec, "grads")
    state_leaves = _leaves_like(state, spec, "state")
    results = [fn(g, s, p, **overrides) for g, s, p in zip(grad_leaves, state_leaves, leaves)]
    return results, spec


def over_trees(leaf: Optimizer) -> Optimizer:
    """`leaf` (an optimizer of one tensor) over any pytree of tensors."""

    def init(params: Any) -> Any:
        if isinstance(params, Tensor):
            return leaf.init(params)
        leaves, spec = _flatten_params(params)
        return pytree.tree_unflatten([leaf.init(p) for p in leaves], spec)

    def update(grads: Any, state: Any, params: Any, **overrides: Any) -> tuple[Any, Any]:
        if isinstance(params, Tensor):
            return leaf.update(grads, state, params, **overrides)
        pairs, spec = _per_leaf(leaf.update, grads, state, params, overrides)
        return (
            pytree.tree_unflatten([p for p, _ in pairs], spec),
            pytree.tree_unflatten([s for _, s in pairs], spec),
        )

    def update_(grads: Any, state: Any, params: Any, **overrides: Any) -> Any:
        if isinstance(params, Tensor):
            return leaf.update_(grads, state, params, **overrides)
        states, spec = _per_leaf(leaf.update_, grads, state, params, overrides)
        return pytree.tree_unflatten(states, spec)

    return leaf._replace(init=init, update=update, update_=update_)
