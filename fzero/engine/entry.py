"""`fzero.shard`: the functional entry onto the engine (DeepSpeed's is `fzero.initialize`,
in `fzero.compat`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fzero.config import Config, ConfigError, load_config
from fzero.core.init import optimizer_of, schedule_of
from fzero.core.precision import Precision
from fzero.engine._engine import Engine
from fzero.optim import Optimizer, adamw
from fzero.partition import Plan

__all__ = ["config_of", "param_groups_of", "shard"]


def config_of(config: Config | Mapping[str, Any] | str | None) -> Config:
    """`config` (a Config, a dict, a JSON path, or None for the defaults) as a Config."""
    return load_config(config if config is not None else {})


def param_groups_of(model_parameters: Iterable[Any] | None) -> list[dict[str, Any]] | None:
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


def shard(
    model: torch.nn.Module,
    stage: int | None = None,
    optimizer: Optimizer | None = None,
    *,
    precision: str | Precision | None = None,
    config: Config | Mapping[str, Any] | str | None = None,
    strategy: Callable[..., Plan] | None = None,
    param_groups: Iterable[Any] | None = None,
    schedule: Callable[[int, float], float] | None = None,
    param_init_fn: Callable[[torch.nn.Module], None] | None = None,
    name: str | None = None,
) -> Engine:
    """Shard `model` with ZeRO `stage` and train it with a functional `optimizer`.

    `stage` overrides the config's `zero_optimization.stage`; `precision`
    ("fp32", "bf16", "fp16", or a `fzero.Precision` saying master and optimizer-state
    dtypes too) overrides its fp16/bf16 blocks; `strategy` is any
    partitioning function (else the config's `strategy` key, else
    `fzero.partition.flat_even`). A model built on
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
    cfg = config_of(config)
    if stage is not None:
        cfg = dataclasses.replace(
            cfg, zero_optimization=dataclasses.replace(cfg.zero_optimization, stage=stage)
        )
    return Engine(
        model,
        optimizer=optimizer_of(cfg, optimizer, default=adamw()),
        config=cfg,
        param_groups=param_groups_of(param_groups),
        precision=precision,
        strategy=strategy,
        schedule=schedule_of(cfg, schedule),
        param_init_fn=param_init_fn,
        name=name,
    )
