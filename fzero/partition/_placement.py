"""Where a plan's states live: `Memory` (the memory kind and dtype of each kind of
state), and `PlanError`, which every plan rule raises. Where its ranks lie on a mesh is
`fzero.partition._mesh`'s `OnMesh`; `fzero.partition._plan` holds the plan itself and
re-exports these.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEEPSPEED_DEVICE",
    "GRAD_DTYPES",
    "MEMORY_DTYPES",
    "MEMORY_KINDS",
    "Memory",
    "PlanError",
]


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the unit or tensor."""


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
