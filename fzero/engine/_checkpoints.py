"""The engine's checkpoint methods, DeepSpeed's names and arguments (`save_checkpoint`,
`load_checkpoint`, `save_16bit_model`, ...): thin wrappers over
`fzero.engine.checkpoint_io`, mixed into `fzero.engine.Engine`. And `named`, which makes
an engine method a named operation (`fzero.comm.named_operation`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from fzero import comm

__all__ = ["CheckpointMethods", "named"]


def named(
    operation: str, *, entry: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An engine method whose collectives, if a rank never arrives, say which rank and
    where (`comm.named_operation`); with `entry`, every rank agrees it entered the
    method before it starts (an entry point a rank may skip: state_dict, checkpoints)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            where = f"{operation} of engine {self.name} (micro-step {self.micro_steps})"
            boundary = self.is_gradient_accumulation_boundary()
            track = f"{operation} of {self.name}|grad={torch.is_grad_enabled()}|{boundary}"
            with comm.named_operation(where, track, entry="always" if entry else "never"):
                return method(self, *args, **kwargs)

        return run

    return wrap


class CheckpointMethods:
    """Mixed into `fzero.engine.Engine`; reads the attributes annotated here."""

    config: Any
    rank: int
    module: Any
    name: str
    micro_steps: int
    is_gradient_accumulation_boundary: Callable[[], bool]
    state_dict: Callable[..., dict[str, Tensor]]

    @named("save_checkpoint", entry=True)
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        async_save: bool = False,
    ) -> str:
        """Save a sharded checkpoint to `save_dir/tag` (default tag `global_step{N}`) and
        point `save_dir/latest` at it; collective. `client_state` (ints, floats, strings,
        lists, dicts, tensors) comes back from `load_checkpoint`. With
        `exclude_frozen_parameters` (DeepSpeed's, for PEFT adapters) the frozen parameters
        are left out; load it with `load_module_strict=False` into a model that has them.
        With `async_save` the state is copied to host memory and written by a background
        thread; the next save, load or the process exit waits for it and raises its
        error. For a ZeRO or bf16 run rank 0 also writes DeepSpeed's conversion scripts
        into `save_dir` (`python save_dir/zero_to_fp32.py save_dir out_dir`)."""
        from fzero.engine import checkpoint_io as _engine_io

        return _engine_io.save_checkpoint(
            self, save_dir, tag, client_state, save_latest, async_save=async_save,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )  # fmt: skip

    @named("load_checkpoint", entry=True)
    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Load `load_dir/tag` (default: the tag in `load_dir/latest`), whatever world
        size, stage or strategy saved it; collective. Returns `(path, client_state)`, or
        `(None, None)` with a warning when there is no checkpoint (as DeepSpeed). DeepSpeed's
        arguments in its order; without `load_module_strict`, frozen parameters and
        buffers that the checkpoint or the module lacks are skipped."""
        from fzero.engine import checkpoint_io as _engine_io

        return _engine_io.load_checkpoint(
            self,
            load_dir,
            tag,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            load_module_strict=load_module_strict,
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Tensor] | None:
        """DeepSpeed's name (Accelerate and Transformers call it at save): the whole model's
        state dict in the compute dtype, on rank 0 (None elsewhere); collective. Without
        the frozen parameters when `exclude_frozen_parameters`. Gathered one unit at a
        time into a temporary file, the tensors mapped from it
        (`checkpoint_io.consolidated_16bit_state_dict`)."""
        from fzero.engine import checkpoint_io as _engine_io

        return _engine_io.consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    @named("save_16bit_model", entry=True)
    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        *,
        max_shard_size: str | int | None = None,
    ) -> bool:
        """The whole model in the compute dtype to `save_dir/save_filename` (safetensors,
        the model's own state_dict keys), written by rank 0 one unit at a time as it is
        gathered (no process holds more); collective. DeepSpeed's method, without its
        pickle file; with `max_shard_size` (e.g. "5GB"), Transformers' shards and index
        above that size."""
        from fzero.engine import checkpoint_io as _engine_io

        return _engine_io.save_16bit_model(
            self, save_dir, save_filename, exclude_frozen_parameters, max_shard_size
        )

    def save_fp16_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save has been written and committed."""
        from fzero.engine import checkpoint_io as _engine_io

        _engine_io.wait_for_save(self)
