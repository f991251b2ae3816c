"""DeepSpeed-style JSON configuration, parsed into frozen, validated dataclasses.

`load_config` accepts a DeepSpeed `ds_config.json` (path or dict) as is. Every
key is checked: an unknown key is an error naming the closest known one, a
key DeepSpeed has but fzero does not implement is a "not supported yet" error
(unless it is switched off), and a wrong type or value names the key, the value
and what is allowed. `"auto"` values (the Hugging Face Transformers convention)
stay as the string `"auto"` until `fzero.resolve_auto` fills them in; the engine
refuses a config with any left (`fzero.config.auto.check_resolved`).

This module holds `Config` (the top-level keys, and the optimizer, scheduler and
activation checkpointing blocks), `load_config` and the checks across keys; its
sections live beside it, every public name importable from here:

- `fzero.config.zero`: `zero_optimization` (`ZeroConfig`);
- `fzero.config.offload`: `offload_optimizer`, `offload_param` and `aio`;
- `fzero.config.precision`: `fp16`, `bf16`, `torch_autocast` and `data_types`;
- `fzero.config.monitor`: the monitors, `comms_logger` and `flops_profiler`;
- `fzero.config.batch`: the batch arithmetic (`batch_sizes`);
- `fzero.config.auto`: `"auto"` values (`unresolved_auto`, `check_resolved`);
- `fzero.config._parse`: how a JSON object becomes a section (the keys fzero refuses,
  DeepSpeed's older names); `fzero.config._base`: what they share (`ConfigError`,
  `AUTO`, the markers of a key that changes nothing or is taken only at its default).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fzero.config._base import (
    AUTO,
    ConfigError,
    Section,
    no_effect,
    no_effect_object,
    only_default,
)
from fzero.config._parse import convert, parse_section, unknown_key
from fzero.config.batch import BatchSizes, accumulation_steps, batch_sizes, batch_sizes_or_none
from fzero.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from fzero.config.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from fzero.config.precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from fzero.config.zero import ZeroConfig
from fzero.optim import (
    OPTIMIZER_HINTS,
    OPTIMIZER_PARAMS,
    SCHEDULE_HINTS,
    SCHEDULE_PARAMS,
    check_fixed_params,
)

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CSVConfig",
    "CheckpointConfig",
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


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(Section):
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


TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    """DeepSpeed's `checkpoint` block: how a save checks its tag and where files go."""

    tag_validation: str = no_effect(
        "Warn",
        "DeepSpeed warns (Warn), says nothing (Ignore) or stops (Fail) when ranks save "
        "under different tags; an fzero checkpoint is one directory that every rank "
        "writes its shard into, so a save whose ranks name different tags always stops, "
        "naming each rank's (DeepSpeed's Fail); any case of Warn, Ignore or Fail",
    )
    load_universal: bool = only_default(
        False,
        "DeepSpeed loads its universal checkpoints (converted offline to reshard); "
        "fzero's own checkpoints load under any world size and plan as they are",
    )
    use_node_local_storage: bool = only_default(
        False,
        "DeepSpeed writes each node's files to storage only that node sees; fzero writes "
        "one directory that every rank reads back",
    )
    parallel_write: dict[str, Any] = no_effect_object(  # noqa: RUF009 (a field)
        "DeepSpeed's writing by pipeline stage; fzero runs no pipeline "
        "parallelism (its `pipeline` block is refused), and every rank writes its own "
        "shard of a checkpoint"
    )


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    """The optimizer the engine or `train_step` builds (a `type` and its `params`)."""

    type: str
    """Adam, AdamW, Lamb, SGD, Muon, Adagrad or Lion (any case)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The optimizer's hyper-parameters (`lr`, `betas`, `weight_decay`, ...; the table of
    allowed names per type is in the configuration guide)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Section):
    """The learning-rate schedule (a `type` and its `params`), stepped after each applied
    optimizer step."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest or WarmupExpDecayExp."""
    params: dict[str, Any] = field(default_factory=dict)
    """The schedule's settings (`warmup_num_steps`, `total_num_steps`, ...)."""


