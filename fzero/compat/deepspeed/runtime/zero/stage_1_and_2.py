"""`deepspeed.runtime.zero.stage_1_and_2`: DeepSpeed's ZeRO-2 memory estimators.

    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8)

prints, with and without the optimizer offloaded to the CPU, the bytes of parameters,
gradients and optimizer states a CPU and a GPU need, as DeepSpeed 0.19.8 computes and
prints them, byte for byte: DeepSpeed's layout (fp16 parameters and gradients, fp32
Adam states), not fzero's (`fzero.partition.Plan.memory`). The ZeRO-3 ones are in
`deepspeed.runtime.zero.stage3`.
"""

from __future__ import annotations

from torch import nn

from fzero.compat.deepspeed.runtime.zero._estimate_table import print_header, print_row
from fzero.compat.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """DeepSpeed's estimate of one option's bytes at ZeRO stage 2.

    Args:
        total_params (int): the model's parameters.
        num_gpus_per_node (int): GPUs (processes) per node.
        num_nodes (int): nodes.
        cpu_offload (bool): `offload_optimizer` to the CPU.
        additional_buffer_factor (float): the CPU figure's margin.

    Returns:
        tuple[int, int]: bytes per CPU (node) and bytes per GPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    # every GPU holds the whole model in fp16 (2 bytes a parameter); the products are
    # DeepSpeed's, in its order, so the floats round as its do
    if cpu_offload:  # the CPU: 16 bytes a parameter (fp32 parameter, gradient, moments)
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:  # each GPU a shard of fp16 gradients and fp32 states: 2 + 4 + 4 + 8 bytes
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def model_to_params(model: nn.Module) -> int:
    """The model's parameter count as DeepSpeed counts it.

    Args:
        model (nn.Module): the model.

    Returns:
        int: its parameters, tensors sharing a storage start (`data_ptr`) counted once.
    """
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-2 memory table for `model` on this hardware.

    The count comes from the model (`model_to_params`); for a model not built, give it
    to `estimate_zero2_model_states_mem_needs_all_cold`. The GPUs are the arguments':
    nothing asks the accelerator (nor does DeepSpeed 0.19.8's).

    Args:
        model (nn.Module): the model.
        num_gpus_per_node (int): GPUs per node.
        num_nodes (int): nodes.
        additional_buffer_factor (float): the CPU figures' margin.
    """
    estimate_zero2_model_states_mem_needs_all_cold(
        total_params=model_to_params(model),
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-2 memory table for a model of this size: per CPU and per
    GPU, with the optimizer offloaded to the CPU and without.

    Args:
        total_params (int): the model's parameters.
        num_gpus_per_node (int): GPUs per node.
        num_nodes (int): nodes.
        additional_buffer_factor (float): the CPU figures' margin.
    """
    model = f"SW: Model with {int(total_params / 1e6)}M total params."
    print_header(num_nodes, num_gpus_per_node, model)
    cpu = f"{OffloadDeviceEnum.cpu:4}"  # as DeepSpeed formats it (see OffloadDeviceEnum)
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params=total_params,
            num_gpus_per_node=num_gpus_per_node,
            num_nodes=num_nodes,
            cpu_offload=cpu_offload,
            additional_buffer_factor=additional_buffer_factor,
        )
        options = f"offload_optimizer={cpu if cpu_offload else 'none'}"
        print_row(cpu_mem, gpu_mem, options)
