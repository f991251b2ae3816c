"""What every part of the config package shares: the `"auto"` marker and the error."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AUTO", "ConfigError", "Section"]

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
