"""The device fzero trains on, behind DeepSpeed's `get_accelerator()` interface.

Scripts written for DeepSpeed ask `get_accelerator()` for device names, seeds,
synchronisation and memory figures instead of calling `torch.cuda` directly, so
the same script runs on CPU and GPU. fzero answers with CUDA when PyTorch sees a
GPU and with the CPU otherwise; the communication backend is NCCL or gloo, as
`fzero.comm` starts it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """DeepSpeed's accelerator object for one device kind (`"cuda"` or `"cpu"`)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"accelerator kind is {kind!r}; allowed: 'cuda', 'cpu'")
        self._name = kind
        self._communication_backend_name = "nccl" if kind == "cuda" else "gloo"

    # ---- devices ----------------------------------------------------------------------

    def is_available(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        """`"cuda"`/`"cuda:N"`, or `"cpu"` (which has no index)."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        if self._name == "cuda":
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        if self._name == "cuda":
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return 1

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        """True where work runs in program order (the CPU); GPUs run streams."""
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    # ---- numbers ----------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        if self._name == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def is_triton_supported(self) -> bool:
        return False

    # ---- random numbers ---------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._name == "cpu" else torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cpu":
            return torch.get_rng_state()
        return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cpu":
            torch.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")

    def random(self) -> Any:
        return torch.random

    # ---- memory -----------------------------------------------------------------------

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._name == "cuda" and tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- streams, ranges ----------------------------------------------------------------

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if self._name == "cuda":
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._name == "cuda" else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._name == "cuda" else None

    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        if self._name == "cuda":
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when PyTorch sees a GPU, else the CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _ACCELERATOR
