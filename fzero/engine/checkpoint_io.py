"""`Engine.save_checkpoint` / `Engine.load_checkpoint`: DeepSpeed's semantics over
`fzero.checkpoint.save` / `restore` of the engine's `TrainState`.

What the engine adds to its state's checkpoint (`Extras`): the module's frozen
parameters and buffers, its config, batch sizes, scheduler and client optimizer groups,
the process's random-number states, and DeepSpeed's consolidated 16-bit model when
`stage3_gather_16bit_weights_on_model_save` asks for it. A missing checkpoint warns and
returns `(None, None)`, as DeepSpeed's does.

Whole-model files (`save_16bit_model`, the checkpoint's 16-bit model, the state dict
Transformers' Trainer saves) are streamed: gathered one unit at a time
(`fzero.core.init.stream_state_dict`) and written by rank 0 as they come, so no process
holds more than one unit gathered.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from fzero import comm
from fzero.checkpoint._consolidate import write_model_files
from fzero.checkpoint._files import CheckpointError, write_safetensors_stream
from fzero.checkpoint._format import (
    INDEX,
    jsonable,
    process_rng,
    read_index,
    read_latest,
    restore_process_rng,
    saved_rng,
)
from fzero.checkpoint._restore import PartlyRestoredError, find, restore
from fzero.checkpoint._save import (
    Extras,
    WrittenModel,
    frozen_keys,
    module_tensors,
    same_on_every_rank,
    save,
    wait_for_save,
)
from fzero.core.init import ModelStream, stream_state_dict
from fzero.core.layout import UnitRuntime
from fzero.core.publish import install, rolled_back
from fzero.core.residency import Residency
from fzero.core.state import TrainState
from fzero.core.swap_pieces import master_copy
from fzero.engine.recovery_scripts import write_recovery_scripts
from fzero.optim import Optimizer
from fzero.partition import Plan


class Engine(Protocol):
    """What saving and loading read and set of an engine (`fzero.engine.Engine`; this
    module sits below it): its state, counters, schedulers and batch settings."""

    module: torch.nn.Module
    config: Any
    plan: Plan
    plan_rank: int
    rank: int
    world_size: int
    serial: int
    batch: Any
    precision: str
    units: list[UnitRuntime]
    residency: Residency
    compute_dtype: torch.dtype
    functional_optimizer: Optimizer
    loss_scaler: Any
    loss_scale_state: Any
    lr_scheduler: Any
    config_scheduler: Any
    boundary_override: bool | None
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    lr_steps: int

    @property
    def train_state(self) -> TrainState: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]: ...

    def gradient_accumulation_steps(self) -> int: ...

    def publish_master(self, rt: UnitRuntime, written: torch.Tensor | None = None) -> None: ...

    def finish_publish(self) -> None: ...


__all__ = [
    "consolidated_16bit_state_dict",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "stream_model",
    "wait_for_save",
]

log = logging.getLogger("fzero")


def _extras(
    engine: Engine, for_save: bool, exclude_frozen: bool = False, save_dir: str = ""
) -> Extras:
    module = engine.module
    tensors = module_tensors(engine.plan, module)
    keys = list(module.state_dict(keep_vars=True))
    frozen = frozen_keys(module, tensors)
    if exclude_frozen:  # DeepSpeed's exclude_frozen_parameters: buffers stay
        tensors = {k: t for k, t in tensors.items() if k not in frozen}
        keys = [k for k in keys if k not in frozen]
        frozen = frozenset()
    extras = Extras(module=tensors, keys=keys, frozen=frozen, group_key=engine.serial)
    if not for_save:
        return extras
    batch = engine.batch
    model_16bit: Any = {}
    if engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        model_16bit = _written_16bit(engine, save_dir)  # DeepSpeed's switch: the model too
    return Extras(
        module=extras.module,
        keys=extras.keys,
        frozen=extras.frozen,
        config=engine.config,
        precision=engine.precision,
        batch={
            "train_batch_size": batch.train_batch_size if batch else None,
            "micro_batch_size": batch.micro_batch_size if batch else None,
        },
        scheduler=_scheduler_state(engine),
        model_16bit=model_16bit,
        rng=process_rng(),
        group_key=engine.serial,
    )


def _accumulation(engine: Engine) -> int | None:
    """The accumulation steps that micro-steps count, or None when the caller manages the
    windows (`set_gradient_accumulation_boundary`): then a save is mid-window when any
    gradient is held, and a load keeps the saved micro-step count."""
    if engine.boundary_override is not None:
        return None
    return engine.gradient_accumulation_steps()


def _scheduler_state(engine: Engine) -> dict[str, Any]:
    state: dict[str, Any] = {"client": None, "client_groups": None}
    scheduler = engine.lr_scheduler  # a config schedule's position is `lr_steps`
    if scheduler is not None and scheduler is not engine.config_scheduler:
        client = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
        state["client"] = jsonable(client)
    # The param groups' hyper-parameters as the next step would use them (a client
    # optimizer's, or the engine's own, which a client scheduler sets): a resumed step
    # uses the saved lr, not the one the groups started with.
    state["client_groups"] = [
        {k: jsonable(v) for k, v in g.items() if k != "params"} for g in engine.param_groups
    ]
    return state


def save_checkpoint(
    engine: Engine,
    save_dir: str,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    async_save: bool = False,
    exclude_frozen_parameters: bool = False,
) -> str:
    """See `Engine.save_checkpoint`. Returns the checkpoint's directory. Rank 0 writes
    DeepSpeed's conversion scripts into `save_dir` (`recovery_scripts`) for a ZeRO or
    bf16 run, as DeepSpeed's does."""
    wait_for_save(engine)
    engine.residency.check_usable()  # a failed in-place step: nothing whole to save
    directory = save(
        save_dir,
        engine.train_state,
        optimizer=engine.functional_optimizer,
        tag=tag,
        client_state=client_state,
        accumulation=_accumulation(engine),
        save_latest=save_latest,
        async_save=async_save,
        extras=_extras(
            engine, for_save=True, exclude_frozen=exclude_frozen_parameters, save_dir=save_dir
        ),
        owner=engine,
    )
    # DeepSpeed's rank 0 copies its conversion scripts beside each ZeRO (or bf16) checkpoint
    if engine.rank == 0 and (engine.plan.stage >= 1 or engine.config.bf16.enabled):
        write_recovery_scripts(os.fspath(save_dir))
    return directory


