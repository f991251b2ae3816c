"""`deepspeed.runtime.config`: `DeepSpeedConfig`, DeepSpeed's parsed config object, over
fzero's parser, for scripts that read a config outside the engine. DeepSpeed's monitor
tutorial builds its monitor from one:

```python
ds_config = DeepSpeedConfig("ds_config.json")
monitor = MonitorMaster(ds_config.monitor_config)
```

The config is checked as `deepspeed.initialize` checks it (what fzero refuses is refused
here, with the same error), with DeepSpeed's defaults where they differ from fzero's
(`gradient_clipping` 1.0). The batch sizes are resolved over the process group's world
size, or 1 without a group, as DeepSpeed's are. The attributes served are DeepSpeed's
names for what a script reads (`SERVED`); any other is an AttributeError saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fzero import comm
from fzero.config import Config, ConfigError, batch_sizes, load_config
from fzero.optim import OPTIMIZERS

__all__ = ["SERVED", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedMonitorConfig"]

DeepSpeedConfigError = ConfigError
"""What DeepSpeed raises for a config it refuses; fzero's `ConfigError`."""


@dataclass(frozen=True)
class DeepSpeedMonitorConfig:
    """DeepSpeed's monitor config: the four monitor blocks, and whether any is on
    (`MonitorMaster(config.monitor_config)` builds the enabled ones)."""

    tensorboard: Any
    wandb: Any
    csv_monitor: Any
    comet: Any

    @property
    def enabled(self) -> bool:
        return any(block.enabled for block in (self.tensorboard, self.wandb,
                                                self.csv_monitor, self.comet))  # fmt: skip


SERVED = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "world_size", "global_rank", "steps_per_print", "gradient_clipping",
    "wall_clock_breakdown", "memory_breakdown", "dataloader_drop_last", "zero_enabled",
    "zero_optimization_stage", "zero_config", "float16_config", "bfloat16_config",
    "optimizer_name", "optimizer_params", "scheduler_name", "scheduler_params",
    "monitor_config", "flops_profiler_config", "comms_config", "checkpoint_config",
    "aio_config", "activation_checkpointing_config", "communication_data_type",
)  # fmt: skip
"""The `DeepSpeedConfig` attributes fzero serves, by DeepSpeed's names."""


class DeepSpeedConfig:
    """DeepSpeed's `DeepSpeedConfig(config, mpu=None, mesh_device=None)`: `config` a JSON
    path or a dict. The sections are fzero's (`fzero.config`), which carry DeepSpeed's
    key names; `fzero_config` is the whole parsed `Config`."""

    def __init__(self, config: str | Path | Mapping[str, Any], mpu: Any = None,
                 mesh_device: Any = None) -> None:  # fmt: skip
        from fzero.compat.initialize import with_deepspeed_defaults

        if mpu is not None or mesh_device is not None:
            raise NotImplementedError(
                "DeepSpeedConfig(mpu=..., mesh_device=...): model, tensor and sequence "
                "parallel groups are not supported by fzero (data parallelism only)"
            )
        if isinstance(config, Config):
            raise ConfigError(
                "DeepSpeedConfig takes a JSON path or a dict, as DeepSpeed's; found an fzero "
                "Config (use it directly)"
            )
        cfg = with_deepspeed_defaults(load_config(config), config)
        self.fzero_config = cfg
        initialized = comm.is_initialized()
        self.global_rank = comm.get_rank() if initialized else 0
        self.world_size = comm.get_world_size() if initialized else 1
        if cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
            raise ConfigError(
                "either train_batch_size or train_micro_batch_size_per_gpu needs to be in the "
                "config (DeepSpeed's rule)"
            )
        sizes = batch_sizes(cfg, self.world_size)
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.micro_batch_size
        self.gradient_accumulation_steps = sizes.gradient_accumulation_steps
        for name in (
            "steps_per_print",
            "gradient_clipping",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dataloader_drop_last",
            "communication_data_type",
        ):
            setattr(self, name, getattr(cfg, name))  # fmt: skip
        self.zero_config = cfg.zero_optimization
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config, self.bfloat16_config = cfg.fp16, cfg.bf16
        self.optimizer_name = self.optimizer_params = None
        if cfg.optimizer is not None:
            name = cfg.optimizer.type
            self.optimizer_name = name.lower() if name.lower() in OPTIMIZERS else name
            self.optimizer_params = dict(cfg.optimizer.params)
        self.scheduler_name = self.scheduler_params = None
        if cfg.scheduler is not None:
            self.scheduler_name = cfg.scheduler.type
            self.scheduler_params = dict(cfg.scheduler.params)
        self.monitor_config = DeepSpeedMonitorConfig(cfg.tensorboard, cfg.wandb,
                                                     cfg.csv_monitor, cfg.comet)  # fmt: skip
        self.flops_profiler_config, self.comms_config = cfg.flops_profiler, cfg.comms_logger
        self.checkpoint_config, self.aio_config = cfg.checkpoint, cfg.aio
        self.activation_checkpointing_config = cfg.activation_checkpointing

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"DeepSpeedConfig.{name} is not served by fzero; served: {', '.join(SERVED)} "
            "(and fzero_config, the whole parsed config)"
        )
