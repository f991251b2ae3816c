"""Where a plan's ranks and states lie: `OnMesh` (the processes a plan's ranks are on a
mesh, the axes each kind is split over) and `Memory` (the memory kind and dtype of each
kind of state), with the rules a plan on a mesh keeps (`validate_on_mesh`), and
`PlanError`, which every plan rule raises. `fzero.partition._plan` holds the plan
itself and re-exports these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEEPSPEED_DEVICE",
    "GRAD_DTYPES",
    "MEMORY_DTYPES",
    "MEMORY_KINDS",
    "Memory",
    "OnMesh",
    "PlanError",
    "validate_on_mesh",
]


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the unit or tensor."""


@dataclass(frozen=True)
class OnMesh:
    """Where a plan's ranks lie on a mesh of processes (`axes`: name and size, row-major,
    the last fastest, as `partition.Mesh`). The plan's rank `i` is every process whose
    index along the `shard` axes (row-major in that order) is `i`; the processes along
    the other axes hold the same shards (replicas: their gradients are averaged by an
    all-reduce over those axes). `secondary`: stage 3's parameters are kept after forward
    split over these axes only (a subset of `shard`: ZeRO++ hpZ), and backward gathers
    from that copy. `preset` names the mesh plan it came from. `hierarchical`: stage 3's
    parameter gathers run one all-gather per `shard` axis, the outermost first (MiCS's
    hierarchical all-gather: fewer, larger messages over the slow axis).
    `optimizer_extra`: the axes of `shard` (in mesh order) that only the optimizer state
    (and fp32 master) is split over; gradients and stage 3's parameters are split over
    the other axes of `shard` (`grads_shard`), each such shard holding
    `Plan.optimizer_extra_size` optimizer shards (the optimizer split over the world, the
    gradients within a node: the gradients reduce-scattered over their axes every
    micro-step, then over these at the accumulation boundary into the optimizer's shard).
    `shard` is the optimizer's order: with the extra axes last (`grads_shard` then
    `optimizer_extra`) a rank's optimizer shard lies in its gradient shard; in another
    order (`permuted`: the optimizer over ("node", "local"), the gradients over
    ("local",)) it lies in another rank's, and the boundary's blocks are exchanged with
    it (`Plan.rank_in_gradient_order`)."""

    axes: tuple[tuple[str, int], ...]
    shard: tuple[str, ...]
    secondary: tuple[str, ...] = ()
    preset: str = "custom"
    hierarchical: bool = False
    optimizer_extra: tuple[str, ...] = ()

    @property
    def processes(self) -> int:
        """Processes the plan runs on: the product of the axis sizes."""
        return math.prod(size for _, size in self.axes)

    @property
    def replicate(self) -> tuple[str, ...]:
        """The axes along which processes hold the same shards, in mesh order."""
        return tuple(name for name, _ in self.axes if name not in self.shard)

    @property
    def grads_shard(self) -> tuple[str, ...]:
        """The axes gradients and stage 3's parameters are split over: `shard` without
        `optimizer_extra` (with them, in mesh order)."""
        if not self.optimizer_extra:
            return self.shard
        return tuple(a for a, _ in self.axes if a in self.shard and a not in self.optimizer_extra)

    @property
    def gradient_order(self) -> tuple[str, ...]:
        """The axes in the order the accumulation boundary leaves optimizer blocks in:
        `grads_shard` then `optimizer_extra` (`shard` unless `permuted`)."""
        return self.grads_shard + self.optimizer_extra if self.optimizer_extra else self.shard

    @property
    def permuted(self) -> bool:
        """Whether the optimizer's shards are in another order than `gradient_order`
        (a rank's optimizer shard then lies in another rank's gradient shard); axes of
        size 1 order nothing."""
        sizes = dict(self.axes)
        moving = [a for a in self.gradient_order if sizes.get(a, 1) > 1]
        return moving != [a for a in self.shard if sizes.get(a, 1) > 1]


MEMORY_KINDS = ("device", "host", "nvme")
MEMORY_DTYPES = ("fp32", "bf16")
GRAD_DTYPES = ("fp32", "bf16", "fp16")
DEEPSPEED_DEVICE = {"device": "none", "host": "cpu", "nvme": "nvme"}  # offload_*.device


