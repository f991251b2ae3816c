"""DeepSpeed's `deepspeed.zero` names over fzero's own: `Init` and `GatheredParameters`.

`Init` is `fzero.init_context` (`fzero.core.construction`) with DeepSpeed's arguments:
each module's parameters are partitioned as its constructor returns, carrying
DeepSpeed's attributes (`ds_tensor`, `ds_shape`, `ds_numel`, `ds_status`, `ds_id`,
`ds_persist`), so a parent's constructor sees its children's parameters as placeholders,
and Transformers initialises and loads such a model afterwards through
`GatheredParameters(..., modifier_rank=0)`: inside it the parameters are whole on every
rank, and on exit rank `modifier_rank`'s values become the partitions — read by every
rank from the file where rank 0 copied them from a memory-mapped checkpoint
(`fzero.core.partitioned`). `initialize` adopts the partitions unit by unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fzero import comm
from fzero.config import AUTO, load_config
from fzero.core.construction import Construction
from fzero.core.partitioned import (
    gathered_partitions,
    is_partitioned,
    partition_parameters,
    shape_of,
)
from fzero.engine.zero3_attributes import ZeroParamStatus
from fzero.partition import DEFAULT_PERSISTENCE_THRESHOLD

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "gathered_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Init(Construction, contextlib.ContextDecorator):
    """DeepSpeed's `deepspeed.zero.Init(...)`: modules constructed inside are partitioned
    over every rank as their constructors return (`fzero.init_context`); starts the
    process group when none runs, as DeepSpeed's does.

    As DeepSpeed: the config (`config_dict_or_path`, or the deprecated `config`) sets the
    partitions' `dtype` (bf16 or fp16 when enabled there, else fp32) unless `dtype` is
    given, and its `offload_param` block (`device`, `nvme_path`, `pin_memory`) overrides
    `remote_device` and `pin_memory`. Without `dtype` or a config, parameters keep the
    dtype they are built in (DeepSpeed picks fp16 or bf16 from the accelerator).
    `module.apply(fn)` inside sees whole parameters unless the config's
    `zero_optimization.override_module_apply` is false (DeepSpeed's).
    `module=` partitions an already built model now. `data_parallel_group` other than
    every rank, and `mpu`, are refused by name."""

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
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        if data_parallel_group is not None and (
            not dist.is_initialized()
            or dist.get_world_size(data_parallel_group) != dist.get_world_size()
        ):
            raise NotImplementedError(
                "zero.Init(data_parallel_group=...) with a group of fewer than every rank: "
                "fzero partitions over every rank (use a plan on a mesh for groups)"
            )
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"zero.Init dtype is {dtype}; allowed: {list(_DTYPES)}")
        nvme_path, threshold, override_apply = None, 0, True
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            cfg = load_config(source)
            if dtype is None:
                dtype = torch.float32
                if cfg.bf16.enabled is True:
                    dtype = torch.bfloat16
                elif cfg.fp16.enabled is True:
                    dtype = torch.float16
            zero = cfg.zero_optimization
            if zero.offload_param.device != "none" or remote_device is None:
                remote_device = zero.offload_param.device
                pin_memory = zero.offload_param.pin_memory
            nvme_path = zero.offload_param.nvme_path
            threshold = zero.stage3_param_persistence_threshold
            # "auto" (Transformers fills it once the model exists, after this context):
            # DeepSpeed's default; the engine adopts the partitions whatever its own
            threshold = DEFAULT_PERSISTENCE_THRESHOLD if threshold == AUTO else int(threshold)
            override_apply = zero.override_module_apply
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(
                f"zero.Init remote_device is {remote_device!r}; allowed: None, 'cpu', 'nvme'"
            )
        if remote_device == "nvme" and not nvme_path:
            raise ValueError(
                "zero.Init remote_device 'nvme' needs the config's "
                "zero_optimization.offload_param.nvme_path (the partitions' directory)"
            )
        super().__init__(
            dtype=dtype,
            remote_device=remote_device,
            pin_memory=pin_memory,
            nvme_path=nvme_path,
            persistence_threshold=threshold,
            enabled=enabled,
            override_module_apply=override_apply,
        )
        if module is not None and enabled:  # DeepSpeed's: partition a built model now
            with self:
                pass
            assert self.store is not None
            for name, child in module.named_modules():
                partition_parameters(
                    [p for p in child._parameters.values() if p is not None],
                    self.store,
                    dtype=self.dtype,
                    persistence_threshold=threshold,
                    what=f"the parameters of {name or 'the model'}",
                )


@contextlib.contextmanager
def GatheredParameters(  # DeepSpeed's name
    params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: torch.nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """DeepSpeed's `zero.GatheredParameters`: `fzero.gathered_parameters` under its name;
    with `fwd_module`, the parameters are registered as its external parameters (used in
    its forward), as DeepSpeed does."""
    if fwd_module is not None and enabled:
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in listed:
            if is_partitioned(p) or "_fzero_engine" not in p.__dict__:
                register_external_parameter(fwd_module, p)
        params = listed
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
            f"{shape_of(parameter)}) after the ZeRO-3 engine "
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
    """DeepSpeed's `zero.GatheredParameters`: inside the block `params` are whole on
    every rank; with `modifier_rank`, that rank's edits are kept on exit (collective).
    Parameters of an fzero engine are gathered by it; parameters partitioned at
    construction (`fzero.init_context`, `deepspeed.zero.Init`) are gathered from their
    partitions, and a modifier's copy of a memory-mapped checkpoint tensor into one is
    read by every rank from the file, its own part only; other parameters are whole
    already, and with `modifier_rank` that rank's values are broadcast to every rank on
    exit, as DeepSpeed's re-partitioning would leave them.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled:
        return contextlib.nullcontext()
    refs = {id(ref()): ref() for p in params if (ref := getattr(p, "_fzero_engine", None))}
    engines = [engine for engine in refs.values() if engine is not None]
    if len(engines) > 1:
        raise ValueError("gathered_parameters got parameters of more than one fzero engine")
    return _gathered(params, engines[0] if engines else None, modifier_rank)


class _GathersParameters(Protocol):
    """What `gathered_parameters` reads of the engine holding parameters."""

    def gathered_parameters(
        self, params: list[Any], modifier_rank: int | None
    ) -> contextlib.AbstractContextManager[None]: ...


@contextlib.contextmanager
def _gathered(
    params: list[Any], engine: _GathersParameters | None, modifier_rank: int | None
) -> Iterator[None]:
    held = {id(p) for p in params if getattr(p, "_fzero_engine", None) is not None}
    partitioned = [p for p in params if is_partitioned(p)]
    plain = [p for p in params if id(p) not in held and not is_partitioned(p)]
    with contextlib.ExitStack() as stack:
        if engine is not None:  # its frozen parameters too: whole on every rank
            stack.enter_context(engine.gathered_parameters(params, modifier_rank))
        if partitioned:
            stack.enter_context(gathered_partitions(partitioned, modifier_rank))
        if plain and engine is None:
            stack.enter_context(_broadcast_on_exit(plain, modifier_rank))
        yield


@contextlib.contextmanager
def _broadcast_on_exit(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Rank `modifier_rank`'s values of `params` on every rank after the block (nothing
    without a modifier, a process group or a second rank)."""
    meta = [i for i, p in enumerate(params) if p.is_meta]
    if modifier_rank is not None and meta:
        raise ValueError(
            f"GatheredParameters(modifier_rank={modifier_rank}) got parameter {meta[0]} "
            f"(shape {tuple(params[meta[0]].shape)}) on the meta device: it has no values "
            "until the engine builds it; build the model inside fzero.init_context() or "
            "deepspeed.zero.Init (partitioned, with values) to edit it before"
        )
    yield
    if modifier_rank is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    with torch.no_grad():
        for p in params:
            value = p.data.to(comm.backend_device()).contiguous()
            comm.broadcast_from(value, src=modifier_rank, what=f"rank {modifier_rank}'s edits")
            if value.data_ptr() != p.data.data_ptr():
                p.data.copy_(value)
