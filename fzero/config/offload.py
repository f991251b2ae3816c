"""Where state lives off the device: `zero_optimization.offload_optimizer` (masters and
optimizer state in host memory or an NVMe swap file), `zero_optimization.offload_param`
(stage 3's parameter shards) and `aio` (the native I/O pool that moves swap files), with
DeepSpeed's keys and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fzero.config._base import Section, no_effect, only_default

__all__ = ["AioConfig", "OffloadOptimizerConfig", "OffloadParamConfig"]


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(Section):
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
    as many gradient writes in flight as the step has units in its pipeline."""
    swap_gradients: bool = True
    """fzero: with `device` nvme in stages 2-3, the gradient accumulators live in the swap
    file too, so host memory holds no whole-model buffer (a step moves 8 more bytes per
    parameter). False keeps them in host memory: faster where they fit."""
    fast_init: bool = no_effect(
        False,
        "DeepSpeed skips writing the initial swap files eagerly; fzero writes each unit's "
        "state to its file once, as it builds the unit",
    )
    pipeline_read: bool = no_effect(
        False,
        "DeepSpeed overlaps reading the next sub-group's state with the update; fzero's "
        "step always reads units ahead of the one it updates (`buffer_count`)",
    )
    pipeline_write: bool = no_effect(
        False,
        "DeepSpeed overlaps writing the updated state with the next update; fzero's step "
        "always writes behind it",
    )
    cpuadam_cores_perc: float = no_effect(
        0.8,
        "the share of host cores DeepSpeed's CPU Adam runs on; fzero's host update uses "
        "torch's threads (the same values)",
    )
    ratio: float = only_default(
        1.0,
        "DeepSpeed's partial offload (ZeRO-3 only) keeps that share of the optimizer state "
        "on the host and the rest on the device; fzero offloads each unit whole (per unit: "
        "a plan's `unit_memory`)",
    )
    super_offload: bool = only_default(
        False,
        "DeepSpeed's SuperOffload (a CPU update pipelined with the GPU's, for superchips); "
        "fzero runs the host update of ZeRO-Offload",
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
class OffloadParamConfig(Section):
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
    buffer_size: int = no_effect(
        100_000_000,
        "DeepSpeed's elements per parameter swap buffer; fzero sizes each buffer to one "
        "unit's shard",
    )
    max_in_cpu: int = no_effect(
        1_000_000_000,
        "DeepSpeed keeps up to this many parameter elements in host memory before the "
        "disk; fzero keeps every stage-3 shard where `device` says",
    )


@dataclass(frozen=True, kw_only=True)
class AioConfig(Section):
    """The native I/O pool that reads and writes NVMe swap files (DeepSpeed's libaio
    settings)."""

    block_size: int = 1_048_576
    """Bytes per pread/pwrite of a swap transfer."""
    queue_depth: int = no_effect(
        8,
        "libaio's queue depth; fzero's I/O is a pool of `thread_count` threads, each with "
        "one request at a time",
    )
    thread_count: int = 1
    """Threads of the native I/O pool (the requests in flight at once); DeepSpeed 0.19
    names it `intra_op_parallelism`, which fzero reads as this key."""
    use_gds: bool = no_effect(
        False,
        "DeepSpeed moves swap files by NVIDIA GPUDirect Storage; fzero reads and writes "
        "them through host buffers (the same bytes)",
    )
    single_submit: bool = no_effect(False, "libaio-specific (see `queue_depth`)")
    overlap_events: bool = no_effect(
        True, "libaio-specific: fzero's submission and completion always overlap"
    )
