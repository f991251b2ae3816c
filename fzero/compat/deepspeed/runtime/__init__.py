"""`deepspeed.runtime`: the engine class, the schedule names, `config`
(`DeepSpeedConfig`), `dataloader` (`RepeatingLoader`), `fp16` (`loss_scaler`), `zero`,
`utils` and `activation_checkpointing`, as Accelerate, Transformers and Megatron-style
code look them up."""

from fzero.compat.deepspeed.runtime import (
    activation_checkpointing,
    base_optimizer,
    config,
    dataloader,
    engine,
    fp16,
    lr_schedules,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing",
    "base_optimizer",
    "config",
    "dataloader",
    "engine",
    "fp16",
    "lr_schedules",
    "utils",
    "zero",
]
