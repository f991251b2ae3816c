"""DeepSpeed's `zero_optimization` block: which state is split across ranks, how
gradients are reduced and stage 3's parameters gathered, offload (`fzero.config.offload`),
ZeRO++ and MiCS."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from fzero.config._base import Section, no_effect, no_effect_object, only_default
from fzero.config.offload import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["ZeroConfig"]


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(Section):
    """ZeRO: which state is split across ranks (`stage`), how gradients are reduced and
    stage 3's parameters gathered, offload, ZeRO++ and MiCS."""

    stage: int = 0
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    allgather_partitions: bool = no_effect(
        True,
        "false makes DeepSpeed broadcast each partition instead of one all-gather: the "
        "same values; fzero always all-gathers",
    )
    allgather_bucket_size: int = no_effect(
        500_000_000,
        "DeepSpeed's elements per parameter all-gather; fzero gathers one plan unit at a "
        "time (the unit is the bucket)",
    )
    reduce_scatter: bool = no_effect(
        True,
        "false makes DeepSpeed all-reduce gradients instead of reduce-scattering them: the "
        "same average; fzero reduces as the plan says (all-reduce where gloo lacks "
        "reduce-scatter)",
    )
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient-reduction bucket (a unit larger than that is a bucket of its
    own). At stages 2-3 backward holds two buckets of fp32 gradients with `overlap_comm`
    (one filling, one being reduced), one without."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; DeepSpeed's default is on for stage 3 only.
    Off, each bucket is reduced when it fills and waited for there: backward holds one
    bucket of gradients instead of two, and its compute waits on each reduction."""
    contiguous_gradients: bool = no_effect(
        True,
        "DeepSpeed copies gradients into one buffer as they come; fzero's gradients "
        "always live in one flat buffer per unit",
    )
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    sub_group_size: int = 1_000_000_000
    """With `offload_optimizer.device` "nvme": the step reads, updates and writes each
    unit's optimizer partition in pieces of at most this many elements (DeepSpeed's
    optimizer sub-groups), rounded down to a multiple of 2048 (4 KiB of bf16; at least
    2048), so its swap buffers hold a piece, not the largest unit's partition. The same
    bits as whole units for optimizers whose update of an element reads only that element
    (Adam, AdamW, SGD, Adagrad, Lion); an optimizer that needs tensor norms (LAMB) steps
    whole units, and a value below such a unit's partition is refused. Checkpoints and
    backward's gradient writes still move whole units. In memory (no NVMe) no effect: the
    step updates one plan unit at a time in place."""
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
    instead of a reduce-scatter; no effect at stages 0-1 (whole gradients reduced once per step)."""
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
    round_robin_gradients: bool = no_effect(
        False,
        "the order DeepSpeed copies offloaded gradients in; the values are the same",
    )
    ignore_unused_parameters: bool = only_default(
        True,
        "false makes DeepSpeed stop when a parameter gets no gradient; fzero counts such a "
        "gradient as zero, as DeepSpeed's default does",
    )
    load_from_fp32_weights: bool = only_default(
        True,
        "false makes DeepSpeed rebuild fp32 masters from the 16-bit weights on load; "
        "fzero restores the saved masters exactly",
    )
    elastic_checkpoint: bool = no_effect(
        False,
        "DeepSpeed's checkpoints reload on another world size only with it; fzero's "
        "always do (any N ranks to any M)",
    )
    compute_grad_norm: bool = True
    """Stages 1-2: false lets DeepSpeed skip the global gradient norm, and with it (in
    fp32) the check that skips a step whose gradients are not finite; refused, as
    DeepSpeed refuses it, at stages 0 and 3, with `gradient_clipping` (DeepSpeed's
    default clips at 1.0) or with the optimizer offloaded. fzero still reports the norm
    (one 8-byte all-reduce); what false changes is that in fp32 such a step is applied
    (`fzero.core.update.skips_nonfinite`; bf16 follows `bf16.check_grad_overflow`)."""
    override_module_apply: bool = True
    """Stage 3 under `zero.Init` / `fzero.init_context`: `module.apply(fn)` called inside
    the context sees each module's parameters whole (gathered as `fn` reaches the
    module) and rank 0's edits become the partitions, as DeepSpeed's does; false runs
    `fn` on the partitioned placeholders (its edits are lost)."""
    legacy_stage1: bool = no_effect(
        False,
        "DeepSpeed's older ZeRO-1 code path; the same sharded update",
    )
    parameter_alignment: bool = no_effect(
        False,
        "DeepSpeed pads its flat buffers so each parameter starts 16-byte aligned; fzero's "
        "units are laid out by the plan (`alignment`), with the same values",
    )
    use_multi_rank_bucket_allreduce: bool = no_effect(
        True,
        "DeepSpeed all-reduces small buckets of several ranks instead of reducing each to "
        "its owner; the same averages, which fzero reduces as the plan says",
    )
    memory_efficient_linear: bool = no_effect(
        True,
        "DeepSpeed's stage 3 runs linear layers through its own autograd function that "
        "gathers the weight again in backward; fzero's stage 3 gathers every unit again "
        "in backward as its plan says (the same gradients)",
    )
    stage3_module_granularity_threshold: int = no_effect(
        0,
        "DeepSpeed fetches the parameters of fine-grained modules together; fzero fetches "
        "by plan unit (its strategy says how tensors group)",
    )
    stage3_use_all_reduce_for_fetch_params: bool = no_effect(
        False,
        "DeepSpeed gathers stage 3's parameters by an all-reduce instead of an all-gather: "
        "the same values; fzero all-gathers",
    )
    stage3_allgather_sequential: bool = no_effect(
        False,
        "DeepSpeed gathers stage 3's parameters one by one instead of by bucket: the same "
        "values; fzero gathers one plan unit at a time",
    )
    stage3_model_persistence_threshold: int = only_default(
        sys.maxsize,
        "DeepSpeed's budget of elements kept whole across the model; fzero keeps every "
        "tensor under stage3_param_persistence_threshold whole, without a budget",
    )
    zero_quantized_nontrainable_weights: bool = only_default(
        False,
        "DeepSpeed keeps frozen weights stored in int8 (changing what forward computes); "
        "fzero keeps them in their dtype",
    )
    pipeline_loading_checkpoint: bool = only_default(
        False,
        "DeepSpeed's stage 3 loading for pipeline-parallel models, which fzero does not run",
    )
    log_trace_cache_warnings: bool = no_effect(False, "DeepSpeed's trace-cache logging")
    enable_sanity_checks: bool = no_effect(False, "DeepSpeed's internal debugging checks")
    save_muon_momentum_buffer_in_memory: bool = no_effect(
        False,
        "DeepSpeed keeps Muon's momentum in memory when the rest of the state is on NVMe; "
        "fzero refuses Muon with NVMe offload by name",
    )
    leaf_module: dict[str, Any] = no_effect_object(  # noqa: RUF009 (a field)
        "DeepSpeed gathers a leaf module's parameters together (for "
        "mixtures of experts whose experts a step may not run); fzero's stage 3 runs "
        "such models as they are: a unit a pass does not use reduces zero gradients"
    )