@dataclass(frozen=True)
class Memory:
    """Where each kind of a plan's state lives between uses (JAX's `memory_kind`), and
    the dtypes of the masters and optimizer states.

    `params`: stage 3's parameter shards; `optimizer`: the masters, the optimizer state
    and the update (with "nvme", stages 2-3 keep the gradient accumulators in the swap
    file too). Each is "device" (with the compute), "host" (host memory: ZeRO-Offload,
    Ren et al. 2021) or "nvme" (a swap file: ZeRO-Infinity, Rajbhandari et al. 2021).
    `master`: the masters' dtype, "fp32" or "bf16" (bf16 masters are the bf16 parameters
    themselves, so the compute dtype is bf16 too); `states`: the optimizer moments';
    `grads`: the gradient accumulators' (summed across micro-steps and held until the
    update), "fp32" or the compute dtype ("bf16", "fp16": half the accumulators' bytes,
    each micro-step's reduced gradient rounded into the sum; the update widens each
    unit's part to fp32). DeepSpeed's config says the same as
    `offload_param.device`, `offload_optimizer.device` ("none", "cpu", "nvme"),
    `bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states` and
    `data_types.grad_accum_dtype`; where a
    strategy's plan says nothing (the defaults), a door takes the config's
    (`with_memory`). Where files go and how they are read (paths, buffers, threads) stay
    the config's."""

    params: str = "device"
    optimizer: str = "device"
    master: str = "fp32"
    states: str = "fp32"
    grads: str = "fp32"


def validate_on_mesh(mesh: OnMesh, world_size: int, stage: int, uneven: str | None) -> None:
    """Raise `PlanError` unless `mesh` is where a plan of `world_size` ranks and stage
    `stage` can lie (`fzero.partition.validate`'s mesh rules); `uneven`: the name of the
    plan's first unit with uneven shards (None: none)."""
    sizes = dict(mesh.axes)
    named = [*mesh.shard, *mesh.secondary]
    unknown = [axis for axis in named if axis not in sizes]
    if unknown or len(sizes) != len(mesh.axes) or any(s < 1 for s in sizes.values()):
        raise PlanError(
            f"plan mesh {mesh.axes}: axes must be unique with sizes >= 1, and shard "
            f"{mesh.shard} / secondary {mesh.secondary} name only them (unknown: {unknown})"
        )
    group = math.prod(sizes[axis] for axis in mesh.shard)
    if group != world_size or len(set(mesh.shard)) != len(mesh.shard):
        raise PlanError(
            f"plan world_size {world_size} on mesh {mesh.axes} split over {mesh.shard}: "
            f"the shard axes' group has {group} ranks; they must be equal"
        )
    if mesh.hierarchical and (stage != 3 or mesh.secondary or len(mesh.grads_shard) < 2):
        raise PlanError(
            f"plan hierarchical gather over {mesh.grads_shard}: it is stage 3's (stage "
            f"{stage}), over two or more of the parameters' shard axes, and without "
            f"hpZ's secondary copy ({mesh.secondary})"
        )
    extra = mesh.optimizer_extra
    in_order = tuple(a for a, _ in mesh.axes if a in extra)
    if extra and (
        extra != in_order
        or len(set(extra)) != len(extra)
        or set(extra) - set(mesh.shard)
        or len(extra) == len(mesh.shard)
        or stage < 2
    ):
        raise PlanError(
            f"plan optimizer_extra {extra}: the optimizer's axes beyond the gradients' are "
            f"some of the shard axes {mesh.shard}, in mesh order, not all of them (the "
            f"gradients are split over at least one), at stage 2 or 3 (stage {stage})"
        )
    if extra and uneven is not None:
        raise PlanError(
            f"unit {uneven!r} optimizer: split over {mesh.shard}, finer than the "
            f"gradients ({mesh.grads_shard}), but the unit has uneven shards; a finer "
            "optimizer split runs for units with equal shards"
        )
    if mesh.secondary and (stage != 3 or set(mesh.secondary) - set(mesh.grads_shard)):
        raise PlanError(
            f"plan secondary split over {mesh.secondary}: hpZ's secondary copy is stage 3's "
            f"(stage {stage}) and a subset of the parameters' shard axes "
            f"{mesh.grads_shard}"
        )
