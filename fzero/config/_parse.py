"""How a DeepSpeed JSON object becomes a config section's dataclass: each key checked
against the section's fields (an unknown one named with the closest known key, one fzero
does not implement refused unless switched off, DeepSpeed's older names read as the new),
each value converted to its field's annotated type or refused naming the key, the value
and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from fzero.config._base import AUTO, ConfigError

__all__ = ["ALIASES", "NOT_SUPPORTED", "parse_section", "unknown_key"]


# Keys DeepSpeed knows that fzero does not implement: accepted only while off.
NOT_SUPPORTED = {
    "": {
        "amp",
        "autotuning",
        "compression_training",
        "data_efficiency",
        "compile",
        "curriculum_learning",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "hybrid_engine",
        "nebula",
        "pipeline",
        "progressive_layer_drop",
        "quantize_training",
        "sparse_attention",
        "sparse_gradients",
        "tensor_parallel",
        "zenflow",
        "zero_force_ds_cpu_optimizer",
    },
    "zero_optimization": {"zeropp_loco_param", "zenflow"},
    "fp16": {"auto_cast", "fp16_master_weights_and_grads"},
    "bf16": {"immediate_grad_update"},
}

ALIASES = {
    "": {"bfloat16": "bf16"},
    "aio": {"intra_op_parallelism": "thread_count"},  # DeepSpeed 0.19's name
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        # DeepSpeed's field names, which its config takes beside the stage3_ keys
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
    },
}


def _is_off(value: Any) -> bool:
    """A block that is present but disabled (`{"enabled": false}`, `false`, `null`)."""
    if value is None or value is False:
        return True
    return isinstance(value, Mapping) and value.get("enabled", True) is False


def unknown_key(key: str, known: set[str] | frozenset[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return ConfigError(f"unknown config key {where + key!r}; did you mean {close[0]!r}?")
    return ConfigError(f"unknown config key {where + key!r}; known keys here: {sorted(known)}")


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Check/convert one JSON value to the field's annotated type."""
    if value == AUTO:
        return AUTO
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"config key {key!r} is {value!r}; allowed: {list(allowed)}")
        return allowed[allowed.index(value)]  # as declared: 8.0 from JSON reads as 8
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} must be an object, found {value!r}")
        return parse_section(hint, value, key + ".")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, found {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {key!r} must be an integer, found {value!r}")
        if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
            raise ConfigError(f"config key {key!r} must be a whole number, found {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {key!r} must be a number, found {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, found {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, found {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} must be an object, found {value!r}")
        return dict(value)
    raise TypeError(f"config field {key!r} has an annotation fzero cannot parse: {hint!r}")


def parse_section(cls: type, raw: Mapping[str, Any], where: str) -> Any:
    section = where.rstrip(".")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = set(fields)
    aliases = ALIASES.get(section, {})
    unsupported = NOT_SUPPORTED.get(section, set())
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name in known:
            if name in values:
                raise ConfigError(f"config key {where + name!r} is given twice (once as {key!r})")
            values[name] = _convert(value, hints[name], where + key)
            _check_default(fields[name], values[name], where + key)
        elif name in unsupported:
            if not _is_off(value):
                raise ConfigError(
                    f"config key {where + key!r} is not supported yet by fzero "
                    f"(found {value!r}); remove it or switch it off"
                )
        else:
            raise unknown_key(key, known | set(aliases) | unsupported, where)
    return cls(**values)


def _check_default(spec: dataclasses.Field[Any], value: Any, key: str) -> None:
    """A key accepted only at its default (`only_default`) with another value: refused."""
    why = spec.metadata.get("only_default")
    if why is not None and value != AUTO and value != spec.default:
        raise ConfigError(
            f"config key {key!r} is {value!r}; fzero allows only {spec.default!r}: {why}"
        )
