"""The table DeepSpeed's memory estimators print (`stage3`, `stage_1_and_2`): its
header, then one row per option, as DeepSpeed 0.19.8 formats them."""

from __future__ import annotations

__all__ = ["print_header", "print_row"]


def print_header(num_nodes: int, num_gpus_per_node: int, model: str) -> None:
    """The setup and model lines (`model`: "SW: Model with ..."), then the column titles."""
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"{model}"
    )
    print("  per CPU  |  per GPU |   Options")


def print_row(cpu_mem: float, gpu_mem: float, options: str) -> None:
    """One option's bytes per CPU and per GPU, in GiB."""
    print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options}")
