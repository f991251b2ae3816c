"""`deepspeed.utils.logging`: the `logger` DeepSpeed scripts and Lightning log through
(fzero's, named "fzero"; Lightning sets its level), and `log_dist`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fzero.comm import get_rank

__all__ = ["log_dist", "logger"]

logger = logging.getLogger("fzero")
if not logger.handlers and not logging.getLogger().handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (all when `ranks` is None or contains -1)."""
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or get_rank() in ranks:
        # the ranks asked for, not fzero's rank-0 filter (`fzero._logs`), decide
        logger.log(level, f"[Rank {get_rank()}] {message}", extra={"fzero_any_rank": True})
