"""DeepSpeed-style JSON configuration, parsed into frozen, validated dataclasses.

`load_config` accepts a DeepSpeed `ds_config.json` (path or dict) as is. Every
key is checked: an unknown key is an error naming the closest known one, a
key DeepSpeed has but fzero does not implement is a "not supported yet" error
(unless it is switched off), and a wrong type or value names the key, the value
and what is allowed. `"auto"` values (the Hugging Face Transformers convention)
stay as the string `"auto"` until `fzero.resolve_auto` fills them in; the engine
refuses a config with any left (`fzero.config.auto.check_resolved`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from fzero.config._base import AUTO, ConfigError
from fzero.config._base import Section as _Section
from fzero.config.batch import BatchSizes, accumulation_steps, batch_sizes, batch_sizes_or_none
from fzero.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from fzero.optim import OPTIMIZER_PARAMS, SCHEDULE_PARAMS

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CSVConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "ZeroConfig",
    "accumulation_steps",
    "batch_sizes",
    "batch_sizes_or_none",
    "load_config",
    "read_config",
]


def _no_effect(default: Any, why: str) -> Any:
    """A DeepSpeed key accepted with any value of its type, which changes nothing in
    fzero: `why` says what DeepSpeed does with it and why fzero computes the same."""
    return field(default=default, metadata={"no_effect": why})


def _only_default(default: Any, why: str) -> Any:
    """A DeepSpeed key accepted only at its default: another value would change what is
    computed in a way fzero does not do, so it is refused with `why`."""
    return field(default=default, metadata={"only_default": why})


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(_Section):
    """Where fp32 master weights and optimizer state live, and where the update runs:
    host memory (ZeRO-Offload) or a swap file on disk (ZeRO-Infinity). Stages 1-3."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """Where fp32 master weights and optimizer state live (ZeRO-Offload / ZeRO-Infinity)."""
    nvme_path: str | None = None
    """Directory for state files when `device` is `nvme`."""
    pin_memory: bool = False
    """Page-lock host buffers (only meaningful with CUDA)."""
    buffer_count: int = 4
    """NVMe: host buffers (each one unit's partition of one state tensor) in the swap
    pool. The step pipelines max(2, buffer_count // tensors per unit) units (tensors per
    unit: master, each optimizer state, and the gradient in stages 2-3); backward keeps
    at most `buffer_count` gradient writes in flight."""
    swap_gradients: bool = True
    """fzero: with `device` nvme in stages 2-3, the gradient accumulators live in the swap
    file too, so host memory holds no whole-model buffer (a step moves 8 more bytes per
    parameter). False keeps them in host memory: faster where they fit."""
    fast_init: bool = _no_effect(
        False,
        "DeepSpeed skips writing the initial swap files eagerly; fzero writes each unit's "
        "state to its file once, as it builds the unit",
    )
    commit: Literal["two_slots", "in_place"] = "two_slots"
    """fzero, NVMe: how a step's new master and optimizer state reach the swap file.
    "two_slots" writes them beside the current ones and switches only when every rank
    has written everything: an I/O error mid-step changes nothing and the step can be
    run again (the state takes twice its size on disk). "in_place" overwrites the one
    copy (DeepSpeed's way, half the disk): an I/O error mid-step stops the engine with
    an error naming the step, and training goes on from the last checkpoint."""

    @property
    def on(self) -> bool:
        """Whether masters and optimizer state live off the device (cpu or nvme)."""
        return self.device in ("cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(_Section):
    """Where stage 3's compute-dtype parameter shards live between uses (stage 3 only)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """Where stage-3 parameter shards live between uses."""
    nvme_path: str | None = None
    """Directory for the parameter swap file when `device` is `nvme`."""
    pin_memory: bool = False
    """Page-lock the host copies (CUDA only). fzero pins host parameter shards when
    `offload_optimizer.pin_memory` is on; this key itself is not read yet."""
    buffer_count: int = 5
    """NVMe: parameter shard writes kept in flight after a step."""
    buffer_size: int = _no_effect(
        100_000_000,
        "DeepSpeed's elements per parameter swap buffer; fzero sizes each buffer to one "
        "unit's shard",
    )
    max_in_cpu: int = _no_effect(
        1_000_000_000,
        "DeepSpeed keeps up to this many parameter elements in host memory before the "
        "disk; fzero keeps every stage-3 shard where `device` says",
    )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(_Section):
    """ZeRO: which state is split across ranks (`stage`), how gradients are reduced and
    stage 3's parameters gathered, offload, ZeRO++ and MiCS."""

    stage: int = 0
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    allgather_partitions: bool = _no_effect(
        True,
        "false makes DeepSpeed broadcast each partition instead of one all-gather: the "
        "same values; fzero always all-gathers",
    )
    allgather_bucket_size: int = _no_effect(
        500_000_000,
        "DeepSpeed's elements per parameter all-gather; fzero gathers one plan unit at a "
        "time (the unit is the bucket)",
    )
    reduce_scatter: bool = _no_effect(
        True,
        "false makes DeepSpeed all-reduce gradients instead of reduce-scattering them: the "
        "same average; fzero reduces as the plan says (all-reduce where gloo lacks "
        "reduce-scatter)",
    )
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient-reduction bucket (a unit larger than that is a bucket of its
    own). At stages 2-3 backward holds one bucket of fp32 gradients at a time."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; DeepSpeed's default is on for stage 3 only.
    Off, each bucket is reduced when it fills and waited for there."""
    contiguous_gradients: bool = _no_effect(
        True,
        "DeepSpeed copies gradients into one buffer as they come; fzero's gradients "
        "always live in one flat buffer per unit",
    )
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    sub_group_size: int = _no_effect(
        1_000_000_000,
        "DeepSpeed's elements per optimizer sub-group step; fzero steps the optimizer "
        "one plan unit at a time",
    )
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of the next units (in the order the first step recorded) kept
    in flight, gathered ahead of their use."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3 keeps tensors with fewer elements than this whole on every rank."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: at most this many gathered parameter elements at once (prefetched and
    kept units count)."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Stage 3: a unit whose next use comes within this many elements of other units
    stays gathered (from forward into backward); 0 releases every unit after use."""
    stage3_eval_live_parameters: int = 0
    """fzero: elements stage 3 keeps gathered across forwards run without gradients
    (generation, evaluation), so decoding gathers each unit once rather than once per
    token; 0 (the default) releases them after each use as in training. Kept units go at
    the next backward, step or checkpoint load."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Each `save_checkpoint` also writes the whole model in the compute dtype to
    `<tag>/model.safetensors` (`engine.save_16bit_model` writes one on demand)."""
    zero_quantized_weights: bool = False
    """ZeRO++'s qwZ: stage 3's parameter all-gathers travel as blockwise int8 (256
    elements per fp32 scale, `fzero.core.quantize`); the gathered copies forward and
    backward run on are approximate, masters and shards exact. No effect at stages 0-2
    (no parameter gathers), as in DeepSpeed."""
    zero_quantized_gradients: bool = False
    """ZeRO++'s qgZ: stages 2-3 reduce gradients by one all-to-all of blockwise int8
    (each rank's contribution rounded within its block, summed in fp32 by the owner)
    instead of a reduce-scatter; no effect at stages 0-1 (whole gradients all-reduced)."""
    zero_quantized_gradients_bits: Literal[4, 8] = 8
    """fzero: the code width of qgZ's blocks (`zero_quantized_gradients`): 8 (int8, 1.016
    bytes per element) or 4 (int4, two codes a byte, 0.516 bytes per element; the rounding
    step of a block 18x int8's). DeepSpeed has no such key: its qgZ always sends int4
    (`all_to_all_quant_reduce`), so 4 is its wire size; fzero keeps int8 by default for
    accuracy. No effect without `zero_quantized_gradients`."""
    zero_hpz_partition_size: int = 1
    """ZeRO++'s hpZ: at stage 3, what forward gathered stays split within groups of this
    many ranks (a node), and backward gathers from that secondary copy; 1 is off. The
    engine runs it as a plan on a mesh (`partition.from_zero_config`); `fzero.init` and
    `train_step` are given one (`partition.mesh_plan(..., "hpz")`). No effect below
    stage 3."""
    mics_shard_size: int = -1
    """MiCS: at stage 3, every kind of state split within groups of this many ranks and
    replicated across the groups (each reduced gradient shard averaged over the
    replicas); -1 is off. Run as a plan on a mesh, as `zero_hpz_partition_size` is."""
    mics_hierarchical_params_gather: bool = False
    """MiCS's two-hop parameter gather across nodes: fzero gathers by one all-gather over
    the shard group (the same values) and says so in the log."""
    round_robin_gradients: bool = _no_effect(
        False,
        "the order DeepSpeed copies offloaded gradients in; the values are the same",
    )
    ignore_unused_parameters: bool = _only_default(
        True,
        "false makes DeepSpeed stop when a parameter gets no gradient; fzero counts such a "
        "gradient as zero, as DeepSpeed's default does",
    )
    load_from_fp32_weights: bool = _only_default(
        True,
        "false makes DeepSpeed rebuild fp32 masters from the 16-bit weights on load; "
        "fzero restores the saved masters exactly",
    )
    elastic_checkpoint: bool = _no_effect(
        False,
        "DeepSpeed's checkpoints reload on another world size only with it; fzero's "
        "always do (any N ranks to any M)",
    )


@dataclass(frozen=True, kw_only=True)
class FP16Config(_Section):
    """fp16 compute over fp32 masters, with a loss scale: a step whose gradients overflow
    is skipped and the dynamic scale lowered (DeepSpeed's `DynamicLossScaler`)."""

    enabled: bool = False
    """Compute in fp16."""
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """The dynamic scale doubles after this many steps without an overflow."""
    hysteresis: int = 2
    """The dynamic scale halves at the hysteresis-th overflow since it last grew (every
    overflowing step is skipped either way)."""
    consecutive_hysteresis: bool = False
    """Restore the hysteresis budget after every step without an overflow (not only when
    the scale grows)."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this; an overflow there, with the hysteresis
    spent, stops training with `LossScaleError`."""


@dataclass(frozen=True, kw_only=True)
class BF16Config(_Section):
    """bf16 compute over fp32 masters, or bf16 masters and optimizer states."""

    enabled: bool = False
    """Compute in bf16 (no loss scale needed)."""
    bf16_master_weights_and_grads: bool = False
    """Master weights in bf16: in memory they are the bf16 parameters themselves (held
    once, no fp32 copy); each update runs in fp32 and rounds the new weights back
    stochastically. Gradients are still reduced and accumulated in fp32 (fzero's
    accuracy choice: 4 B per element of this rank's gradient partition)."""
    bf16_optimizer_states: bool = False
    """The optimizer's moments (Adam's exp_avg and exp_avg_sq, SGD's momentum) kept in
    bf16 where they rest between steps — in memory, or in the NVMe swap file — and
    stochastically rounded after each update, which runs in fp32 (two bytes per moment
    per parameter instead of four). DeepSpeed asks for bf16 masters with it; fzero also
    takes it over fp32 masters."""


@dataclass(frozen=True, kw_only=True)
class TorchAutocastConfig(_Section):
    """DeepSpeed's `torch_autocast`: the forward under `torch.autocast` (over fp32
    parameters, or with `bf16` enabled over bf16 ones, as DeepSpeed allows)."""

    enabled: bool = False
    """Run the forward under `torch.autocast`."""
    dtype: Literal[
        "bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half", "torch.float16"
    ] = "bfloat16"
    """bfloat16 is supported; float16 would need a gradient scaler (not supported yet)."""
    lower_precision_safe_modules: list[str] | None = _no_effect(  # noqa: RUF009 (a field)
        None,
        "DeepSpeed reduces these modules' gradients in the low dtype; fzero reduces all "
        "gradients in fp32 (the same or better accuracy)",
    )


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(_Section):
    """DeepSpeed's activation checkpointing settings, read by
    `fzero.checkpointing.configure(None, deepspeed_config=...)` (`deepspeed.checkpointing`)."""

    partition_activations: bool = False
    """Splits saved activations across model-parallel ranks; fzero has none, so `true`
    is refused when `configure` reads it."""
    cpu_checkpointing: bool = False
    """Keep the saved block inputs in host memory."""
    contiguous_memory_optimization: bool = False
    """Model-parallel buffers for saved activations; `true` is refused, as
    `partition_activations`."""
    number_checkpoints: int | None = None
    """The number of checkpointed blocks DeepSpeed preallocates for; recorded (>= 1)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device around each checkpointed block (for timing)."""
    profile: bool = False
    """Time each checkpointed block's forward and recomputation (`checkpointing.timings()`)."""


@dataclass(frozen=True, kw_only=True)
class AioConfig(_Section):
    """The native I/O pool that reads and writes NVMe swap files (DeepSpeed's libaio
    settings)."""

    block_size: int = 1_048_576
    """Bytes per pread/pwrite of a swap transfer."""
    queue_depth: int = _no_effect(
        8,
        "libaio's queue depth; fzero's I/O is a pool of `thread_count` threads, each with "
        "one request at a time",
    )
    thread_count: int = 1
    """Threads of the native I/O pool (the requests in flight at once)."""
    single_submit: bool = _no_effect(False, "libaio-specific (see `queue_depth`)")
    overlap_events: bool = _no_effect(
        True, "libaio-specific: fzero's submission and completion always overlap"
    )


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig(_Section):
    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = _no_effect(
        None,
        "gradients are summed across micro-steps in fp32 at every precision (the "
        "reduction's fp32 buckets): null and fp32 are what fzero does; fp16 and bf16 are "
        "refused",
    )
    """The dtype gradients are summed in across micro-steps. fzero accumulates them in
    fp32 at every precision (its accumulators are the reduction's fp32 buckets), so
    null and "fp32" are accepted and "fp16" / "bf16" are refused by name."""

    def __post_init__(self) -> None:
        if self.grad_accum_dtype in ("fp16", "bf16"):
            raise ConfigError(
                f"config key 'data_types.grad_accum_dtype' is {self.grad_accum_dtype!r}; "
                "fzero accumulates gradients in fp32 at every precision (allowed: 'fp32' or "
                "null); for half the gradient bytes on the wire set "
                "communication_data_type instead"
            )


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
    """The optimizer the engine or `train_step` builds (a `type` and its `params`)."""

    type: str
    """Adam, AdamW, Lamb, SGD, Muon, Adagrad or Lion (any case)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The optimizer's hyper-parameters (`lr`, `betas`, `weight_decay`, ...; the table of
    allowed names per type is in the configuration guide)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(_Section):
    """The learning-rate schedule (a `type` and its `params`), stepped after each applied
    optimizer step."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest or WarmupExpDecayExp."""
    params: dict[str, Any] = field(default_factory=dict)
    """The schedule's settings (`warmup_num_steps`, `total_num_steps`, ...)."""


@dataclass(frozen=True, kw_only=True)
class Config(_Section):
    train_batch_size: int | None = None
    """Global batch: micro batch x accumulation steps x data-parallel world size."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank in one forward and backward (a micro-step); any two of the three
    batch keys give the third, and all three given must agree."""
    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step: `backward` divides by it and `step` updates at
    every this-many-th call."""
    optimizer: OptimizerConfig | None = None
    """The optimizer. Without it (and without one passed), `fzero.initialize` builds a
    forward-only engine, as DeepSpeed does; `fzero.shard` and `train_step` run AdamW's
    defaults."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; without it the learning rate stays the optimizer's."""
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm; 0 disables."""
    steps_per_print: int = 10
    """Report every this many optimizer steps; 0 never (so does `inf`, which the
    Transformers integration writes, as DeepSpeed reads it)."""
    wall_clock_breakdown: bool = False
    """The step report adds forward, backward, step and communication times."""
    memory_breakdown: bool = _no_effect(
        False,
        "DeepSpeed logs memory use when true; fzero's step report (every "
        "`steps_per_print`) always has memory held, planned and peak",
    )
    dataloader_drop_last: bool = False
    """The loader `initialize(training_data=...)` builds drops the last incomplete batch."""
    prescale_gradients: bool = _only_default(
        False,
        "true makes DeepSpeed divide gradients by the world size before summing them; "
        "fzero sums fp32 gradients and then divides (the average, rounded once)",
    )
    gradient_predivide_factor: float = _only_default(
        1.0,
        "DeepSpeed divides gradients by this before the sum and by world size / factor "
        "after (fp16 range); fzero sums fp32 gradients and then divides",
    )
    zero_allow_untested_optimizer: bool = _no_effect(
        False,
        "DeepSpeed lets ZeRO run a client optimizer it has not tested; fzero runs only "
        "its own optimizers (a torch Adam, AdamW or SGD as its functional twin, others "
        "refused by name), so there is nothing untested to allow",
    )
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """The dtype gradients travel in when reduced over ranks: null or "fp32" (fzero's
    default: fp32 at every precision, the average rounded once); "bf16" or "fp16" cast each
    bucket to it for its collectives and back to fp32 after (half the bytes on the wire,
    the sum rounded to it), as DeepSpeed does."""
    data_types: DataTypesConfig = field(
        default_factory=DataTypesConfig,
        metadata={"no_effect": "a section: its one key, grad_accum_dtype, says why"},
    )
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = field(default_factory=CSVConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    metrics_file: str | None = None
    """fzero: append one JSON line per `steps_per_print` (the logged figures) to this file."""
    progress: bool = True
    """fzero: a progress bar on rank 0 when stdout is a terminal."""
    strategy: str | None = None
    """fzero: the engine's partitioning strategy: a built-in's name (`flat_even`, the
    default, or `per_tensor_dim0`) or `module:function` naming your own; a `strategy=`
    given to `shard`/`initialize` wins over it."""
    collective_report_s: float | None = None
    """fzero: a rank that waits longer than this many seconds in one of fzero's
    collectives or agreements prints who is where (each rank's last collective and
    operation, or what it does outside fzero), then again after twice as long, ...;
    0 never. Default: `FZERO_REPORT_S`, else 30."""


# Keys DeepSpeed knows that fzero does not implement: accepted only while off.
_NOT_SUPPORTED = {
    "": {
        "amp",
        "autotuning",
        "checkpoint",
        "compression_training",
        "data_efficiency",
        "compile",
        "curriculum_learning",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "hybrid_engine",
        "nebula",
        "pipeline",
        "progressive_layer_drop",
        "quantize_training",
        "sparse_attention",
        "sparse_gradients",
        "tensor_parallel",
        "zenflow",
        "zero_force_ds_cpu_optimizer",
    },
    "zero_optimization": {
        "cpu_offload",
        "cpu_offload_params",
        "cpu_offload_use_pin_memory",
        "zeropp_loco_param",
        "stage3_module_granularity_threshold",
        "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear",
    },
    "fp16": {"auto_cast", "fp16_master_weights_and_grads"},
    "bf16": {"immediate_grad_update", "check_grad_overflow"},
    "zero_optimization.offload_optimizer": {"ratio"},
}

_ALIASES = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    },
}


def _is_off(value: Any) -> bool:
    """A block that is present but disabled (`{"enabled": false}`, `false`, `null`)."""
    if value is None or value is False:
        return True
    return isinstance(value, Mapping) and value.get("enabled", True) is False


def _unknown_key(key: str, known: set[str] | frozenset[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return ConfigError(f"unknown config key {where + key!r}; did you mean {close[0]!r}?")
    return ConfigError(f"unknown config key {where + key!r}; known keys here: {sorted(known)}")


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Check/convert one JSON value to the field's annotated type."""
    if value == AUTO:
        return AUTO
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"config key {key!r} is {value!r}; allowed: {list(allowed)}")
        return allowed[allowed.index(value)]  # as declared: 8.0 from JSON reads as 8
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} must be an object, found {value!r}")
        return _parse_section(hint, value, key + ".")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, found {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {key!r} must be an integer, found {value!r}")
        if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
            raise ConfigError(f"config key {key!r} must be a whole number, found {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {key!r} must be a number, found {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, found {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, found {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r} must be an object, found {value!r}")
        return dict(value)
    raise TypeError(f"config field {key!r} has an annotation fzero cannot parse: {hint!r}")


def _parse_section(cls: type, raw: Mapping[str, Any], where: str) -> Any:
    section = where.rstrip(".")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = set(fields)
    aliases = _ALIASES.get(section, {})
    unsupported = _NOT_SUPPORTED.get(section, set())
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name in known:
            if name in values:
                raise ConfigError(f"config key {where + name!r} is given twice (once as {key!r})")
            values[name] = _convert(value, hints[name], where + key)
            _check_default(fields[name], values[name], where + key)
        elif name in unsupported:
            if not _is_off(value):
                raise ConfigError(
                    f"config key {where + key!r} is not supported yet by fzero "
                    f"(found {value!r}); remove it or switch it off"
                )
        else:
            raise _unknown_key(key, known | set(aliases) | unsupported, where)
    return cls(**values)


def _check_default(spec: dataclasses.Field[Any], value: Any, key: str) -> None:
    """A key accepted only at its default (`_only_default`) with another value: refused."""
    why = spec.metadata.get("only_default")
    if why is not None and value != AUTO and value != spec.default:
        raise ConfigError(
            f"config key {key!r} is {value!r}; fzero allows only {spec.default!r}: {why}"
        )


def _check_params(
    block: str, kind: str, params: Mapping[str, Any], allowed: frozenset[str]
) -> None:
    for key in params:
        if key not in allowed:
            raise _unknown_key(key, allowed, f"{block}.params.({kind}).")


def _take_max_grad_norm(raw: dict[str, Any]) -> dict[str, Any]:
    """Move `optimizer.params.max_grad_norm` to `gradient_clipping`, with a warning."""
    params = (raw.get("optimizer") or {}).get("params") or {}
    if "max_grad_norm" not in params:
        return raw
    norm = params["max_grad_norm"]
    warnings.warn(
        "config key 'optimizer.params.max_grad_norm' is deprecated; fzero reads it as "
        f"'gradient_clipping': {norm!r}",
        FutureWarning,
        stacklevel=3,
    )
    given = raw.get("gradient_clipping")
    if given not in (None, 0, 0.0, norm):
        raise ConfigError(
            f"'optimizer.params.max_grad_norm' is {norm!r} but 'gradient_clipping' is {given!r}; "
            "give one of them"
        )
    optimizer = dict(raw["optimizer"])
    optimizer["params"] = {k: v for k, v in params.items() if k != "max_grad_norm"}
    return {**raw, "optimizer": optimizer, "gradient_clipping": norm}


def load_config(source: str | Path | Mapping[str, Any] | Config) -> Config:
    """Parse a DeepSpeed JSON config (a path or a dict) into a validated `Config`."""
    if isinstance(source, Config):
        return source
    raw = _take_max_grad_norm(dict(read_config(source)))
    if raw.get("steps_per_print") == math.inf:  # DeepSpeed's "never", from Transformers
        raw["steps_per_print"] = 0
    config = _parse_section(Config, raw, "")
    _check(config)
    return config


def read_config(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A DeepSpeed JSON config's raw object (from a path, or the dict itself), unparsed."""
    if isinstance(source, str | Path):
        path = Path(source)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {error}") from None
    elif isinstance(source, Mapping):
        raw = source
    else:
        raise ConfigError(
            f"config must be a path, a dict or a Config, found {type(source).__name__}"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a JSON object, found {type(raw).__name__}")
    return raw


def _check(config: Config) -> None:
    """Semantic checks across keys (skipped for values still "auto")."""
    zero = config.zero_optimization
    if zero.stage != AUTO and zero.stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'zero_optimization.stage' is {zero.stage}; allowed: 0-3")
    if config.fp16.enabled is True and config.bf16.enabled is True:
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; enable at most one")
    autocast = config.torch_autocast
    if autocast.enabled is True and autocast.dtype in ("float16", "fp16", "half", "torch.float16"):
        raise ConfigError(
            f"config key 'torch_autocast.dtype' {autocast.dtype!r} is not supported yet by "
            "fzero (it needs a gradient scaler); allowed: 'bfloat16'"
        )
    for name in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    ):
        value = getattr(config, name)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"config key {name!r} is {value}; it must be >= 1")
    if isinstance(config.gradient_clipping, float) and config.gradient_clipping < 0:
        raise ConfigError(f"'gradient_clipping' is {config.gradient_clipping}; it must be >= 0")
    report = config.collective_report_s
    if isinstance(report, float) and not (math.isfinite(report) and report >= 0):
        raise ConfigError(f"'collective_report_s' is {report}; it must be seconds >= 0")
    for block in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, block)
        if offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError(f"'zero_optimization.{block}.device' is 'nvme' but no nvme_path")
    if zero.offload_param.device not in ("none", AUTO) and zero.stage not in (3, AUTO):
        raise ConfigError(
            f"'zero_optimization.offload_param' needs stage 3, found stage {zero.stage}"
        )
    if zero.offload_optimizer.device not in ("none", AUTO) and zero.stage == 0:
        raise ConfigError("'zero_optimization.offload_optimizer' needs stage 1, 2 or 3, found 0")
    if (
        config.bf16.bf16_master_weights_and_grads is True
        and zero.offload_optimizer.device == "nvme"
    ):
        raise ConfigError(
            "config key 'bf16.bf16_master_weights_and_grads' is true but "
            "'zero_optimization.offload_optimizer.device' is 'nvme': the swap file holds "
            "fp32 masters only; use offload device 'cpu' or 'none', or fp32 masters with "
            "'bf16.bf16_optimizer_states' (bf16 moments in the file)"
        )
    if config.communication_data_type in ("fp16", "bf16") and zero.zero_quantized_gradients is True:
        raise ConfigError(
            f"config key 'communication_data_type' is {config.communication_data_type!r} "
            "with 'zero_optimization.zero_quantized_gradients' true: qgZ sends its own int8 "
            "or int4 codes; set one of them (communication_data_type: null or 'fp32')"
        )
    if config.optimizer is not None:
        kind = config.optimizer.type.lower()
        if kind not in OPTIMIZER_PARAMS:
            raise ConfigError(
                f"'optimizer.type' is {config.optimizer.type!r}; "
                "allowed: Adam, AdamW, Lamb, SGD, Muon, Adagrad, Lion"
            )
        _check_params("optimizer", kind, config.optimizer.params, OPTIMIZER_PARAMS[kind])
    if config.scheduler is not None:
        kind = config.scheduler.type.lower().replace("_", "")
        if kind not in SCHEDULE_PARAMS:
            raise ConfigError(
                f"'scheduler.type' is {config.scheduler.type!r}; allowed: WarmupLR, "
                "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, WarmupExpDecayExp"
            )
        _check_params("scheduler", kind, config.scheduler.params, SCHEDULE_PARAMS[kind])
