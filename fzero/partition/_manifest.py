"""The manifest: the ordered list of trainable tensors a plan is computed from."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Manifest", "TensorSpec", "describe", "dtype_name", "dtype_of", "leaf_modules"]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`: the spelling plans and checkpoints store."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises naming the value when it is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One trainable tensor: its name, shape, dtype and optimizer param group.

    `aliases` holds the other names of a shared (tied) parameter; the tensor is
    listed once, under the name that comes first in `named_parameters` order.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    group: int = 0
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_of(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """Ordered trainable tensors of a model, plus the names of the frozen ones."""

    tensors: tuple[TensorSpec, ...]
    frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for spec in self.tensors:
            for name in (spec.fqn, *spec.aliases):
                if name in seen:
                    raise ValueError(f"tensor name {name!r} appears twice in the manifest")
                seen.add(name)
            if any(d < 0 for d in spec.shape):
                raise ValueError(f"tensor {spec.fqn!r} has a negative dim in shape {spec.shape}")
            if spec.group < 0:
                raise ValueError(f"tensor {spec.fqn!r} has group {spec.group}; groups are >= 0")

    @property
    def numel(self) -> int:
        return sum(spec.numel for spec in self.tensors)

    def __getitem__(self, fqn: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.fqn == fqn:
                return spec
        raise KeyError(f"tensor {fqn!r} is not in the manifest")

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(spec.fqn for spec in self.tensors)


def describe(
    model: torch.nn.Module,
    param_groups: Sequence[Mapping[str, object] | Iterable[torch.nn.Parameter]] | None = None,
) -> Manifest:
    """List `model`'s trainable tensors in `named_parameters` order.

    Works on a model on the `meta` device (reads shapes only) and on one partitioned at
    construction (`ds_shape`). A parameter shared
    between modules is listed once, with its other names in `aliases`. Parameters
    with `requires_grad=False` go to `Manifest.frozen`.

    `param_groups`, as given to a `torch.optim` optimizer (a list of dicts with a
    `"params"` key, or of parameter iterables), sets each tensor's `group` index.
    As with `torch.optim`, a trainable parameter in no group is not optimized: it
    is listed in `frozen`. Without `param_groups` everything is group 0.
    """
    group_of = _group_index(param_groups)
    by_identity: dict[int, tuple[str, list[str]]] = {}
    order: list[int] = []
    frozen: list[str] = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in by_identity:
            by_identity[key][1].append(fqn)
            continue
        by_identity[key] = (fqn, [])
        if param.requires_grad and (group_of is None or key in group_of):
            order.append(key)
        else:
            frozen.append(fqn)
    params = {id(p): p for p in model.parameters()}
    tensors = tuple(
        TensorSpec(
            fqn=by_identity[key][0],
            shape=_shape(params[key]),
            dtype=dtype_name(params[key].dtype),
            group=0 if group_of is None else group_of[key],
            aliases=tuple(by_identity[key][1]),
        )
        for key in order
    )
    return Manifest(tensors=tensors, frozen=tuple(frozen))


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape: DeepSpeed's `ds_shape` where a ZeRO-3 partition or engine
    holds it (its own data is then empty), else its own."""
    shape = param.__dict__.get("ds_shape")
    return tuple(shape) if shape is not None else tuple(param.shape)


def _group_index(
    param_groups: Sequence[Mapping[str, object] | Iterable[torch.nn.Parameter]] | None,
) -> dict[int, int] | None:
    if param_groups is None:
        return None
    group_of: dict[int, int] = {}
    for index, group in enumerate(param_groups):
        params = group["params"] if isinstance(group, Mapping) else group
        if isinstance(params, torch.Tensor):
            params = [params]
        for param in params:  # type: ignore[union-attr]
            if id(param) in group_of:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is in param groups "
                    f"{group_of[id(param)]} and {index}; each belongs to one group"
                )
            group_of[id(param)] = index
    return group_of


def leaf_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The paths of `model`'s submodules flagged as ZeRO-3 leaves (DeepSpeed's
    `deepspeed.utils.set_z3_leaf_modules`, attribute `_z3_leaf`; "" is the model),
    for a strategy's `leaf_modules` option: each one's parameters share a unit."""
    return tuple(name for name, m in model.named_modules() if getattr(m, "_z3_leaf", False))
