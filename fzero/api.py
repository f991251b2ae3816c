"""The two front doors: functional `shard` and DeepSpeed-compatible `initialize`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fzero import comm
from fzero.config import Config, ConfigError, load_config
from fzero.engine import Engine
from fzero.engine_optimizer import EngineOptimizer
from fzero.optim import Optimizer, adam, adamw, optimizer_from_name, schedule_from_name, sgd
from fzero.partition import Plan

__all__ = ["gathered_parameters", "initialize", "shard"]

log = logging.getLogger("fzero")


def _config(config: Config | Mapping[str, Any] | str | None) -> Config:
    return load_config(config if config is not None else {})


def _param_groups(model_parameters: Iterable[Any] | None) -> list[dict[str, Any]] | None:
    """`model_parameters` as torch param-group dicts (DeepSpeed accepts tensors or dicts)."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty; pass the parameters to train")
    if all(isinstance(item, Mapping) for item in items):
        return [dict(item) for item in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise TypeError("model_parameters must be an iterable of tensors or of param-group dicts")


def _from_client(client: torch.optim.Optimizer) -> tuple[Optimizer, list[dict[str, Any]]]:
    """A functional optimizer equivalent to a `torch.optim` instance, and its groups."""
    kind = type(client).__name__
    keep = {
        "Adam": ("lr", "betas", "eps", "weight_decay"),
        "AdamW": ("lr", "betas", "eps", "weight_decay"),
        "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    }
    if kind not in keep:
        raise TypeError(
            f"client optimizer {kind} is not supported; allowed: torch.optim.Adam, AdamW, SGD "
            "(or configure Adam/AdamW/Lamb/SGD in the config)"
        )
    for group in client.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"client optimizer {kind} with {flag}=True is not supported")
    defaults = {k: client.defaults[k] for k in keep[kind]}
    base = {"Adam": adam, "AdamW": adamw, "SGD": sgd}[kind](**defaults)
    groups = [
        {"params": g["params"], **{k: g[k] for k in keep[kind] if k != "lr"}}
        for g in client.param_groups
    ]
    return base, groups


def shard(
    model: torch.nn.Module,
    stage: int | None = None,
    optimizer: Optimizer | None = None,
    *,
    precision: str | None = None,
    config: Config | Mapping[str, Any] | str | None = None,
    strategy: Callable[..., Plan] | None = None,
    param_groups: Iterable[Any] | None = None,
    schedule: Callable[[int, float], float] | None = None,
    param_init_fn: Callable[[torch.nn.Module], None] | None = None,
    name: str | None = None,
) -> Engine:
    """Shard `model` with ZeRO `stage` and train it with a functional `optimizer`.

    `stage` overrides the config's `zero_optimization.stage`; `precision`
    ("fp32", "bf16", "fp16") overrides its fp16/bf16 blocks; `strategy` is any
    partitioning function (default `fzero.partition.flat_even`). A model built on
    the meta device (`fzero.init_context()`) is initialised module by module with
    `param_init_fn(module)`, or each module's `reset_parameters()`. `name` labels the
    engine's log lines (default: the model's class).
    """
    if stage is not None and stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage is {stage!r}; allowed: 0, 1, 2, 3")
    if stage is not None and isinstance(config, Mapping | None):
        # validated with the stage it runs at (offload needs stage >= 1)
        config = dict(config or {})
        config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": stage}
    cfg = _config(config)
    if stage is not None:
        cfg = dataclasses.replace(
            cfg, zero_optimization=dataclasses.replace(cfg.zero_optimization, stage=stage)
        )
    if optimizer is None:
        optimizer = (
            optimizer_from_name(cfg.optimizer.type, cfg.optimizer.params)
            if cfg.optimizer
            else adamw()
        )
    if schedule is None and cfg.scheduler is not None:
        schedule = schedule_from_name(cfg.scheduler.type, cfg.scheduler.params)
    return Engine(
        model,
        optimizer=optimizer,
        config=cfg,
        param_groups=_param_groups(param_groups),
        precision=precision,
        strategy=strategy,
        schedule=schedule,
        param_init_fn=param_init_fn,
        name=name,
    )


def _with_deepspeed_defaults(cfg: Config, source: Any) -> Config:
    """DeepSpeed's defaults where they differ from fzero's: a config that does not name
    `gradient_clipping` clips at 1.0 (DeepSpeed since 0.19, `GRADIENT_CLIPPING_DEFAULT`),
    so a DeepSpeed script trains as under DeepSpeed. `fzero.shard` and `train_step` clip
    only when asked, as torch does."""
    if isinstance(source, Config):
        return cfg
    raw = source
    if not isinstance(raw, Mapping):
        raw = json.loads(Path(source).read_text())  # load_config read it already
    params = (raw.get("optimizer") or {}).get("params") or {}
    if "gradient_clipping" in raw or "max_grad_norm" in params:
        return cfg
    log.info("fzero: gradient_clipping not in the config: 1.0, DeepSpeed's default (0: none)")
    return dataclasses.replace(cfg, gradient_clipping=1.0)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Optimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Config | Mapping[str, Any] | str | None = None,
    config_params: Mapping[str, Any] | None = None,
    param_init_fn: Callable[[torch.nn.Module], None] | None = None,
    name: str | None = None,
) -> tuple[Engine, EngineOptimizer, torch.utils.data.DataLoader | None, Any]:
    """DeepSpeed's `deepspeed.initialize`, same arguments and returns.

    Returns `(engine, optimizer, dataloader, lr_scheduler)`. The config comes
    from `config`/`config_params` or `args.deepspeed_config` / `args.fzero_config`.
    A client `torch.optim` optimizer (Adam, AdamW, SGD) is run as fzero's
    functional equivalent with its hyper-parameters and param groups.

    The scheduler is DeepSpeed's: `lr_scheduler` (an object, or a callable given the
    optimizer) wins over the config's `scheduler` block; with neither it is None, and a
    client steps its own. The engine steps `engine.lr_scheduler` after each applied
    optimizer step; assign it (None, or another scheduler) to change that. The
    returned optimizer acts on the engine (`step()` is `engine.step()`; `param_groups` are live; see
    `fzero.engine_optimizer`). `param_init_fn` and `name` as in `shard`.
    """
    if model is None:
        raise ValueError("initialize needs model=")
    if mpu is not None:
        raise NotImplementedError("mpu (model parallelism) is not supported yet")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "fzero_config", None) or getattr(args, "deepspeed_config", None)
    if source is None:
        raise ConfigError(
            "no config: pass config=... or set args.deepspeed_config / args.fzero_config"
        )
    comm.init_distributed(required=dist_init_required)
    cfg = _with_deepspeed_defaults(_config(source), source)
    if getattr(args, "metrics_file", None):
        cfg = dataclasses.replace(cfg, metrics_file=args.metrics_file)
    if getattr(args, "no_progress", False):
        cfg = dataclasses.replace(cfg, progress=False)
    groups = _param_groups(model_parameters)
    client = None
    if isinstance(optimizer, torch.optim.Optimizer):
        client = optimizer
        functional, groups = _from_client(optimizer)
    elif isinstance(optimizer, Optimizer):
        functional = optimizer
    elif optimizer is None:  # none at all: an engine that runs forward only (as DeepSpeed)
        functional = (
            optimizer_from_name(cfg.optimizer.type, cfg.optimizer.params) if cfg.optimizer else None
        )
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or fzero.optim.Optimizer, "
            f"found {type(optimizer).__name__}"
        )
    # DeepSpeed's `_configure_lr_scheduler`: the argument wins over the config's block
    # (a scheduler object as it is, a callable called with the optimizer), the config's
    # block builds one, else there is none; the engine steps `engine.lr_scheduler`
    schedule = None
    if lr_scheduler is None and cfg.scheduler is not None:
        schedule = schedule_from_name(cfg.scheduler.type, cfg.scheduler.params)
    factory = lr_scheduler if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else None
    if lr_scheduler is not None and client is None and factory is None:
        raise ValueError(
            "a client lr_scheduler object needs a client torch.optim optimizer to drive; "
            "pass a callable optimizer -> scheduler instead to schedule fzero's optimizer"
        )
    engine = Engine(
        model,
        optimizer=functional,
        config=cfg,
        param_groups=groups,
        schedule=schedule,
        client_optimizer=client,
        lr_scheduler=lr_scheduler if factory is None else None,
        param_init_fn=param_init_fn,
        name=name,
    )
    if factory is not None and functional is not None:
        engine.lr_scheduler = factory(engine.optimizer)
    loader = None
    if training_data is not None:
        if engine.batch is None:
            raise ConfigError("training_data needs a batch size in the config")
        sampler = torch.utils.data.DistributedSampler(
            training_data, num_replicas=dist.get_world_size(), rank=dist.get_rank()
        )
        loader = torch.utils.data.DataLoader(
            training_data,
            batch_size=engine.batch.micro_batch_size,
            sampler=sampler,
            drop_last=cfg.dataloader_drop_last,
            collate_fn=collate_fn,
        )
    return engine, engine.optimizer, loader, engine.lr_scheduler


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
            dist.broadcast(value, src=modifier_rank)
            if value.data_ptr() != p.data.data_ptr():
                p.data.copy_(value)