def _tags(load_dir: str) -> list[str]:
    """The checkpoint directories in `load_dir` (those with an index)."""
    if not os.path.isdir(load_dir):
        return []
    return sorted(
        name for name in os.listdir(load_dir) if os.path.isfile(os.path.join(load_dir, name, INDEX))
    )


def load_checkpoint(
    engine: Engine,
    load_dir: str,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    load_module_strict: bool = True,
) -> tuple[str | None, Any]:
    """See `Engine.load_checkpoint`."""
    wait_for_save(engine)
    load_dir = os.fspath(load_dir)
    extras = _extras(engine, for_save=False)
    same_on_every_rank(
        comm.side_group(extras.group_key), "load_checkpoint", load_dir=load_dir, tag=tag
    )
    directory = find(load_dir, tag)
    if directory is None:
        named = tag if tag is not None else read_latest(load_dir)
        if named is None:  # nothing saved there: DeepSpeed's (None, None)
            missing = os.path.join(load_dir, "latest")
            warnings.warn(f"no checkpoint to load: {missing} does not exist", stacklevel=3)
            return None, None
        # a tag asked for (or named by `latest`) that is not there: an error, as DeepSpeed's
        # assertion, never a silent start from scratch
        where = "" if tag is not None else f" (the tag {os.path.join(load_dir, 'latest')} names)"
        raise CheckpointError(
            f"load_checkpoint: no checkpoint {os.path.join(load_dir, named)!r}{where}; "
            f"tags in {load_dir!r}: {_tags(load_dir)}"
        )
    if not load_module_only:
        _check_scheduler_state(engine, directory, load_lr_scheduler_states)
    # NVMe offload: restore writes each unit to the other slot of its swap regions as it
    # is read (one unit in memory at a time, or with sub-groups one piece: [Note:
    # checkpoints in pieces]); the slots flip once every rank has read.
    like = engine.train_state
    residency, stored = engine.residency, engine.residency.stored
    try:
        with rolled_back(engine.units):
            restored = restore(
                load_dir,
                like,
                optimizer=engine.functional_optimizer,
                tag=tag,
                load_optimizer_states=load_optimizer_states and not load_module_only,
                accumulation=_accumulation(engine),
                extras=extras,
                owner=engine,
                install=False,
                strict=load_module_strict,
            )
    except Exception as error:
        if isinstance(error, PartlyRestoredError):
            residency.broken = (
                f"loading {load_dir} failed after the engine's buffers were partly "
                f"overwritten ({error}); load a checkpoint again to go on"
            )
        elif residency.slots == 1 and residency.stored > stored:
            residency.broken = (
                f"loading {load_dir} failed after units were overwritten in place in "
                f"{residency.nvme.path} ({error}); load a checkpoint again to go on"
            )
        raise
    residency.broken = ""  # the file holds the loaded step now
    install(engine.units, like, restored.state)
    with torch.no_grad():
        for key, tensor in module_tensors(engine.plan, engine.module).items():
            if key in restored.module:  # all of them unless load_module_strict=False
                tensor.copy_(restored.module[key])
    for rt in engine.units:
        if residency.sub_group and residency.holds(rt.index):  # the master piece by piece
            engine.publish_master(rt, master_copy(residency, rt, engine.compute_dtype))
            continue
        with residency.resident(rt, write_back=False):
            engine.publish_master(rt)
    engine.finish_publish()
    index = restored.index
    if not load_module_only:
        _restore_counters(engine, restored, load_optimizer_states, load_lr_scheduler_states)
        saved = saved_rng(index, engine.plan_rank, engine.world_size)
        if saved is not None:
            restore_process_rng(saved)
    _log_world_change(engine, index)
    return restored.directory, restored.client_state