@dataclass(frozen=True, kw_only=True)
class Config(Section):
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
    memory_breakdown: bool = no_effect(
        False,
        "DeepSpeed logs memory use when true; fzero's step report (every "
        "`steps_per_print`) always has memory held, planned and peak",
    )
    dataloader_drop_last: bool = False
    """The loader `initialize(training_data=...)` builds drops the last incomplete batch."""
    prescale_gradients: bool = only_default(
        False,
        "true makes DeepSpeed divide gradients by the world size before summing them; "
        "fzero sums fp32 gradients and then divides (the average, rounded once)",
    )
    gradient_predivide_factor: float = only_default(
        1.0,
        "DeepSpeed divides gradients by this before the sum and by world size / factor "
        "after (fp16 range); fzero sums fp32 gradients and then divides",
    )
    zero_allow_untested_optimizer: bool = no_effect(
        False,
        "DeepSpeed lets ZeRO run a client optimizer it has not tested; fzero runs only "
        "its own optimizers (a torch Adam, AdamW or SGD as its functional twin, others "
        "refused by name), so there is nothing untested to allow",
    )
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    zero_force_ds_cpu_optimizer: bool = no_effect(
        True,
        "DeepSpeed refuses a client torch optimizer beside ZeRO-Offload unless this is "
        "false (its CPU Adam is the fast one); fzero runs its own fused CPU twin of a torch "
        "Adam, AdamW or SGD either way",
    )
    disable_allgather: bool = no_effect(
        False, "DeepSpeed 0.19 reads it and uses it nowhere; the parameters are gathered alike"
    )
    disable_python_gc: bool = no_effect(
        False,
        "DeepSpeed turns Python's automatic garbage collection off and leaves "
        "`engine.collect_python_gc()` to the script; fzero leaves the collector as it is "
        "(the values computed are the same) and serves that method",
    )
    managed_gradient_accumulation: bool = only_default(
        True,
        "false makes DeepSpeed leave the accumulation boundary to the script (each "
        "`step()` call steps); fzero steps every `gradient_accumulation_steps` micro-steps",
    )
    gradient_allreduce_op: Literal["mean", "sum"] = only_default(
        "mean",
        '"sum" makes DeepSpeed sum gradients over ranks without dividing by the world '
        "size; fzero averages them",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    """The level of the logger fzero (and its `deepspeed.utils.logger`) logs through, set
    when the engine is built, as DeepSpeed sets its own; null leaves it as it is."""
    sequence_parallel_size: int = only_default(
        1,
        "DeepSpeed's Ulysses sequence parallelism splits each sequence over this many "
        "ranks; fzero has none",
    )
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] = no_effect(
        "fp32", "the dtype of Ulysses' sequence-parallel all-to-alls; fzero has none"
    )
    use_data_before_expert_parallelism: bool = no_effect(
        False,
        "orders the ranks of MoE expert groups; fzero has no expert parallelism "
        "(`expert_parallel` is refused)",
    )
    vocabulary_size: int | None = no_effect(
        None, "DeepSpeed only warns when it is not a multiple of 8"
    )
    timers: dict[str, Any] = no_effect_object(  # noqa: RUF009 (a field)
        "DeepSpeed's throughput timer for its own log lines; fzero's step report times "
        "itself (and `wall_clock_breakdown` adds the phases)"
    )
    pipeline: dict[str, Any] = no_effect_object(  # noqa: RUF009 (a field)
        "read only by DeepSpeed's PipelineEngine, for a `deepspeed.pipe.PipelineModule`; "
        "fzero does not serve `deepspeed.pipe`, so every model it runs ignores the block, "
        "as DeepSpeed does for one that is not a PipelineModule"
    )
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """The dtype gradients travel in when reduced over ranks: null or "fp32" (fzero's
    default: fp32 at every precision, the average rounded once); "bf16" or "fp16" cast each
    bucket to it for its collectives and back to fp32 after (half the bytes on the wire,
    the sum rounded to it), as DeepSpeed does."""
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    """The dtypes DeepSpeed lets a config say apart from the precision blocks: its one
    key, `grad_accum_dtype`, the dtype gradients are summed in across micro-steps."""
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
    unit_stages: dict[str, int] | None = None
    """fzero: some units split as a lower ZeRO stage than `zero_optimization.stage`: unit
    names or module paths (a path covers the modules under it) to a stage, e.g.
    `{"embed": 1}` with stage 3 is ZeRO-1 for the embeddings, ZeRO-3 for the rest
    (`fzero.partition.set_unit_stages`, applied to whichever strategy lays the model out)."""
    collective_report_s: float | None = None
    """fzero: a rank that waits longer than this many seconds in one of fzero's
    collectives or agreements prints who is where (each rank's last collective and
    operation, or what it does outside fzero), then again after twice as long, ...;
    0 never. Default: `FZERO_REPORT_S`, else 30."""


def _check_grad_accum_dtype(config: Config) -> None:
    """`data_types.grad_accum_dtype`: fp32, or the dtype the run computes in (a half dtype
    whose block is off is refused), and not fp16 in the NVMe swap file (fp32 or bf16)."""
    accum = config.data_types.grad_accum_dtype
    if accum not in ("fp16", "bf16"):
        return
    block = getattr(config, accum)
    if block.enabled is False:
        raise ConfigError(
            f"config key 'data_types.grad_accum_dtype' is {accum!r} but '{accum}.enabled' is "
            "false: gradients accumulate in fp32 or in the dtype the model computes in "
            f"(DeepSpeed's ZeRO accumulates in the model's dtype whatever this key says); "
            f"enable the {accum} block or set grad_accum_dtype 'fp32' or null"
        )
    zero = config.zero_optimization
    if accum == "fp16" and zero.offload_optimizer.device == "nvme" and zero.stage in (2, 3):
        raise ConfigError(
            f"config key 'data_types.grad_accum_dtype' is {accum!r} with "
            f"'zero_optimization.offload_optimizer.device' 'nvme' at stage {zero.stage}: "
            "the gradient accumulators live in the swap file, which holds fp32 or bf16 "
            "ones; set grad_accum_dtype 'fp32' or null, or offload to 'cpu'"
        )


