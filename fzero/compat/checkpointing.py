"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`).

    fzero.compat.checkpointing.configure(None, deepspeed_config="ds_config.json")
    h = fzero.compat.checkpointing.checkpoint(block, h)

Built on PyTorch's non-reentrant `torch.utils.checkpoint`: the block's
activations are dropped after forward and recomputed in backward. Under ZeRO
stage 3 the recomputation runs the block's forward again, so fzero gathers its
parameters again through the same hooks.

Of the config's `activation_checkpointing` block, what means something without
model parallelism is implemented: `cpu_checkpointing` (the saved block inputs
live in host memory), `synchronize_checkpoint_boundary` (a device
synchronisation around each block, for timing), `profile` (forward and
recomputation time per block, see `timings()`), `number_checkpoints`
(recorded). `partition_activations` and `contiguous_memory_optimization` split
activations across model-parallel ranks; fzero has none, so they are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint

from fzero.config import ActivationCheckpointingConfig, Config, ConfigError, load_config
from fzero.core.gather import resolve_placeholder

__all__ = ["checkpoint", "configure", "is_configured", "reset", "settings", "timings"]

_settings: ActivationCheckpointingConfig | None = None
_timings: dict[str, float] = {}


def configure(
    mpu_: Any = None,
    deepspeed_config: Config | Mapping[str, Any] | str | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> ActivationCheckpointingConfig:
    """Set how `checkpoint` behaves (DeepSpeed's signature): the config's
    `activation_checkpointing` block, with any keyword given overriding it."""
    global _settings
    if mpu_ is not None:
        raise ConfigError("checkpointing.configure: mpu_ (model parallelism) is not supported")
    base = ActivationCheckpointingConfig()
    if deepspeed_config is not None:
        source = deepspeed_config
        base = (
            source if isinstance(source, Config) else load_config(source)
        ).activation_checkpointing
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    chosen = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    for key in ("partition_activations", "contiguous_memory_optimization"):
        if getattr(chosen, key):
            raise ConfigError(
                f"activation_checkpointing.{key} is true; it splits activations across "
                "model-parallel ranks and fzero is data-parallel only: allowed value false"
            )
    if chosen.number_checkpoints is not None and chosen.number_checkpoints < 1:
        raise ConfigError(
            f"activation_checkpointing.number_checkpoints is {chosen.number_checkpoints}; "
            "it must be >= 1 or null"
        )
    _settings = chosen
    return chosen


def is_configured() -> bool:
    """Whether `configure` has been called (DeepSpeed's `is_configured`)."""
    return _settings is not None


def reset() -> None:
    """Forget `configure` and the timings."""
    global _settings
    _settings = None
    _timings.clear()


def settings() -> ActivationCheckpointingConfig:
    """The settings `checkpoint` uses now (the defaults until `configure`)."""
    return _settings or ActivationCheckpointingConfig()


def timings() -> dict[str, float]:
    """With `profile`: total seconds spent in checkpointed forwards and recomputations."""
    return dict(_timings)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` without keeping its activations: they are
    recomputed when backward needs them (non-reentrant `torch.utils.checkpoint`).

    Under `torch.func.functional_call` (as in a `fzero.train_step` loss_fn), a module's
    tensors are swapped in only while the call runs, so a recomputation in backward
    would read the module's own, stale ones: when `function` is a module (or its
    `__call__`/`forward`), the tensors it held at forward are put back for the
    recomputation (stage 3's placeholders as their gathered parameters)."""
    chosen = settings()
    module = _swapped_module(function)
    held = None
    if module is not None:
        held = dict(module.named_parameters(remove_duplicate=False))
        held.update(module.named_buffers(remove_duplicate=False))
    saving = (
        torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        if chosen.cpu_checkpointing
        else contextlib.nullcontext()
    )
    timed = _timed if chosen.profile or chosen.synchronize_checkpoint_boundary else None

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        recomputing = torch.is_grad_enabled() and _recomputing()
        call = function
        if recomputing and held is not None:
            call = functools.partial(_call_with, module, held)
        if timed is None:
            return call(*inner_args, **inner_kwargs)
        with timed("recompute" if recomputing else "forward", chosen):
            return call(*inner_args, **inner_kwargs)

    with saving:
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _swapped_module(function: Callable[..., Any]) -> torch.nn.Module | None:
    """The module `function` runs (the module itself, or its `__call__`/`forward`) when
    `torch.func.functional_call` has swapped tensors into it now; else None."""
    module = function if isinstance(function, torch.nn.Module) else None
    if module is None and getattr(function, "__name__", "") in ("__call__", "forward"):
        owner = getattr(function, "__self__", None)
        module = owner if isinstance(owner, torch.nn.Module) else None
    if module is None:
        return None
    swapped = any(not isinstance(p, torch.nn.Parameter) for p in module.parameters())
    return module if swapped else None


def _call_with(module: torch.nn.Module, held: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)` over the tensors it held at forward."""
    tensors = {name: resolve_placeholder(value) for name, value in held.items()}
    return torch.func.functional_call(module, tensors, args, kwargs)


def _recomputing() -> bool:
    """True inside backward (autograd is running a backward graph task)."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _timed(phase: str, chosen: ActivationCheckpointingConfig) -> Iterator[None]:
    if chosen.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if chosen.synchronize_checkpoint_boundary and torch.cuda.is_available():
            torch.cuda.synchronize()
        if chosen.profile:
            _timings[phase] = _timings.get(phase, 0.0) + time.perf_counter() - start
