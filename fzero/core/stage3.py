"""Stage 3 under module hooks: the engine's driver of the `Gatherer`
(`fzero.core.gathering`, which decides everything about gathering).

ZeRO-3 as DeepSpeed runs it: forward pre-hooks on the modules use their units, post-hooks
release them unless the `Gatherer` keeps them (their next use is close, or a forward
without gradients within `stage3_eval_live_parameters`); a saved-tensor hook keeps
references to parameters instead of their full values, so backward uses them again. A
used unit's buffer is what the module's parameters view (`bind`); a released one leaves
them empty. `train_step` drives the same `Gatherer` through placeholders
(`fzero.core.gather`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero.core.gathering import Gatherer
from fzero.core.layout import UnitRuntime

__all__ = ["ModuleGathering"]


class ModuleGathering:
    """The hooks by which `root`'s modules drive `gatherer` over the engine's `units`.
    `on_backward_use()` is called when backward first needs a parameter
    (the engine's reduction learns of an autograd pass that is not its own)."""

    def __init__(
        self,
        gatherer: Gatherer,
        units: Sequence[UnitRuntime],
        root: torch.nn.Module,
        *,
        on_backward_use: Callable[[], None],
    ) -> None:
        self.gatherer, self.units = gatherer, list(units)
        self.on_backward_use = on_backward_use
        self._params = {id(p): rt for rt in self.units for p, _, _ in rt.params}
        self.hooks: list[Any] = []
        self._install(root)

    # ---- hooks ------------------------------------------------------------------------------

    def _install(self, root: torch.nn.Module) -> None:
        """Use each module's units before its forward, release them after (unless kept, or
        an enclosing module's forward still holds them); shape stand-ins for released
        parameters' gradients.

        A unit hangs on its module and on every module holding one of its parameters
        directly (or by `register_external_parameter`): a tied weight (T5's `shared` in
        `encoder.embed_tokens` and `lm_head`) is gathered whichever holder runs, also when
        a caller runs a submodule on its own (`generate` runs the encoder alone)."""
        holders: dict[int, list[torch.nn.Module]] = {}
        for module in root.modules():
            # DeepSpeed's `register_external_parameter`: a module that uses another's
            # parameter in its forward holds it too
            external = getattr(module, "_external_params", {})
            for p in (*module._parameters.values(), *external.values()):
                if p is not None:
                    holders.setdefault(id(p), []).append(module)
        by_module: dict[int, tuple[torch.nn.Module, list[int]]] = {}
        plan = self.gatherer.plan
        for rt in self.units:
            if plan.stage_of(rt.unit) < 3:  # whole: persistent, or a unit below stage 3
                continue
            modules = [root.get_submodule(rt.unit.module)]
            modules += [m for p, _, _ in rt.params for m in holders.get(id(p), [])]
            for module in modules:
                indices = by_module.setdefault(id(module), (module, []))[1]
                if rt.index not in indices:
                    indices.append(rt.index)
        for module, indices in by_module.values():
            pre, post = _eager(self._pre(indices)), _eager(self._post(indices))
            self.hooks.append(module.register_forward_pre_hook(pre))
            self.hooks.append(module.register_forward_hook(post, always_call=True))
        for rt in self.units:
            if plan.stage_of(rt.unit) == 3:
                for p, _, shape in rt.params:
                    self.hooks.append(p.register_hook(_shape_for_accumulation(p, shape)))

    def _pre(self, indices: list[int]) -> Callable[..., None]:
        gatherer = self.gatherer

        def pre(_module: Any, _inputs: Any) -> None:
            for index in indices:
                gatherer.units[index].active += 1
                gatherer.use(index)

        return pre

    def _post(self, indices: list[int]) -> Callable[..., None]:
        gatherer = self.gatherer

        def post(_module: Any, _inputs: Any, _output: Any) -> None:
            for index in indices:
                g = gatherer.units[index]
                g.active = max(0, g.active - 1)
            # In backward (activation-checkpoint recomputation) autograd holds the
            # parameters themselves: they are released when their gradients arrive.
            # Outside any pass (a submodule run alone after a step: `generate`'s
            # encoder) they are released as in forward.
            if gatherer.phase != "forward" and torch._C._current_graph_task_id() != -1:
                return
            for index in indices:
                if gatherer.units[index].active == 0 and not gatherer.keeps(index):
                    gatherer.release(index)

        return post

    def pack(self, tensor: Tensor) -> Any:
        """Saved-tensor hook: a saved stage-3 parameter (or a view of one) is kept as a
        reference and used again when backward needs it, so no full unit stays alive."""
        base = tensor._base if tensor._base is not None else tensor
        rt = self._params.get(id(base))
        if rt is None or self.gatherer.plan.stage_of(rt.unit) < 3:
            return tensor
        if base is tensor:
            return ("param", tensor, None)
        return (
            "view",
            base,
            (tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset()),
        )

    def unpack(self, packed: Any) -> Tensor:
        """Saved-tensor hook: the parameter a backward node needs, gathered again."""
        if not isinstance(packed, tuple):
            return packed
        kind, param, geometry = packed
        self.on_backward_use()  # the engine learns of the autograd pass (it frees units)
        self.gatherer.use(self._params[id(param)].index)
        if kind == "param":
            return param
        size, stride, offset = geometry
        return param.detach().as_strided(size, stride, param.storage_offset() + offset)


def _eager(hook: Callable[..., None]) -> Callable[..., None]:
    """`hook` run as Python even inside `torch.compile(model)`: gathering and releasing
    swap parameters' storage, which a traced graph would bake in (at one rank, with no
    collective to break the graph, dynamo would otherwise trace it)."""
    return torch.compiler.disable(hook, recursive=True)


def _shape_for_accumulation(p: torch.nn.Parameter, shape: tuple[int, ...]) -> Callable:
    """Before autograd stores a gradient in `p.grad` it matches it to `p`'s layout; a
    released parameter gets a zero-stride stand-in of the right shape (no memory). The
    hook holds `p` weakly: torch keeps it from C++, out of the collector's sight."""
    ref = weakref.ref(p)

    def hook(grad: Tensor) -> None:
        p = ref()
        if p is not None and p.data.shape != shape:
            p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(shape)

    return hook
