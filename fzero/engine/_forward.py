"""The module's own hooks around its forward (first of all its hooks, so calling the
module directly trains as calling the engine does): floating inputs cast to the compute
dtype, DeepSpeed's `torch_autocast`, and in stage 3 the forward phase with its
saved-tensor hooks (`fzero.core.stage3`, over `fzero.core.gathering`)."""

from __future__ import annotations

from typing import Any

import torch

from fzero.core.gathering import Gatherer
from fzero.core.precision import cast_floats
from fzero.core.stage3 import ModuleGathering

__all__ = ["ForwardHooks"]


class ForwardHooks:
    """The root module's forward pre- and post-hooks: inputs cast to `compute_dtype`,
    bf16 autocast on `device` when `autocast`, and stage 3's forward phase (`stage3`
    driving `gatherer`; None below stage 3)."""

    def __init__(
        self,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        autocast: bool,
        gatherer: Gatherer,
        stage3: ModuleGathering | None,
    ) -> None:
        self.compute_dtype, self.device, self.autocast = compute_dtype, device, autocast
        self.gatherer, self.stage3 = gatherer, stage3
        self._contexts: list[list[Any]] = []  # per forward running now, innermost last

    def install(self, root: torch.nn.Module) -> list[Any]:
        """Register the hooks on `root`; returns their handles."""
        return [
            root.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True),
            root.register_forward_hook(self.after, always_call=True),
        ]

    def before(self, _module: Any, args: Any, kwargs: Any) -> Any:
        if self.compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), self.compute_dtype)
        contexts: list[Any] = []
        if self.autocast:  # DeepSpeed's torch_autocast (bf16)
            contexts.append(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.stage3 is not None:
            self.gatherer.begin_phase("forward")
            contexts.append(
                torch.autograd.graph.saved_tensors_hooks(self.stage3.pack, self.stage3.unpack)
            )
        for context in contexts:
            context.__enter__()
        self._contexts.append(contexts)
        return args, kwargs

    def after(self, _module: Any, _args: Any, _output: Any) -> None:
        if not self._contexts:
            return
        for context in reversed(self._contexts.pop()):
            context.__exit__(None, None, None)
        if self.stage3 is not None:
            self.gatherer.end_phase()
