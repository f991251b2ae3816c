"""What every part of the config package shares: the `"auto"` marker and the error."""

from __future__ import annotations

__all__ = ["AUTO", "ConfigError"]

AUTO = "auto"
"""A value the Hugging Face integration fills in later (`fzero.resolve_auto`)."""


class ConfigError(ValueError):
    """A config key has a wrong name, type or value; the message names it."""
