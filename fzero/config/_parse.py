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

__all__ = ["ALIASES", "NOT_SUPPORTED", "Switch", "convert", "parse_section", "unknown_key"]


class Switch(typing.NamedTuple):
    """When a DeepSpeed key fzero does not implement is on: `on(value)` reads the value as
    DeepSpeed does (a block's `enabled` defaults to false where DeepSpeed's does), and
    `off` says, for the error and the reference, which values are off."""

    on: typing.Callable[[Any], bool]
    off: str


def _present(value: Any) -> bool:
    """On unless `false`, `null` or `{"enabled": false}` (a block DeepSpeed runs as given)."""
    if value is None or value is False:
        return False
    return not (isinstance(value, Mapping) and value.get("enabled", True) is False)


def _enabled(value: Any) -> bool:
    """On when `true` or a block whose `enabled` is true (DeepSpeed's default: false)."""
    if isinstance(value, Mapping):
        return value.get("enabled", False) is not False
    return value not in (None, False)


def _entry(name: str, off: int = 1) -> typing.Callable[[Any], bool]:
    """On when the block's `name` is set above `off` (falsy values are off)."""

    def on(value: Any) -> bool:
        if not isinstance(value, Mapping):
            return _present(value)
        given = value.get(name)
        return bool(given) and not (isinstance(given, int | float) and given <= off)

    return on


def _tensor_parallel(value: Any) -> bool:
    """DeepSpeed's AutoTP for training: on with `autotp_size` (or `tp.tp_size`) above 1."""
    if not isinstance(value, Mapping):
        return _present(value)
    inner = value.get("tp", value.get("tensor_parallel")) or {}
    return _entry("autotp_size")(value) or (isinstance(inner, Mapping) and _entry("tp_size")(inner))


def _any_set(value: Any) -> bool:
    """On when any of the block's entries is set (`{}` and `null` entries are off)."""
    if not isinstance(value, Mapping):
        return _present(value)
    return any(v not in (None, False, {}) for v in value.values())


_PRESENT = Switch(_present, '`false`, `null` or `{"enabled": false}`')
_ENABLED = Switch(_enabled, '`false`, `null`, or a block without `"enabled": true`')

# Keys DeepSpeed knows that fzero does not implement: accepted only while off.
NOT_SUPPORTED: dict[str, dict[str, Switch]] = {
    "": {
        "amp": _ENABLED,
        "autotuning": _ENABLED,
        "compression_training": _PRESENT,
        "data_efficiency": _ENABLED,
        "compile": Switch(_entry("deepcompile", 0), 'a block without `"deepcompile": true`'),
        "curriculum_learning": _ENABLED,
        "datastates_ckpt": _PRESENT,
        "dump_state": _ENABLED,
        "eigenvalue": _ENABLED,
        "elasticity": _ENABLED,
        "expert_parallel": _ENABLED,
        "hybrid_engine": _ENABLED,
        "nebula": _ENABLED,
        "progressive_layer_drop": _ENABLED,
        "quantize_training": _ENABLED,
        "sparse_attention": _PRESENT,
        "sparse_gradients": _ENABLED,
        "tensor_parallel": Switch(
            _tensor_parallel, "a block whose `autotp_size` (and `tp.tp_size`) is 0 or 1"
        ),
        "weight_quantization": Switch(_any_set, "`null`, or a block whose entries are `null`"),
        "zenflow": _PRESENT,
    },
    "zero_optimization": {"zeropp_loco_param": _PRESENT, "zenflow": _PRESENT},
    "fp16": {"auto_cast": _PRESENT, "fp16_master_weights_and_grads": _PRESENT},
    "bf16": {"immediate_grad_update": _PRESENT},
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


def unknown_key(key: str, known: set[str] | frozenset[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return ConfigError(f"unknown config key {where + key!r}; did you mean {close[0]!r}?")
    return ConfigError(f"unknown config key {where + key!r}; known keys here: {sorted(known)}")


def convert(value: Any, hint: Any, key: str) -> Any:
    """Check/convert one JSON value to the field's annotated type (`key` names it in the
    error); "auto" passes as it is."""
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
                return convert(value, option, key)
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
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key {key!r} must be a list, found {value!r}")
        items = typing.get_args(hint)
        if len(items) == 2 and items[1] is Ellipsis:
            items = (items[0],) * len(value)
        elif len(value) != len(items):
            raise ConfigError(
                f"config key {key!r} must be a list of {len(items)} values, found {value!r}"
            )
        return tuple(convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, found {value!r}")
        (item,) = typing.get_args(hint)
        return [convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
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
    unsupported = NOT_SUPPORTED.get(section, {})
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name in known:
            if name in values:
                raise ConfigError(f"config key {where + name!r} is given twice (once as {key!r})")
            values[name] = convert(value, hints[name], where + key)
            _check_default(fields[name], values[name], where + key)
        elif name in unsupported:
            switch = unsupported[name]
            if switch.on(value):
                raise ConfigError(
                    f"config key {where + key!r} is not supported yet by fzero "
                    f"(found {value!r}); remove it or switch it off (off: {switch.off})"
                )
        else:
            raise unknown_key(key, known | set(aliases) | set(unsupported), where)
    return cls(**values)


def _check_default(spec: dataclasses.Field[Any], value: Any, key: str) -> None:
    """A key accepted only at its default (`only_default`) with another value: refused."""
    why = spec.metadata.get("only_default")
    if why is not None and value != AUTO and value != spec.default:
        raise ConfigError(
            f"config key {key!r} is {value!r}; fzero allows only {spec.default!r}: {why}"
        )
