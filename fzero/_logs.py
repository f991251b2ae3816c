"""fzero's log lines come from rank 0: a filter on the "fzero" logger drops INFO and
DEBUG records on other ranks, unless `FZERO_LOG_ALL_RANKS=1` (`fzero run
--log-all-ranks`) or the record asks for every rank (`log_dist` with explicit ranks
marks its records `fzero_any_rank`). Warnings and errors pass on every rank: they can
differ between ranks."""

from __future__ import annotations

import logging
import os

__all__ = ["RankZeroInfo", "install", "set_level"]


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


class RankZeroInfo(logging.Filter):
    """Pass a record unless it is INFO or below from a rank other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or getattr(record, "fzero_any_rank", False):
            return True
        if os.environ.get("FZERO_LOG_ALL_RANKS") == "1":
            return True
        return _rank() == 0


def install() -> None:
    """Put the filter on the "fzero" logger (once)."""
    logger = logging.getLogger("fzero")
    if not any(isinstance(f, RankZeroInfo) for f in logger.filters):
        logger.addFilter(RankZeroInfo())


def set_level(name: str | None) -> None:
    """The config's `log_level` ("debug" ... "critical"; None leaves it): on the "fzero"
    logger and its handlers, as DeepSpeed sets its own from its config."""
    if name is None:
        return
    level = getattr(logging, name.upper())
    logger = logging.getLogger("fzero")
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.setLevel(level)
