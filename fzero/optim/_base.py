"""What every functional optimizer is: a named bundle of pure functions, and what its
update needs across shards.

[Note: needs] Under ZeRO a rank updates only its partition of each unit's flat buffer,
and a tensor may span ranks. Most optimizers do not care: each element's update reads
only that element (Adam, SGD, Adagrad, Lion: `needs=None`). Two families do, and say so
in `Optimizer.needs`, which is what the core dispatches on (never the name, so a
user's optimizer gets what a built-in one gets):

- `TensorNorms`: a tensor's step is scaled by norms of the whole tensor (LAMB's and
  LARS's trust ratio). The core runs the update in two halves: `direction_` on every
  partition, then each tensor's sums of squares of the parameter and the direction
  summed across ranks (one all-reduce for all tensors), then `apply_` with the norms.
- `WholeTensors`: some tensors' steps are a function of the whole tensor (Muon's
  Newton-Schulz orthogonalization of a hidden matrix). The core runs `direction_` on the
  partition, makes each taken tensor's direction whole (one all-gather of the unit's
  directions where it is sharded; none where the plan keeps each such tensor within one
  rank), calls `whole` on it, and hands each rank its part to `apply_`. The other
  tensors take `rest_`, elementwise.

In both, the state is the optimizer's state over the flat partition, or a piece of it
(its tensor fields sliced), and its `step` is the count before this step: the core
counts it once the state has advanced.

A `NativeKernel` is an optimizer's optional fused kernels, each the twin of one of the
pure functions above (tests prove them equal); the core calls them where fzero's native
kernels serve the partition's device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["NativeKernel", "Needs", "Optimizer", "TensorNorms", "WholeTensors", "with_overrides"]

Segments = Sequence[tuple[int, int]]


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


class TensorNorms(NamedTuple):
    """The update of a tensor needs norms of the whole tensor (a trust ratio).

    - `direction_(grad, state, param, hparams) -> direction`: the first half over a flat
      partition: advances the state's tensors in place and returns the direction u (a
      new fp32 tensor the size of `param`);
    - `apply_(param, direction, segments, param_norms, direction_norms, hparams)`: the
      second half: moves each segment `(start, stop)` of `param` (one tensor's piece),
      given that whole tensor's norms ‖p‖ and ‖u‖ (`param` before this step's move).

    - `step_hparams(hparams, state) -> hparams` (optional): the hyper-parameters `apply_`
      is given, from the step's and the state the first half advanced (LAMB's
      bias-corrected step size); without it, the step's own.

    The state does not reach `apply_`: between the halves it may rest in a swap file.
    """

    direction_: Callable[[Tensor, Any, Tensor, Any], Tensor]
    apply_: Callable[[Tensor, Tensor, Segments, Sequence[float], Sequence[float], Any], None]
    step_hparams: Callable[[Any, Any], Any] | None = None


class WholeTensors(NamedTuple):
    """The update of some tensors is a function of the whole tensor.

    - `takes(name, shape, hparams) -> bool`: whether tensor `name` of `shape` is one;
    - `direction_(grad, state, param, hparams) -> direction`: elementwise, over a taken
      tensor's piece: advances the state's tensors in place, returns the direction (new);
    - `whole(direction, hparams) -> update`: one whole tensor's update from its whole
      direction (in the tensor's shape; fp32, the same shape);
    - `apply_(param, update, hparams)`: moves a taken tensor's piece by its update's piece;
    - `rest_(grad, state, param, hparams)`: the whole step of a piece of a tensor not
      taken, in place (its return value is not used).
    """

    takes: Callable[[str, tuple[int, ...], Any], bool]
    direction_: Callable[[Tensor, Any, Tensor, Any], Tensor]
    whole: Callable[[Tensor, Any], Tensor]
    apply_: Callable[[Tensor, Tensor, Any], None]
    rest_: Callable[[Tensor, Any, Tensor, Any], Any]


Needs = TensorNorms | WholeTensors | None


class NativeKernel(NamedTuple):
    """An optimizer's fused native kernels over one contiguous fp32 partition, each the
    twin of a pure function. The core passes `kernels`, the `fzero.native` module
    (`fzero.optim` imports no layer above it; a user's kernel may call its own code),
    and uses them where `fzero.native.available` says fzero's kernels serve the
    partition's device and that device's type is in `devices`.

    - `update_(kernels, param, grad, state, hparams, grad_scale, out) -> state`: the twin
      of `Optimizer.update_` for an optimizer without needs; the gradient times
      `grad_scale` first (not written); `out` (bf16 or fp16, or None) receives the new
      parameters in the same pass;
    - `direction_(kernels, param, grad, state, hparams, grad_scale, out)`: the twin of
      `TensorNorms.direction_`, the direction written into `out` (fp32);
    - `apply_(kernels, param, direction, segments, param_norms, direction_norms,
      hparams)`: the twin of `TensorNorms.apply_`.
    """

    update_: Callable[..., Any] | None = None
    direction_: Callable[..., None] | None = None
    apply_: Callable[..., None] | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")


class Optimizer(NamedTuple):
    """An optimizer as data plus pure functions (optax style).

    - `init(params) -> state`: fresh state for a tensor (one flat buffer) or any pytree
      of tensors (dict, list, tuple, nested: the state has the same structure); a
      tensor's state is a NamedTuple whose `step` counts its steps;
    - `update(grads, state, params, **overrides) -> (new_params, new_state)`: pure,
      inputs untouched; `overrides` replace hyper-parameters for this call
      (`lr=...` from a schedule, `weight_decay=0.0` for a no-decay group);
    - `update_(grads, state, params, **overrides) -> new_state`: the same math in
      place ("donated" buffers), for the engine's contiguous fp32 shards;
    - `hparams`: the frozen hyper-parameters; `state_slots`: fp32 state tensors
      per element (Adam 2, SGD with momentum 1), for memory estimates;
    - `needs`: what the update needs across shards (see [Note: needs]): None,
      `TensorNorms` or `WholeTensors`;
    - `native`: its fused kernels (`NativeKernel`), or None;
    - `override(hparams, overrides) -> hparams`: one step's hyper-parameters from a
      group's and a schedule's overrides: `with_overrides`, unless the optimizer ties
      hyper-parameters together (Muon scales its Adam lr with a scheduled lr).

    `name` names the optimizer in messages and checkpoints; nothing dispatches on it.
    """

    name: str
    hparams: Any
    init: Callable[[Tensor], Any]
    update: Callable[..., tuple[Tensor, Any]]
    update_: Callable[..., Any]
    state_slots: int
    needs: Needs = None
    native: NativeKernel | None = None
    override: Callable[[Any, dict[str, Any]], Any] = with_overrides
