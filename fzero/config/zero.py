"""DeepSpeed's `zero_optimization` block: which state is split across ranks, how
gradients are reduced and stage 3's parameters gathered, offload (`fzero.config.offload`),
ZeRO++ and MiCS."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fzero.config._base import Section, no_effect, only_default
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
