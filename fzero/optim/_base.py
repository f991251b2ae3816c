"""What every functional optimizer is: a named bundle of pure functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Optimizer", "with_overrides"]


class Optimizer(NamedTuple):
    """An optimizer as data plus pure functions (optax style).

    - `init(params) -> state`: fresh state for a tensor (one flat buffer) or any pytree
      of tensors (dict, list, tuple, nested: the state has the same structure);
    - `update(grads, state, params, **overrides) -> (new_params, new_state)`: pure,
      inputs untouched; `overrides` replace hyper-parameters for this call
      (`lr=...` from a schedule, `weight_decay=0.0` for a no-decay group);
    - `update_(grads, state, params, **overrides) -> new_state`: the same math in
      place ("donated" buffers), for the engine's contiguous fp32 shards;
    - `hparams`: the frozen hyper-parameters; `state_slots`: fp32 state tensors
      per element (Adam 2, SGD with momentum 1), for memory estimates.
    """

    name: str
    hparams: Any
    init: Callable[[Tensor], Any]
    update: Callable[..., tuple[Tensor, Any]]
    update_: Callable[..., Any]
    state_slots: int


def with_overrides(hparams: Any, overrides: dict[str, Any]) -> Any:
    """`hparams` with `overrides` applied; an unknown name raises naming the allowed ones."""
    if not overrides:
        return hparams
    names = {f.name for f in dataclasses.fields(hparams)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"{type(hparams).__name__} has no hyper-parameter {unknown}; allowed: {sorted(names)}"
        )
    return dataclasses.replace(hparams, **overrides)
