"""`deepspeed.runtime.utils`: the helpers clients import from it (`move_to_device`,
`see_memory_usage`)."""

from __future__ import annotations

import gc
import os
import resource
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fzero.compat.accelerator import get_accelerator

__all__ = ["move_to_device", "see_memory_usage"]

_GIB = 2**30
_GAP = " " * 9  # DeepSpeed's line continuation inside its f-string leaves these


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) with every tensor on
    `device`; anything else as it is. A tensor `criterion_func` accepts is moved in
    place (its data swapped, the same object returned), as DeepSpeed's does."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if criterion_func is not None and criterion_func(t):
            t.data = t.to(device).data
            return t
        return t.to(device)

    return pytree.tree_map_only(torch.Tensor, move, item)


def _resident_bytes() -> int:
    """This process's resident memory now (Linux `/proc/self/statm`; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _device_memory() -> tuple[int, int, int, int]:
    """Bytes allocated, peak allocated, reserved, peak reserved on the accelerator.

    On CUDA torch's caching allocator's figures. On the CPU, as DeepSpeed's CPU
    accelerator: the process's resident memory for both, and its peak (Linux reports
    the peak since the process started; DeepSpeed's since its last reset)."""
    if get_accelerator().device_name() == "cuda":
        return (
            torch.cuda.memory_allocated(),
            torch.cuda.max_memory_allocated(),
            torch.cuda.memory_reserved(),
            torch.cuda.max_memory_reserved(),
        )
    now = _resident_bytes()
    peak = max(now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB
    return now, peak, now, peak


def _host_memory() -> tuple[int, int]:
    """The machine's memory and what is available to new allocations without swapping:
    `MemTotal` and `MemAvailable` of `/proc/meminfo` (as psutil's `virtual_memory`, which
    DeepSpeed reads); elsewhere the physical and free pages."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        fields = {}
    if "MemTotal" in fields and "MemAvailable" in fields:
        return fields["MemTotal"], fields["MemAvailable"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message` and the memory in use, as DeepSpeed 0.19.8 prints them (to stdout,
    not through a logger), only when `force` and on rank 0 (any process before the
    process group starts).

    The second line is the accelerator's memory in GB (2**30 bytes): allocated (`MA`),
    its peak (`Max_MA`), reserved (`CA`) and its peak (`Max_CA`, rounded to a whole GB,
    as DeepSpeed rounds it); on the CPU the process's resident memory and its peak, as
    DeepSpeed's CPU accelerator reports. The third is the machine's memory in use
    (total less available) and its percentage. Python's garbage is collected first and
    the CUDA peaks are reset after, as DeepSpeed does. Needs no GPU.

    Args:
        message (str): the first line.
        force (bool): print at all (DeepSpeed's calls pass it to switch one on).
    """
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # Python frees cycles late; DeepSpeed collects before it reads memory
    print(message)
    allocated, peak_allocated, reserved, peak_reserved = _device_memory()
    print(
        f"MA {round(allocated / _GIB, 2)} GB{_GAP}Max_MA {round(peak_allocated / _GIB, 2)} GB"
        f"{_GAP}CA {round(reserved / _GIB, 2)} GB{_GAP}Max_CA {round(peak_reserved / _GIB)} GB "
    )
    total, available = _host_memory()
    used = total - available
    percent = round(used / total * 100, 1) if total else 0.0
    print(f"CPU Virtual Memory:  used = {round(used / _GIB, 2)} GB, percent = {percent}%")
    if get_accelerator().device_name() == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the next call's peaks are its own
