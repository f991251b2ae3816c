"""Models built on the meta device (`with torch.device("meta"): ...`): weights made one
module at a time, never whole. (`fzero.init_context()` partitions a model as it is
constructed instead: `fzero.core.construction`.)

A model built on the meta device has no storage. The engine walks the
modules in `named_modules()` order — the order their constructors ran — and for
each module that holds meta tensors gives them storage and initialises them
with `param_init_fn(module)` or the module's own `reset_parameters()`, then
copies them into their unit and, in stage 3, keeps only this rank's shard.
Every rank walks the same modules with the same seed, so the global weights do
not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["MetaInitializer"]

ParamInitFn = Callable[[nn.Module], None]


class MetaInitializer:
    """Materialises a model's meta modules in construction order, on demand.

    A meta tensor cannot take storage in place, so each gets a new `Parameter`
    (or buffer) put into every module that holds it: tied weights stay tied.
    """

    def __init__(
        self, model: nn.Module, device: torch.device, param_init_fn: ParamInitFn | None
    ) -> None:
        self._model = model
        self._modules = iter(model.named_modules())
        self._device = device
        self._param_init_fn = param_init_fn
        self._holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    self._holders.setdefault(id(p), []).append((module, key))
        self._shapes: dict[int, torch.Size] = {}  # id(new parameter) -> its shape

    def until(self, fqns: list[str]) -> list[nn.Parameter]:
        """Materialise modules in order until the parameters `fqns` have storage;
        returns them (new objects where they were meta)."""
        while any(self._model.get_parameter(fqn).is_meta for fqn in fqns):
            try:
                name, module = next(self._modules)
            except StopIteration:
                raise ValueError(f"no module owns the meta parameters {fqns}") from None
            self._materialise(name, module)
        return [self._model.get_parameter(fqn) for fqn in fqns]

    def finish(self) -> None:
        """Materialise every module not reached yet (frozen layers, buffers)."""
        for name, module in self._modules:
            self._materialise(name, module)

    def _materialise(self, name: str, module: nn.Module) -> None:
        params = {k: p for k, p in module._parameters.items() if p is not None}
        buffers = {k: b for k, b in module._buffers.items() if b is not None}
        meta = [k for k, t in (*params.items(), *buffers.items()) if t.is_meta]
        if not meta:
            return
        if self._param_init_fn is None and not hasattr(module, "reset_parameters"):
            where = f"{name}.{meta[0]}" if name else meta[0]
            raise ValueError(
                f"tensor {where!r} is on the meta device and module {name or '<root>'!r} "
                f"({type(module).__name__}) has no reset_parameters(); pass "
                "param_init_fn= to initialise it"
            )
        # A parameter another module made already (a tied weight) keeps its values: in
        # eager construction the tie is made after both modules initialise, from the
        # first. It gets scratch storage of its true shape while this module initialises.
        made = {k: p.data for k, p in params.items() if not p.is_meta}
        for key, p in params.items():
            if key in made:
                p.data = torch.empty(self._shapes.get(id(p), p.shape), dtype=p.dtype)
            else:
                new = nn.Parameter(self._empty(p), requires_grad=p.requires_grad)
                self._shapes[id(new)] = p.shape
                for holder, holder_key in self._holders.get(id(p), [(module, key)]):
                    holder._parameters[holder_key] = new
        for key, b in buffers.items():
            if b.is_meta:
                module._buffers[key] = self._empty(b)
        with torch.no_grad():
            if self._param_init_fn is not None:
                self._param_init_fn(module)
            else:
                module.reset_parameters()
        for key, data in made.items():
            module._parameters[key].data = data

    def _empty(self, tensor: Tensor) -> Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=self._device)