def _restore_counters(
    engine: Engine, restored: Any, with_optimizer: bool, with_scheduler: bool
) -> None:
    """The step counters; with the optimizer state, the param groups' hyper-parameters
    (lr included: DeepSpeed restores them with the optimizer, whatever
    `load_lr_scheduler_states` says); with the scheduler state, `lr_scheduler`'s
    position (a config schedule's is `lr_steps`, which without one counts updates)."""
    counters = restored.state.counters
    engine.global_steps = counters.global_steps
    engine.global_samples = counters.global_samples
    engine.micro_steps = counters.micro_steps
    engine.skipped_steps = counters.skipped_steps
    index = restored.index
    if index["loss_scale"] is not None and engine.loss_scaler is not None:
        engine.loss_scale_state = restored.state.loss_scale
    scheduler = index["scheduler"]
    if with_optimizer and scheduler["client_groups"] is not None:
        for group, saved in zip(engine.param_groups, scheduler["client_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    own = engine.config_scheduler
    if own is None or (with_scheduler and engine.lr_scheduler is own):
        engine.lr_steps = scheduler["lr_steps"]
    client = engine.lr_scheduler
    if with_scheduler and client is not None and client is not own:
        client.load_state_dict(scheduler["client"])


def _check_scheduler_state(engine: Engine, directory: str, with_scheduler: bool) -> None:
    """Before anything is loaded: a client lr scheduler to restore needs a saved state."""
    client = engine.lr_scheduler
    if not with_scheduler or client is None or client is engine.config_scheduler:
        return
    if read_index(directory)["scheduler"]["client"] is None:
        raise CheckpointError(
            f"{directory} holds no state for the engine's lr_scheduler "
            f"({type(client).__name__}): it was saved without one; load it with "
            "load_lr_scheduler_states=False to keep the scheduler as it is"
        )


def _log_world_change(engine: Engine, index: Mapping[str, Any]) -> None:
    old_world = index.get("processes", index["world_size"])
    old_accum = index["batch"]["gradient_accumulation_steps"]
    if old_world == engine.world_size or engine.rank != 0:
        return
    if old_accum == engine.gradient_accumulation_steps():  # nothing to warn of
        log.info(
            "fzero: checkpoint saved at world size %d loaded at world size %d "
            "(gradient_accumulation_steps %d, unchanged)",
            old_world,
            engine.world_size,
            old_accum,
        )
        return
    message = (
        f"fzero: checkpoint saved at world size {old_world} (gradient_accumulation_steps "
        f"{old_accum}) loaded at world size {engine.world_size}: gradient_accumulation_steps "
        f"is now {engine.gradient_accumulation_steps()}"
    )
    if engine.batch is not None:
        message += (
            f" (train_batch_size {engine.batch.train_batch_size} = micro "
            f"{engine.batch.micro_batch_size} x {engine.gradient_accumulation_steps()} x "
            f"{engine.world_size})"
        )
    log.warning(message)


def stream_model(
    engine: Engine, dtype: torch.dtype | None = None, exclude_frozen: bool = False
) -> ModelStream:
    """The engine's whole model one tensor at a time (`stream_state_dict`; the masters
    in `dtype`, default the compute dtype); collective as it is run."""
    engine.residency.check_usable()
    return stream_state_dict(
        engine.train_state,
        module=engine.module,
        dtype=dtype or engine.compute_dtype,
        exclude_frozen=exclude_frozen,
    )


def _drain(stream: ModelStream) -> None:
    for _ in stream.tensors:  # the other ranks' part of each gather
        pass


def save_16bit_model(
    engine: Engine,
    save_dir: str,
    save_filename: str,
    exclude_frozen_parameters: bool = False,
    max_shard_size: str | int | None = None,
) -> bool:
    """See `Engine.save_16bit_model`."""
    stream = stream_model(engine, exclude_frozen=exclude_frozen_parameters)
    if comm.get_rank() == 0:
        specs, tensors = stream.specs, stream.tensors
        write_model_files(save_dir, specs, tensors, max_shard_size, filename=save_filename)
    else:
        _drain(stream)
    comm.barrier(what="the 16-bit model written")
    return True


def _written_16bit(engine: Engine, save_dir: str) -> WrittenModel | dict[str, Any]:
    """The 16-bit model a checkpoint carries, streamed to a file in `save_dir` on rank 0
    (the checkpoint moves it in as it commits); {} on the other ranks."""
    stream = stream_model(engine)
    if comm.get_rank() != 0:
        _drain(stream)
        return {}
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, f".model_16bit.{os.getpid()}.partial")
    cpu = (t.detach().cpu().contiguous() for t in stream.tensors)
    written = write_safetensors_stream(path, stream.specs, cpu, {"format": "pt"})
    return WrittenModel(path, written)


def consolidated_16bit_state_dict(
    engine: Engine, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """DeepSpeed's `_zero3_consolidated_16bit_state_dict` (what Transformers' Trainer and
    Accelerate save): the model streamed unit by unit into a temporary safetensors file
    on rank 0 and returned as tensors mapped from it (read from disk as the caller
    writes them; the file is unlinked at once and its space freed with the tensors);
    None on the other ranks. Collective."""
    stream = stream_model(engine, exclude_frozen=exclude_frozen_parameters)
    if comm.get_rank() != 0:
        _drain(stream)
        return None
    from safetensors import safe_open

    # the module's own order, as DeepSpeed's walk of the modules gives it (the stream
    # comes in the plan's unit order)
    order = {key: i for i, key in enumerate(engine.module.state_dict(keep_vars=True))}
    keys = sorted((key for key, _, _ in stream.specs), key=lambda k: order.get(k, len(order)))
    directory = tempfile.mkdtemp(prefix="fzero-16bit-")
    try:
        path = write_model_files(directory, stream.specs, stream.tensors, None)[0]
        # a tied tensor is one tensor under each of its names, as DeepSpeed returns it
        # (Transformers' save_pretrained then writes it once)
        canonical = {a: t.fqn for t in engine.plan.manifest.tensors for a in t.aliases}
        loaded: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for key in keys:
                source = canonical.get(key, key)
                if source not in loaded:
                    loaded[source] = f.get_tensor(source)
            mapped = {key: loaded[canonical.get(key, key)] for key in keys}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return mapped
