"""DeepSpeed's `deepspeed.initialize`, over fzero's engine."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fzero import comm
from fzero.config import Config, ConfigError
from fzero.core.init import optimizer_of, schedule_of
from fzero.engine import Engine
from fzero.engine.entry import config_of, param_groups_of
from fzero.engine.optimizer import EngineOptimizer
from fzero.optim import Optimizer, adagrad, adam, adamw, lamb, lion, sgd
from fzero.partition import Plan

__all__ = ["initialize", "with_deepspeed_defaults"]

log = logging.getLogger("fzero")


# A client optimizer's class -> the functional optimizer fzero runs for it, and the
# hyper-parameters its groups carry (DeepSpeed's Lion and Lamb ops are fzero's own
# classes, `fzero.compat.deepspeed.ops.lion`, `.lamb`; its CPU Adam and Adagrad are torch's)
_CLIENTS: dict[str, tuple[Callable[..., Optimizer], tuple[str, ...]]] = {
    "Adam": (adam, ("lr", "betas", "eps", "weight_decay")),
    "AdamW": (adamw, ("lr", "betas", "eps", "weight_decay")),
    "SGD": (sgd, ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
    "Adagrad": (adagrad, ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")),
    "DeepSpeedCPULion": (lion, ("lr", "betas", "weight_decay")),
    "FusedLion": (lion, ("lr", "betas", "weight_decay")),
    # what FusedLamb would run differently it refuses when built (`bias_correction` True)
    "FusedLamb": (
        lamb,
        ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"),
    ),
}


def _from_client(client: torch.optim.Optimizer) -> tuple[Optimizer, list[dict[str, Any]]]:
    """A functional optimizer equivalent to a `torch.optim` instance, and its groups."""
    kind = type(client).__name__
    if kind not in _CLIENTS:
        raise TypeError(
            f"client optimizer {kind} is not supported; allowed: torch.optim.Adam, AdamW, SGD, "
            "Adagrad, deepspeed.ops.lion.DeepSpeedCPULion, FusedLion, "
            "deepspeed.ops.lamb.FusedLamb (or configure "
            "Adam/AdamW/Lamb/SGD/Muon/Adagrad/Lion in the config)"
        )
    build, keep = _CLIENTS[kind]
    for group in client.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"client optimizer {kind} with {flag}=True is not supported")
    fixed = "initial_accumulator_value"  # fills the state at init: one value for all groups
    if len({g.get(fixed) for g in client.param_groups}) > 1:
        found = [g.get(fixed) for g in client.param_groups]
        raise ValueError(
            f"client optimizer {kind}: param groups with different {fixed} {found}; fzero "
            "starts every group's sums from one value: allowed: one value for all groups"
        )
    defaults = {k: client.defaults[k] for k in keep}
    if fixed in keep:
        defaults[fixed] = client.param_groups[0][fixed] if client.param_groups else defaults[fixed]
    base = build(**defaults)
    groups = [
        {"params": g["params"], **{k: g[k] for k in keep if k not in ("lr", fixed)}}
        for g in client.param_groups
    ]
    return base, groups


def with_deepspeed_defaults(cfg: Config, source: Any) -> Config:
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
    if cfg.zero_optimization.compute_grad_norm is False:
        raise ConfigError(
            "config key 'zero_optimization.compute_grad_norm' is false but it needs "
            "gradient_clipping 0, and without the key DeepSpeed clips at 1.0: set "
            "'gradient_clipping': 0, as DeepSpeed asks"
        )
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
    strategy: Callable[..., Plan] | None = None,
) -> tuple[Engine, EngineOptimizer, torch.utils.data.DataLoader | None, Any]:
    """DeepSpeed's `deepspeed.initialize`, same arguments and returns.

    Returns `(engine, optimizer, dataloader, lr_scheduler)`. The config comes
    from `config`/`config_params` or `args.deepspeed_config` / `args.fzero_config`.
    A client `torch.optim` optimizer (Adam, AdamW, SGD, Adagrad, or DeepSpeed's Lion
    ops and FusedLamb) is run as fzero's functional equivalent with its hyper-parameters
    and param groups.

    The scheduler is DeepSpeed's: `lr_scheduler` (an object, or a callable given the
    optimizer) wins over the config's `scheduler` block; with neither it is None, and a
    client steps its own. The engine steps `engine.lr_scheduler` after each applied
    optimizer step; assign it (None, or another scheduler) to change that. The
    returned optimizer acts on the engine (`step()` is `engine.step()`; `param_groups` are live; see
    `fzero.engine.optimizer`). `param_init_fn`, `name` and `strategy` (the partitioning
    function; else the config's `strategy` key, else `flat_even`) as in `shard`.
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
    cfg = with_deepspeed_defaults(config_of(source), source)
    if getattr(args, "metrics_file", None):
        cfg = dataclasses.replace(cfg, metrics_file=args.metrics_file)
    if getattr(args, "no_progress", False):
        cfg = dataclasses.replace(cfg, progress=False)
    groups = param_groups_of(model_parameters)
    client = None
    if isinstance(optimizer, torch.optim.Optimizer):
        client = optimizer
        functional, groups = _from_client(optimizer)
    elif isinstance(optimizer, Optimizer):
        functional = optimizer
    elif optimizer is None:  # none at all: an engine that runs forward only (as DeepSpeed)
        functional = optimizer_of(cfg, None, default=None)
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or fzero.optim.Optimizer, "
            f"found {type(optimizer).__name__}"
        )
    # DeepSpeed's `_configure_lr_scheduler`: the argument wins over the config's block
    # (a scheduler object as it is, a callable called with the optimizer), the config's
    # block builds one, else there is none; the engine steps `engine.lr_scheduler`
    schedule = schedule_of(cfg) if lr_scheduler is None else None
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
        strategy=strategy,
    )
    if factory is not None and functional is not None:
        engine.lr_scheduler = factory(engine.optimizer)
    engine.collate_fn = collate_fn
    loader = None
    if training_data is not None:
        if engine.batch is None:
            raise ConfigError("training_data needs a batch size in the config")
        loader = engine.deepspeed_io(training_data)
    engine.training_dataloader = loader  # DeepSpeed's attribute (None without data)
    return engine, engine.optimizer, loader, engine.lr_scheduler
