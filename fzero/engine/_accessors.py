"""DeepSpeed's engine accessors (`fp16_enabled()`, `train_batch_size()`,
`get_global_grad_norm()`, ...), which scripts and clients (Transformers, Accelerate,
Lightning) call by name: one-line answers from the engine's state, kept apart from the
engine's own logic; and DeepSpeed's two batch-size setters (a batch-size ramp)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import torch

from fzero.config import BatchSizes
from fzero.core.precision import gradient_wire_dtype

__all__ = ["DeepSpeedAccessors"]


class DeepSpeedAccessors:
    """Mixed into `fzero.engine.Engine`; reads only the attributes annotated here."""

    training_dataloader: Any = None
    """The loader `initialize` built from `training_data` (DeepSpeed's attribute)."""

    collate_fn: Any = None
    """`initialize`'s `collate_fn`: `deepspeed_io`'s default (DeepSpeed's attribute)."""

    module: torch.nn.Module
    rank: int
    world_size: int
    compute_dtype: torch.dtype
    gatherer: Any
    loss_scale_state: Any
    batch: Any
    accumulation: int
    precision: str
    stage: int
    config: Any
    hyperparams: Any
    schedule: Any
    lr_steps: int
    _skipped_last: bool
    _step_applied: bool
    _global_grad_norm: float | None
    telemetry: Any

    @property
    def tput_timer(self) -> Any:
        """DeepSpeed's throughput timer (`fzero.engine.throughput.ThroughputTimer`):
        `update_epoch_count()`, `avg_samples_per_sec()`, its step and epoch counts."""
        return self.telemetry.throughput

    @property
    def monitor(self) -> Any:
        """DeepSpeed's `engine.monitor`: the config's monitors (`tensorboard`,
        `csv_monitor`, `wandb`, `comet`); `write_events([(name, value, samples)])` writes
        a script's own events beside the engine's, on rank 0; `enabled` says whether any
        is on."""
        return self.telemetry.monitor

    def train(self, mode: bool = True) -> Any:
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        return self.train(False)

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.rank

    def loss_scale(self) -> float:
        """DeepSpeed's: the config's `fp16.loss_scale` (0.0: dynamic, and without fp16);
        the scale in use now is `current_loss_scale`."""
        return float(self.config.fp16.loss_scale)

    @property
    def current_loss_scale(self) -> float:
        """The loss scale the next backward multiplies by: fp16's dynamic or static
        scale, 1.0 without fp16 (DeepSpeed's `engine.optimizer.cur_scale`)."""
        return self.loss_scale_state.scale if self.loss_scale_state else 1.0

    def was_step_skipped(self) -> bool:
        return self._skipped_last

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters (DeepSpeed's): False off an
        accumulation boundary and when the step was skipped."""
        return self._step_applied

    def train_batch_size(self) -> int | None:
        return self.batch.train_batch_size if self.batch else None

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.batch.micro_batch_size if self.batch else None

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state lives off the device (`offload_optimizer` cpu or
        nvme), as DeepSpeed's accessor says."""
        return bool(self.config.zero_optimization.offload_optimizer.on)

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    # ---- the config as DeepSpeed's engine reports it -----------------------------------

    @property
    def dp_world_size(self) -> int:
        """Data-parallel processes: every process (fzero has no model parallelism)."""
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage == 3

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self.config.memory_breakdown

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def optimizer_name(self) -> str | None:
        """The config's optimizer type in lower case (DeepSpeed's), None without one."""
        block = self.config.optimizer
        return block.type.lower() if block is not None else None

    def optimizer_params(self) -> dict[str, Any] | None:
        block = self.config.optimizer
        return dict(block.params) if block is not None else None

    def scheduler_name(self) -> str | None:
        block = self.config.scheduler
        return block.type if block is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        block = self.config.scheduler
        return dict(block.params) if block is not None else None

    def zero_reduce_bucket_size(self) -> int:
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero_optimization.reduce_scatter

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_overlap_comm(self) -> bool:
        """DeepSpeed's default: on at stage 3 only."""
        overlap = self.config.zero_optimization.overlap_comm
        return self.stage == 3 if overlap is None else bool(overlap)

    def zero_sub_group_size(self) -> int:
        return int(self.config.zero_optimization.sub_group_size)

    def zero_max_live_parameters(self) -> int:
        return int(self.config.zero_optimization.stage3_max_live_parameters)

    def zero_max_reuse_distance(self) -> int:
        return int(self.config.zero_optimization.stage3_max_reuse_distance)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self.config.zero_optimization.stage3_prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        return int(self.config.zero_optimization.stage3_param_persistence_threshold)

    def zero_load_from_fp32_weights(self) -> bool:
        return self.config.zero_optimization.load_from_fp32_weights

    def zero_elastic_checkpoint(self) -> bool:
        return self.config.zero_optimization.elastic_checkpoint

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero_optimization.ignore_unused_parameters

    def zero_hpz_partition_size(self) -> int:
        return int(self.config.zero_optimization.zero_hpz_partition_size)

    def zero_quantized_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_weights

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero_optimization.zero_quantized_gradients

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch by a new number of accumulation steps (the
        micro batch kept); from the next micro-step on, as DeepSpeed's."""
        micro = self.train_micro_batch_size_per_gpu()
        if micro is None or train_batch_size % (micro * self.world_size) != 0:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): the train batch size must be a "
                f"multiple of the micro batch ({micro}) times the data-parallel world size "
                f"({self.world_size})"
            )
        self.accumulation = train_batch_size // (micro * self.world_size)
        self.batch = BatchSizes(train_batch_size, micro, self.accumulation)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro batch per rank, the accumulation steps kept (so a new
        global batch)."""
        if micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): it must be >= 1")
        train = micro_batch_size * self.accumulation * self.world_size
        self.batch = BatchSizes(train, micro_batch_size, self.accumulation)

    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """DeepSpeed's: the module's own `state_dict` (not collective), without frozen
        parameters when asked. At stage 3 the parameters there are placeholders, as
        DeepSpeed's are: the whole weights come from `state_dict()` (collective) or
        `save_16bit_model`."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def deepspeed_io(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> torch.utils.data.DataLoader:
        """DeepSpeed's: a loader over this rank's part of `dataset`, `batch_size`
        (default the micro-batch size) rows at a time; a `DistributedSampler` over the
        ranks (shuffled for `route` "train", in order for "eval" and "predict") unless
        `data_sampler` is given; `collate_fn` default `initialize`'s; the last short
        batch dropped when the config's `dataloader_drop_last` says so. The loader reads
        in this process (`num_local_io_workers` workers when given; DeepSpeed's default
        of 2 worker processes changes no batch), pinned on a GPU only."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise ValueError(
                f"deepspeed_io: dataset is a {type(dataset).__name__}; expected a "
                "torch.utils.data.Dataset (map-style or iterable)"
            )
        if route not in ("train", "eval", "predict"):
            raise ValueError(f"deepspeed_io: route is {route!r}; allowed: train, eval, predict")
        if batch_size is None:
            batch_size = self.train_micro_batch_size_per_gpu()
            if batch_size is None:
                raise ValueError(
                    "deepspeed_io: no batch_size given and the config sets no "
                    "train_micro_batch_size_per_gpu"
                )
        if data_sampler is None and not isinstance(dataset, torch.utils.data.IterableDataset):
            data_sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.world_size, rank=self.rank, shuffle=route == "train"
            )
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=self.dataloader_drop_last(),
        )

    def get_batch_info(self) -> tuple[int | None, int | None, int]:
        """(train batch size, micro batch size per rank, accumulation steps)."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's compute dtype, the gradient accumulators' dtype)."""
        accum = self.config.data_types.grad_accum_dtype
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        return self.compute_dtype, dtypes.get(accum, torch.float32)

    @property
    def mpu(self) -> None:
        """No model-parallel unit: fzero is data parallel (a plan on a mesh for groups)."""
        return None

    @property
    def data_parallel_group(self) -> Any:
        """The process group data parallelism runs over: every process."""
        return torch.distributed.group.WORLD

    gradient_average = True
    """Gradients are averaged over ranks (DeepSpeed's attribute; its config's
    `gradient_allreduce_op` "sum" makes it false, which fzero refuses)."""

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (DeepSpeed's, for scripts that set
        `disable_python_gc`); the number of objects it found unreachable."""
        return gc.collect()

    def flops_profiler_enabled(self) -> bool:
        return self.config.flops_profiler.enabled

    def autotuning_enabled(self) -> bool:
        return False

    def curriculum_learning_enabled(self) -> bool:
        return False

    has_moe_layers = False
    """DeepSpeed's attribute: fzero trains no mixture-of-experts layers (`deepspeed.moe`
    layers are refused)."""

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients travel in when reduced over ranks: the config's
        `communication_data_type`, else fp32 (fzero's; DeepSpeed's default is the
        compute dtype)."""
        return gradient_wire_dtype(self.config)

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered unit (kept for generation or prefetched), as
        DeepSpeed's; the next forward gathers again."""
        if self.stage == 3:
            self.gatherer.release_all()

    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() == "FAIL"

    def load_universal_checkpoint(self) -> bool:
        return self.config.checkpoint.load_universal

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients, before clipping (None before
        the first step; inf when the step was skipped: an fp16 overflow, or gradients
        that are not finite)."""
        return self._global_grad_norm

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, SGD's `momentum` (DeepSpeed)."""
        return self.hyperparams.momentum(self.schedule, self.lr_steps)
