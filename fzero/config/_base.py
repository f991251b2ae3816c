"""What every part of the config package shares: the `"auto"` marker, the error, the
base of every section, and the two markers of a DeepSpeed key fzero takes without reading
it (`no_effect`) or only at its default (`only_default`)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

__all__ = ["AUTO", "ConfigError", "Section", "no_effect", "no_effect_object", "only_default"]

AUTO = "auto"
"""A value the Hugging Face integration fills in later (`fzero.resolve_auto`)."""


class ConfigError(ValueError):
    """A config key has a wrong name, type or value; the message names it."""


class Section:
    """Dict-style reads of a config section, for code written against DeepSpeed's
    `engine.config` dict (Transformers reads `config.get("zero_optimization", {})
    .get("stage")`): a field's value, or `default` for a key the section lacks."""

    def get(self, key: str, default: Any = None) -> Any:
        names = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return getattr(self, key) if key in names else default


def no_effect(default: Any, why: str) -> Any:
    """A DeepSpeed key accepted with any value of its type, which changes nothing in
    fzero: `why` says what DeepSpeed does with it and why fzero computes the same."""
    return field(default=default, metadata={"no_effect": why})


def no_effect_object(why: str) -> Any:
    """`no_effect` for a DeepSpeed key whose value is an object (default `{}`)."""
    return field(default_factory=dict, metadata={"no_effect": why})


def only_default(default: Any, why: str) -> Any:
    """A DeepSpeed key accepted only at its default: another value would change what is
    computed in a way fzero does not do, so it is refused with `why`."""
    return field(default=default, metadata={"only_default": why})
