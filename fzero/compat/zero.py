"""DeepSpeed's `deepspeed.zero` names over fzero's own: `Init` and `GatheredParameters`.

`Init` has DeepSpeed's results without its mechanism: the model built inside is built
whole on the host, as if there were no context, and sharded when the engine is built.
DeepSpeed partitions each module at the end of its constructor, so what a parent's
constructor does to its children's tensors acts on placeholders, and Transformers
initialises and loads such models afterwards through `GatheredParameters(...,
modifier_rank=0)`; fzero runs those blocks on real tensors, and `GatheredParameters`
broadcasts rank `modifier_rank`'s edits of parameters no engine holds yet, so every
rank ends with rank 0's weights as under DeepSpeed. The model is whole in host memory
until the engine shards it; to never build it whole, use `fzero.init_context()` (the
meta device, each module initialised by its `reset_parameters()` when sharded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fzero import comm
from fzero.engine.zero3_attributes import ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "gathered_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `deepspeed.zero.Init(...)`: the model built inside is the one built
    without it (whole, on the host); `fzero.initialize` / `fzero.shard` shards it.

    DeepSpeed's arguments are accepted and change nothing: where shards live is the
    config's `offload_param`, read when the engine is built; `dtype` (DeepSpeed builds
    the partitions in it) is not applied, since fzero's fp32 masters start from the
    values built. `module=` (partition a built model) and `mpu=` are errors.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **_: Any,
    ) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...) partitions an already built model; fzero shards it "
                "when the engine is built: pass the model to fzero.initialize instead"
            )
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(
                f"zero.Init remote_device is {remote_device!r}; allowed: None, 'cpu', 'nvme'"
            )
        self.enabled = enabled

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def GatheredParameters(  # DeepSpeed's name
    params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: torch.nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """DeepSpeed's `zero.GatheredParameters`: `fzero.gathered_parameters` under its name."""
    with gathered_parameters(params, modifier_rank=modifier_rank, enabled=enabled):
        yield


def _check_external(module: torch.nn.Module, parameter: Any, verb: str) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(f"{verb}_external_parameter: Parameter is not a torch.nn.Parameter")
    ref = getattr(parameter, "_fzero_engine", None)
    engine = ref() if ref is not None else None
    if engine is not None and engine.stage == 3:
        raise RuntimeError(
            f"{verb}_external_parameter({type(module).__name__}, parameter of shape "
            f"{tuple(getattr(parameter, 'ds_shape', parameter.shape))}) after the ZeRO-3 engine "
            "was built: fzero reads these registrations when it builds the engine; register "
            "in the module's constructor (as Transformers does) or before fzero.initialize"
        )


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's: `module`'s forward uses `parameter`, which another module holds; at
    ZeRO-3 the engine gathers it whenever `module` runs. Register before the engine is
    built (in the module's constructor, as Transformers does)."""
    _check_external(module, parameter, "register")
    if "_external_params" not in module.__dict__:
        module._external_params = {}
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo `register_external_parameter` (before the engine is built)."""
    _check_external(module, parameter, "unregister")
    registered = module.__dict__.get("_external_params", {})
    if id(parameter) not in registered:
        raise RuntimeError(
            f"unregister_external_parameter: the parameter of shape {tuple(parameter.shape)} "
            f"is not registered with {type(module).__name__}"
        )
    del registered[id(parameter)]


def gathered_parameters(
    params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
    modifier_rank: int | None = None,
    enabled: bool = True,
) -> contextlib.AbstractContextManager[None]:
    """DeepSpeed's `zero.GatheredParameters`: inside the block the `params` of an fzero
    engine are whole on every rank; with `modifier_rank`, that rank's edits are
    broadcast on exit and kept. Collective. Parameters no engine holds yet (a model
    built for `fzero.initialize`, as Transformers initialises and loads one under
    ZeRO-3) are whole already; with `modifier_rank` that rank's values are broadcast to
    every rank on exit, as DeepSpeed's re-partitioning would leave them.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    refs = {id(ref()): ref() for p in params if (ref := getattr(p, "_fzero_engine", None))}
    engines = [engine for engine in refs.values() if engine is not None]
    if not enabled:
        return contextlib.nullcontext()
    if not engines:
        return _broadcast_on_exit(params, modifier_rank)
    if len(engines) > 1:
        raise ValueError("gathered_parameters got parameters of more than one fzero engine")
    return engines[0].gathered_parameters(params, modifier_rank)


@contextlib.contextmanager
def _broadcast_on_exit(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Rank `modifier_rank`'s values of `params` on every rank after the block (nothing
    without a modifier, a process group or a second rank)."""
    meta = [i for i, p in enumerate(params) if p.is_meta]
    if modifier_rank is not None and meta:
        raise ValueError(
            f"GatheredParameters(modifier_rank={modifier_rank}) got parameter {meta[0]} "
            f"(shape {tuple(params[meta[0]].shape)}) on the meta device: built inside "
            "fzero.init_context(), it has no values until the engine builds it; build the "
            "model without it (deepspeed.zero.Init builds it whole) to edit it before"
        )
    yield
    if modifier_rank is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    with torch.no_grad():
        for p in params:
            value = p.data.to(comm.backend_device()).contiguous()
            comm.broadcast_from(value, modifier_rank, what="an edited parameter")
            if value.data_ptr() != p.data.data_ptr():
                p.data.copy_(value)
