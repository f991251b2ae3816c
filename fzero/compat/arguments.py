"""DeepSpeed's command-line flags for a training script's own argument parser."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's launcher flags (and fzero's own names for them) to `parser`.

    `--deepspeed` / `--fzero` switch the engine on; `--deepspeed_config` /
    `--fzero_config` name the JSON config. A DeepSpeed script's argument parsing
    therefore ports unchanged.
    """
    group = parser.add_argument_group("fzero", "fzero (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", action="store_true", help="enable fzero (DeepSpeed flag)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="JSON config path")
    group.add_argument("--fzero", action="store_true", help="enable fzero")
    group.add_argument("--fzero_config", default=None, type=str, help="JSON config path")
    group.add_argument("--metrics-file", default=None, help="append JSON lines of metrics here")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser
