"""`deepspeed.runtime.zero.stage3`: DeepSpeed's ZeRO-3 memory estimators.

    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8)

prints, per offload option, the bytes of parameters, gradients and optimizer states a
CPU and a GPU need (DeepSpeed's "Memory Requirements" page), as DeepSpeed 0.19.8
computes and prints them, byte for byte: a planning aid for DeepSpeed's own layout
(fp16 parameters and gradients, fp32 Adam states). fzero's plans say where their own
bytes go (`fzero.partition.Plan.memory`); these figures are DeepSpeed's.
"""

from __future__ import annotations

from torch import nn

from fzero.compat.deepspeed.runtime.zero._estimate_table import print_header, print_row
from fzero.compat.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]

# the (offload_optimizer, offload_param) pairs DeepSpeed tabulates: parameters are
# offloaded only with the optimizer
_OFFLOADS = ((True, True), (True, False), (False, False))


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int | float]:
    """DeepSpeed's estimate of one option's bytes at ZeRO stage 3.

    Args:
        total_params (int): the model's parameters.
        largest_layer_params (int): the parameters of its largest module (gathered whole
            on the GPU while that module runs).
        num_gpus_per_node (int): GPUs (processes) per node.
        num_nodes (int): nodes.
        cpu_offload (bool): `offload_optimizer` to the CPU.
        cpu_offload_params (bool): `offload_param` to the CPU (with `cpu_offload`).
        zero_init (bool): the model built under `zero.Init` (no process holds it whole).
        additional_buffer_factor (float): the CPU figure's margin.

    Returns:
        tuple[int, int, int | float]: bytes per CPU (node), bytes per GPU, and the
        largest layer's bytes (`4 * largest_layer_params`, of its type).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes  # a node's CPU holds its processes' offloaded shares
    # the largest layer gathered whole on the GPU: fp16 parameters and fp16 gradients
    largest_layer_memory = 4 * largest_layer_params
    # (the products are DeepSpeed's, in its order, so the floats round as its do)
    if cpu_offload:
        # offloaded, per parameter: fp32 parameter, gradient, momentum and variance
        # (16 bytes) and, with `offload_param`, the fp16 parameter (2)
        state_bytes = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory
        if not cpu_offload_params:  # the GPU keeps its shard of fp16 parameters
            gpu_mem += int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * state_bytes * gpus_factor * additional_buffer_factor
        else:  # each of a node's processes first loads the whole model in fp32
            most = max(4 * num_gpus_per_node, state_bytes * gpus_factor)
            cpu_mem = total_params * most * additional_buffer_factor
    else:  # every GPU its shard of the 18 bytes a parameter; the CPU loads fp32 weights
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu_mem = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """The model's parameter count and its largest layer's, as DeepSpeed counts them.

    Args:
        model (nn.Module): the model.

    Returns:
        tuple[int, int]: the parameters (tensors sharing a storage start, `data_ptr`,
        counted once, as DeepSpeed does), and the most any one module holds itself
        (its own parameters, not its children's).
    """
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-3 memory table for `model` on this hardware.

    The counts come from the model (`model_to_params`); for a model not built, give
    them to `estimate_zero3_model_states_mem_needs_all_cold`. The GPUs are the
    arguments': nothing asks the accelerator (nor does DeepSpeed 0.19.8's).

    Args:
        model (nn.Module): the model.
        num_gpus_per_node (int): GPUs per node.
        num_nodes (int): nodes.
        additional_buffer_factor (float): the CPU figures' margin.
    """
    total_params, largest_layer_params = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params=total_params,
        largest_layer_params=largest_layer_params,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )


def _options(cpu_offload: bool, cpu_offload_params: bool, zero_init: bool) -> str:
    cpu = f"{OffloadDeviceEnum.cpu:4}"  # as DeepSpeed formats it (see OffloadDeviceEnum)
    return (
        f"offload_param={cpu if cpu_offload_params else 'none'}, "
        f"offload_optimizer={cpu if cpu_offload else 'none'}, "
        f"zero_init={int(zero_init)}"
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-3 memory table for a model of these sizes: per CPU and
    per GPU, for each offload option with and without `zero_init`.

    Args:
        total_params (int): the model's parameters.
        largest_layer_params (int): its largest module's own parameters.
        num_gpus_per_node (int): GPUs per node.
        num_nodes (int): nodes.
        additional_buffer_factor (float): the CPU figures' margin.
    """
    model = (
        f"SW: Model with {int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params."
    )
    print_header(num_nodes, num_gpus_per_node, model)
    for cpu_offload, cpu_offload_params in _OFFLOADS:
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params=total_params,
                largest_layer_params=largest_layer_params,
                num_gpus_per_node=num_gpus_per_node,
                num_nodes=num_nodes,
                cpu_offload=cpu_offload,
                cpu_offload_params=cpu_offload_params,
                zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor,
            )
            options = _options(cpu_offload, cpu_offload_params, zero_init)
            print_row(cpu_mem, gpu_mem, options)
