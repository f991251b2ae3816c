"""DeepSpeed's batch arithmetic: train batch = micro batch x accumulation steps x world
size, any two given deriving the third; and the accumulation steps both doors use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fzero.config._base import AUTO, ConfigError

__all__ = ["BatchFields", "BatchSizes", "accumulation_steps", "batch_sizes", "batch_sizes_or_none"]


class BatchFields(Protocol):
    """The three keys of a config the arithmetic reads (`fzero.config.Config` has them)."""

    train_batch_size: int | None
    train_micro_batch_size_per_gpu: int | None
    gradient_accumulation_steps: int | None


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def batch_sizes_or_none(config: BatchFields, world_size: int) -> BatchSizes | None:
    """`batch_sizes` where the config gives a batch size, else None."""
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        return None
    return batch_sizes(config, world_size)


def accumulation_steps(config: BatchFields, world_size: int) -> int:
    """Micro-batches per optimizer step, one rule for both doors: from the batch
    arithmetic where the config gives a batch size, else `gradient_accumulation_steps`
    (1 when absent)."""
    batch = batch_sizes_or_none(config, world_size)
    if batch is not None:
        return batch.gradient_accumulation_steps
    steps = config.gradient_accumulation_steps
    if steps == AUTO:
        raise ConfigError(
            'config key "gradient_accumulation_steps" is still "auto"; call resolve_auto first'
        )
    return steps or 1


def batch_sizes(config: BatchFields, world_size: int) -> BatchSizes:
    """DeepSpeed's batch arithmetic: train = micro x accumulation x world.

    Any two given derive the third; only `train_batch_size` gives accumulation
    1; only the micro batch gives accumulation 1; all three must agree.
    """
    train = config.train_batch_size
    micro = config.train_micro_batch_size_per_gpu
    accum = config.gradient_accumulation_steps
    for name, value in (
        ("train_batch_size", train),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", accum),
    ):
        if value == AUTO:
            raise ConfigError(f'config key {name!r} is still "auto"; call resolve_auto first')
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            raise ConfigError(
                "train_batch_size != train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x world_size: {train} != "
                f"{micro} x {accum} x {world_size} = {micro * accum * world_size}"
            )
        return BatchSizes(train, micro, accum)
    if train is not None and micro is not None:
        accum, left = divmod(train, micro * world_size)
    elif train is not None and accum is not None:
        micro, left = divmod(train, accum * world_size)
    elif micro is not None:
        accum = accum or 1
        train, left = micro * accum * world_size, 0
    elif train is not None:
        accum = 1
        micro, left = divmod(train, world_size)
    else:
        raise ConfigError(
            "give train_batch_size or train_micro_batch_size_per_gpu "
            f"(found gradient_accumulation_steps={accum!r} only)"
        )
    if left or micro < 1 or accum < 1:
        raise ConfigError(
            f"train_batch_size {train} cannot be split as micro batch x accumulation steps "
            f"x world_size {world_size} (micro={micro}, accumulation={accum}, remainder {left})"
        )
    return BatchSizes(train, micro, accum)
