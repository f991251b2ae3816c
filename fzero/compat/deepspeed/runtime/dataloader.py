"""`deepspeed.runtime.dataloader`: `RepeatingLoader`, which scripts wrap their loader in to
draw batches past its end (DeepSpeed's pipeline examples, and training loops that count
steps rather than epochs). `DeepSpeedDataLoader` is refused by name: the same loader is
`engine.deepspeed_io(dataset)`, or `initialize(training_data=...)`'s."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]


class RepeatingLoader:
    """An endless iterator over `loader`: at its end it starts again (a new `iter`, so a
    shuffling sampler draws a new order, as DeepSpeed's does)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def DeepSpeedDataLoader(*_: Any, **__: Any) -> Any:
    """Refused by name: DeepSpeed's loader class."""
    raise NotImplementedError(
        "deepspeed.runtime.dataloader.DeepSpeedDataLoader is not served by fzero; the same "
        "loader (this rank's part of the dataset, DeepSpeed's sampler and batch size) is "
        "engine.deepspeed_io(dataset), or the one initialize(training_data=...) returns"
    )
