"""The module's own hooks around its forward (first of all its hooks, so calling the
module directly trains as calling the engine does): floating inputs cast to the compute
dtype, DeepSpeed's `torch_autocast`, and in stage 3 the forward phase with its
saved-tensor hooks (`fzero.core.stage3`, over `fzero.core.gathering`)."""

from __future__ import annotations

from typing import Any

import torch

from fzero.core.precision import cast_floats

__all__ = ["ForwardHooks"]

Engine = Any  # fzero.engine.Engine (this module sits below it)


class ForwardHooks:
    """The root module's forward pre- and post-hooks of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._contexts: list[list[Any]] = []  # per forward running now, innermost last

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles."""
        root = self.engine.module
        return [
            root.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True),
            root.register_forward_hook(self.after, always_call=True),
        ]

    def before(self, _module: Any, args: Any, kwargs: Any) -> Any:
        engine = self.engine
        if engine.compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), engine.compute_dtype)
        contexts: list[Any] = []
        if engine.config.torch_autocast.enabled:  # DeepSpeed's torch_autocast (bf16)
            contexts.append(torch.autocast(engine.device.type, dtype=torch.bfloat16))
        if engine.stage3 is not None:
            stage3 = engine.stage3
            engine.gatherer.begin_phase("forward")
            contexts.append(torch.autograd.graph.saved_tensors_hooks(stage3.pack, stage3.unpack))
        for context in contexts:
            context.__enter__()
        self._contexts.append(contexts)
        return args, kwargs

    def after(self, _module: Any, _args: Any, _output: Any) -> None:
        if not self._contexts:
            return
        for context in reversed(self._contexts.pop()):
            context.__exit__(None, None, None)
        if self.engine.stage3 is not None:
            self.engine.gatherer.end_phase()
