"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"), with AdamW for the
rest, as the reference `MuonWithAuxAdam` computes it.

A hidden matrix (a tensor of two or more dimensions whose name contains none of
`exclude`, by default "embed" and "lm_head": DeepSpeed's rule; a param group's
`use_muon` key decides for its tensors instead) moves along its
orthogonalized momentum:

    m = lerp(m, g, 1 - momentum);  u = lerp(g, m, momentum)  (nesterov; else u = m)
    O = NewtonSchulz5(u as a matrix, rows x everything else) * sqrt(max(1, rows / cols))
    p = p * (1 - lr * weight_decay) - lr * O

with the reference's quintic iteration (coefficients 3.4445, -4.7750, 2.0315, five steps,
in bf16 unless `ns_dtype="fp32"`). Every other tensor takes an AdamW step (`adam_lr`,
`betas`, `eps`, the same `weight_decay`). A schedule's lr scales both alike.

Newton-Schulz needs the whole matrix: over a pytree each leaf is one; under sharding
Muon declares `WholeTensors` (`muon_needs`), so the core makes each hidden matrix's
momentum direction whole before it. The state is Adam's shape (`exp_avg` is Muon's
momentum buffer there; `exp_avg_sq` stays zero for Muon's tensors), so memory never
exceeds AdamW's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fzero.optim._adam import AdamHParams, AdamState, adam_update_
from fzero.optim._base import Optimizer, WholeTensors, with_overrides

__all__ = [
    "MuonHParams",
    "MuonState",
    "muon",
    "muon_direction_",
    "muon_needs",
    "newton_schulz",
    "orthogonalized",
    "scaled_overrides",
    "scheduled",
    "uses_muon",
]

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class MuonHParams:
    lr: float = 0.02
    momentum: float = 0.95
    weight_decay: float = 0.0
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "bf16"
    adam_lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-10
    exclude: tuple[str, ...] = ("embed", "lm_head")
    use_muon: bool | None = None
    """A param group's choice (DeepSpeed's `use_muon` group key): True for Muon on its
    tensors of two or more dimensions, False for AdamW on all; None: by name (`exclude`)."""


class MuonState(NamedTuple):
    step: int
    exp_avg: Tensor
    exp_avg_sq: Tensor


def uses_muon(name: str, shape: tuple[int, ...], hp: MuonHParams) -> bool:
    """Whether tensor `name` of `shape` takes Muon's step (else AdamW's)."""
    if len(shape) < 2 or hp.use_muon is False:
        return False
    lowered = name.lower()
    return hp.use_muon is True or not any(word in lowered for word in hp.exclude)


def newton_schulz(matrix: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The reference's quintic Newton-Schulz iteration: `matrix` (2-D) pushed towards
    the nearest semi-orthogonal matrix, in `dtype`."""
    a, b, c = _NS_COEFFICIENTS
    x = matrix.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def orthogonalized(update: Tensor, hp: MuonHParams) -> Tensor:
    """Muon's step direction for one whole tensor: `update` as a matrix (dimension 0 by
    the rest), orthogonalized and scaled by sqrt(max(1, size(-2) / size(-1))); fp32, in
    `update`'s shape."""
    matrix = update.reshape(update.shape[0], -1)
    out = newton_schulz(matrix, hp.ns_steps, _NS_DTYPES[hp.ns_dtype]).float()
    out *= max(1.0, update.size(-2) / update.size(-1)) ** 0.5
    return out.reshape(update.shape)


def muon_direction_(grad: Tensor, momentum: Tensor, hp: MuonHParams) -> Tensor:
    """Advance `momentum` in place; returns the direction to orthogonalize (new tensor)."""
    momentum.lerp_(grad, 1 - hp.momentum)
    return grad.lerp(momentum, hp.momentum) if hp.nesterov else momentum.clone()


def adam_part(hp: MuonHParams) -> AdamHParams:
    """The AdamW hyper-parameters of the tensors Muon leaves to Adam."""
    return AdamHParams(hp.adam_lr, hp.betas, hp.eps, hp.weight_decay, True, True)


def scaled_overrides(base: MuonHParams, overrides: dict[str, Any]) -> dict[str, Any]:
    """A schedule's `lr` for Muon's tensors, and Adam's lr scaled by the same factor."""
    if "lr" in overrides and "adam_lr" not in overrides and base.lr > 0:
        overrides = {**overrides, "adam_lr": base.adam_lr * overrides["lr"] / base.lr}
    return overrides


def scheduled(base: MuonHParams, overrides: dict[str, Any]) -> MuonHParams:
    """`base` with one step's overrides, Adam's lr following a scheduled lr
    (`scaled_overrides`): Muon's `Optimizer.override`."""
    return with_overrides(base, scaled_overrides(base, overrides))


def _init(param: Tensor) -> MuonState:
    return MuonState(0, torch.zeros_like(param), torch.zeros_like(param))


def _momentum_direction_(grad: Tensor, state: MuonState, param: Tensor, hp: MuonHParams) -> Tensor:
    return muon_direction_(grad, state.exp_avg, hp)


