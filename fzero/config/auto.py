"""`"auto"` config values (the Hugging Face Transformers convention): which are left,
and filling them from training arguments as the Transformers integration does."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fzero.config import AUTO, Config, ConfigError

__all__ = ["check_resolved", "resolve_auto", "unresolved_auto"]


def unresolved_auto(config: Any, where: str = "") -> list[str]:
    """Dotted keys of every value still `"auto"`."""
    if config == AUTO:
        return [where.rstrip(".")]
    if dataclasses.is_dataclass(config):
        items = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    elif isinstance(config, Mapping):
        items = list(config.items())
    elif isinstance(config, list | tuple):
        return [where.rstrip(".")] if AUTO in config else []
    else:
        return []
    return [key for name, value in items for key in unresolved_auto(value, f"{where}{name}.")]


def check_resolved(config: Config) -> Config:
    """Raise naming every key still `"auto"`; the engine calls this before it starts."""
    left = unresolved_auto(config)
    if left:
        raise ConfigError(
            f'config keys still "auto": {left}; resolve them with fzero.resolve_auto(...) '
            "or give values"
        )
    return config


def _replace(obj: Any, path: list[str], value: Any) -> Any:
    """`obj` with the value at `path` set to `value` where it is currently "auto"."""
    head, rest = path[0], path[1:]
    current = obj.get(head) if isinstance(obj, Mapping) else getattr(obj, head, None)
    if rest:
        if current is None:
            return obj
        new = _replace(current, rest, value)
    elif current == AUTO or (isinstance(current, list | tuple) and AUTO in current):
        new = value
    else:
        return obj
    if isinstance(obj, Mapping):
        return {**obj, head: new}
    return dataclasses.replace(obj, **{head: new})


def resolve_auto(
    config: Config,
    *,
    world_size: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
    max_grad_norm: float | None = None,
    fp16: bool | None = None,
    bf16: bool | None = None,
    hidden_size: int | None = None,
) -> Config:
    """Fill `"auto"` values from training arguments, as the Transformers integration does.

    Batch keys from the micro batch, accumulation steps and world size;
    optimizer lr/betas/eps/weight_decay; scheduler warmup_min_lr = 0,
    warmup_max_lr = lr, warmup_num_steps, total_num_steps; gradient_clipping;
    fp16/bf16 enabled; and from the model's hidden size h: reduce_bucket_size =
    h², stage3_prefetch_bucket_size = 0.9·h², stage3_param_persistence_threshold
    = 10·h. A value not given leaves its key "auto".
    """
    plan: list[tuple[str, Any]] = [
        ("train_micro_batch_size_per_gpu", micro_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("gradient_clipping", None if max_grad_norm is None else float(max_grad_norm)),
        ("optimizer.params.lr", lr),
        ("optimizer.params.betas", None if betas is None else list(betas)),
        ("optimizer.params.eps", eps),
        ("optimizer.params.weight_decay", weight_decay),
        ("scheduler.params.warmup_min_lr", 0.0),
        ("scheduler.params.warmup_max_lr", lr),
        ("scheduler.params.warmup_num_steps", warmup_steps),
        ("scheduler.params.total_num_steps", total_steps),
        ("fp16.enabled", fp16),
        ("bf16.enabled", bf16),
    ]
    if hidden_size is not None:
        plan += [
            ("zero_optimization.reduce_bucket_size", hidden_size * hidden_size),
            ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size),
        ]
    for key, value in plan:
        if value is not None:
            config = _replace(config, key.split("."), value)
    micro, accum = config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    if world_size is not None and isinstance(micro, int) and isinstance(accum, int):
        config = _replace(config, ["train_batch_size"], micro * accum * world_size)
    if config.fp16.enabled is True and config.bf16.enabled is True:
        raise ConfigError('resolving "auto" enabled both fp16 and bf16; enable at most one')
    return config