def _check_params(
    block: str, kind: str, params: Mapping[str, Any], allowed: frozenset[str]
) -> None:
    for key in params:
        if key not in allowed:
            raise unknown_key(key, allowed, f"{block}.params.({kind}).")


def _check_types(block: str, params: Mapping[str, Any], hints: Mapping[str, Any]) -> None:
    """Each param's value against its builder's annotation (the config's own check of
    every key): `"lr": "1e-3"` or three betas are refused naming the key."""
    for key, value in params.items():
        if key in hints:
            convert(value, hints[key], f"{block}.params.{key}")


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


_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _take_deprecated_offload(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's deprecated `zero_optimization` keys, read as DeepSpeed 0.19.8 reads
    them: `cpu_offload: true` is `offload_optimizer: {"device": "cpu"}`,
    `cpu_offload_param: true` is `offload_param: {"device": "cpu"}` (refused beside the
    key that replaces it, as DeepSpeed refuses it), `cpu_offload_use_pin_memory` sets
    nothing (as in DeepSpeed)."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, Mapping) or not any(
        k in zero for k in (*_DEPRECATED_OFFLOAD, "cpu_offload_use_pin_memory")
    ):
        return raw
    zero = dict(zero)
    for old, new in _DEPRECATED_OFFLOAD.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if not (value is None or isinstance(value, bool)):
            raise ConfigError(
                f"config key 'zero_optimization.{old}' must be true, false or null, found "
                f"{value!r} (deprecated: use 'zero_optimization.{new}')"
            )
        if new in zero:
            raise ConfigError(
                f"config keys 'zero_optimization.{old}' (deprecated) and "
                f"'zero_optimization.{new}' are both given; give only {new!r}, as DeepSpeed "
                "refuses both together"
            )
        if value:
            zero[new] = {"device": "cpu"}
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if not (pin is None or isinstance(pin, bool)):
        raise ConfigError(
            f"config key 'zero_optimization.cpu_offload_use_pin_memory' must be true, false "
            f"or null, found {pin!r} (deprecated: use the offload blocks' 'pin_memory')"
        )
    return {**raw, "zero_optimization": zero}


def load_config(source: str | Path | Mapping[str, Any] | Config) -> Config:
    """Parse a DeepSpeed JSON config (a path or a dict) into a validated `Config`."""
    if isinstance(source, Config):
        return source
    raw = _take_deprecated_offload(_take_max_grad_norm(dict(read_config(source))))
    if raw.get("steps_per_print") == math.inf:  # DeepSpeed's "never", from Transformers
        raw["steps_per_print"] = 0
    config = parse_section(Config, raw, "")
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
    _check_compute_grad_norm(config)
    mode = config.checkpoint.tag_validation
    if isinstance(mode, str) and mode != AUTO and mode.upper() not in TAG_VALIDATION_MODES:
        raise ConfigError(
            f"config key 'checkpoint.tag_validation' is {mode!r}; allowed (any case): "
            "Warn, Ignore, Fail"
        )
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
    _check_grad_accum_dtype(config)
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
        try:
            check_fixed_params(config.optimizer.params)
        except ValueError as error:
            raise ConfigError(f"config key {error}") from None
        _check_types("optimizer", config.optimizer.params, OPTIMIZER_HINTS[kind])
    if config.scheduler is not None:
        kind = config.scheduler.type.lower().replace("_", "")
        if kind not in SCHEDULE_PARAMS:
            raise ConfigError(
                f"'scheduler.type' is {config.scheduler.type!r}; allowed: WarmupLR, "
                "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, WarmupExpDecayExp"
            )
        _check_params("scheduler", kind, config.scheduler.params, SCHEDULE_PARAMS[kind])
        _check_types("scheduler", config.scheduler.params, SCHEDULE_HINTS[kind])


def _check_compute_grad_norm(config: Config) -> None:
    """`zero_optimization.compute_grad_norm: false` where DeepSpeed takes it: stages 1-2,
    no `gradient_clipping`, the optimizer on the device (its messages' conditions)."""
    zero = config.zero_optimization
    if zero.compute_grad_norm is not False:
        return
    why = ""
    if zero.stage not in (1, 2, AUTO):
        why = f"it is supported only at ZeRO stages 1 and 2 (stage {zero.stage})"
    elif config.gradient_clipping not in (0, 0.0, None, AUTO):
        why = f"it needs gradient_clipping 0 (found {config.gradient_clipping})"
    elif zero.offload_optimizer.device not in ("none", AUTO):
        why = f"it does not run with offload_optimizer.device {zero.offload_optimizer.device!r}"
    if why:
        raise ConfigError(
            f"config key 'zero_optimization.compute_grad_norm' is false but {why}, as "
            "DeepSpeed says; remove it"
        )