def _apply_(param: Tensor, update: Tensor, hp: MuonHParams) -> None:
    """p = p * (1 - lr * weight_decay) - lr * O."""
    param.mul_(1 - hp.lr * hp.weight_decay).add_(update.to(param.device), alpha=-hp.lr)


def _adam_rest_(grad: Tensor, state: MuonState, param: Tensor, hp: MuonHParams) -> AdamState:
    return adam_update_(grad, AdamState(*state), param, adam_part(hp))


muon_needs = WholeTensors(
    takes=uses_muon,
    direction_=_momentum_direction_,
    whole=orthogonalized,
    apply_=_apply_,
    rest_=_adam_rest_,
)
"""Muon's hidden matrices whole (`uses_muon`): momentum on each piece, Newton-Schulz on the
whole direction, the step on each piece; AdamW on the other tensors."""


def _update_leaf_(name: str, grad: Tensor, state: MuonState, param: Tensor, hp: MuonHParams):
    """One whole tensor's step, by `muon_needs`' functions."""
    needs = muon_needs
    if not needs.takes(name, tuple(param.shape), hp):
        return MuonState(*needs.rest_(grad, state, param, hp))
    direction = needs.direction_(grad, state, param, hp)
    needs.apply_(param, needs.whole(direction, hp), hp)
    return MuonState(state.step + 1, state.exp_avg, state.exp_avg_sq)


def _name(path: tuple[Any, ...]) -> str:
    parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return ".".join(str(p) for p in parts)


def _is_state(value: Any) -> bool:
    return isinstance(value, MuonState)


def _leaves(params: Any) -> tuple[list[tuple[str, Tensor]], Any]:
    pairs, spec = pytree.tree_flatten_with_path(params)
    for path, leaf in pairs:
        if not isinstance(leaf, Tensor):
            raise TypeError(f"params leaf {_name(path)!r} is a {type(leaf).__name__}")
    return [(_name(path), leaf) for path, leaf in pairs], spec


def muon(
    lr: float = 0.02,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: str = "bf16",
    adam_lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-10,
    exclude: tuple[str, ...] = ("embed", "lm_head"),
) -> Optimizer:
    """Muon for hidden matrices, AdamW for the rest (see the module docstring); the
    defaults are the reference `MuonWithAuxAdam`'s. Over a pytree, a leaf's name is its
    path (`"layer.weight"` in a dict of dicts); a single tensor takes Muon when it has
    two or more dimensions."""
    hp = MuonHParams(
        lr, momentum, weight_decay, nesterov, ns_steps, ns_dtype, adam_lr, tuple(betas), eps,
        tuple(exclude),
    )  # fmt: skip
    _check(hp)

    def init(params: Any) -> Any:
        if isinstance(params, Tensor):
            return _init(params)
        leaves, spec = _leaves(params)
        return pytree.tree_unflatten([_init(p) for _, p in leaves], spec)

    def update_(grads: Any, state: Any, params: Any, **overrides: Any) -> Any:
        h = scheduled(hp, overrides)
        if isinstance(params, Tensor):
            return _update_leaf_("", grads, state, params, h)
        leaves, spec = _leaves(params)
        grad_leaves = pytree.tree_flatten(grads)[0]
        state_leaves = pytree.tree_flatten(state, is_leaf=_is_state)[0]
        if not len(grad_leaves) == len(state_leaves) == len(leaves):
            raise ValueError(
                f"muon: {len(leaves)} params, {len(grad_leaves)} grads and "
                f"{len(state_leaves)} states; expected one of each per tensor"
            )
        new = [
            _update_leaf_(name, g, s, p, h)
            for (name, p), g, s in zip(leaves, grad_leaves, state_leaves)
        ]
        return pytree.tree_unflatten(new, spec)

    def update(grads: Any, state: Any, params: Any, **overrides: Any) -> tuple[Any, Any]:
        params = pytree.tree_map_only(Tensor, torch.clone, params)
        state = pytree.tree_map_only(Tensor, torch.clone, state)
        return params, update_(grads, state, params, **overrides)

    return Optimizer(
        "muon", hp, init, update, update_, state_slots=2, needs=muon_needs, override=scheduled
    )


def _check(hp: MuonHParams) -> None:
    for name in ("lr", "adam_lr", "weight_decay", "eps"):
        if getattr(hp, name) < 0:
            raise ValueError(f"{name} is {getattr(hp, name)}; it must be >= 0")
    if not 0.0 <= hp.momentum < 1.0:
        raise ValueError(f"momentum is {hp.momentum}; expected a value in [0, 1)")
    if len(hp.betas) != 2 or not all(0.0 <= b < 1.0 for b in hp.betas):
        raise ValueError(f"betas is {hp.betas}; expected two values in [0, 1)")
    if hp.ns_steps < 1:
        raise ValueError(f"ns_steps is {hp.ns_steps}; expected at least 1")
    if hp.ns_dtype not in _NS_DTYPES:
        raise ValueError(f"ns_dtype is {hp.ns_dtype!r}; allowed: {sorted(_NS_DTYPES)}")
