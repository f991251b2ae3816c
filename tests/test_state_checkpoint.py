"""`fzero.checkpoint.save` / `restore` of a `TrainState`: exact resumption (dropout's
generator included, mid-accumulation too), resharding to another world size and stage,
and one format for both front doors (an engine's checkpoint restores into a functional
state and the other way round)."""

from __future__ import annotations

import os
import re
import types

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero.checkpoint import consolidated_state_dict
from tests._dist import failing_at_write, run_world
from tests.models import Net, global_batch

MICRO = 2


def _plan(model, world, stage):
    options = {"persistence_threshold": 0} if stage == 3 else {}
    return fzero.partition.plan(
        fzero.partition.describe(model), world_size=world, stage=stage, **options
    )


def _setup(world: int, stage: int, accum: int, seed: int, swap: str = "", commit: str = ""):
    """A model, plan, optimizer, state and step; with `swap` (a directory) the optimizer
    state is offloaded to NVMe there (`commit`: two_slots or in_place)."""
    torch.manual_seed(seed)
    model = Net()
    plan = _plan(model, world, stage)
    optimizer = fzero.optim.adamw(lr=1e-2, weight_decay=0.01)
    config: dict = {"gradient_accumulation_steps": accum}
    if swap:
        offload = {"device": "nvme", "nvme_path": swap, "commit": commit or "two_slots"}
        config["zero_optimization"] = {"offload_optimizer": offload}
    state = fzero.init(model, plan, optimizer, seed=seed, config=config)

    def loss_fn(params, batch):
        x, y = batch
        out = torch.func.functional_call(model, params, (x,))
        return F.mse_loss(F.dropout(out, 0.3), y)

    return model, plan, optimizer, state, fzero.train_step(loss_fn, plan, optimizer, config=config)


def _micro_steps(step, state, rank, world, first, count):
    losses = []
    for i in range(first, first + count):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        state, metrics = step(state, (x[rows], y[rows]))
        losses.append(metrics["loss"].item())
    return state, losses


def resume_case(rank: int, world: int, root: str, stage: int, at: int) -> dict:
    """Train 6 micro-steps (accumulation 2), saving after `at`; restore into a state
    built from another seed and run the rest: the same losses and weights, bitwise."""
    _, _, optimizer, state, step = _setup(world, stage, 2, seed=0)
    state, _ = _micro_steps(step, state, rank, world, 0, at)
    fzero.checkpoint.save(root, state, optimizer=optimizer, tag="t", client_state={"k": at})
    state, rest = _micro_steps(step, state, rank, world, at, 6 - at)
    straight = fzero.state_dict(state)
    _, _, _, fresh, step = _setup(world, stage, 2, seed=7)
    restored = fzero.checkpoint.restore(root, fresh, optimizer=optimizer)
    assert restored.client_state == {"k": at} and restored.directory.endswith("t")
    assert restored.state.counters.micro_steps == at
    state, again = _micro_steps(step, restored.state, rank, world, at, 6 - at)
    resumed = fzero.state_dict(state)
    same = all(torch.equal(straight[k], resumed[k]) for k in straight)
    return {"rest": rest, "again": again, "same": same}


def nvme_resume_case(rank: int, world: int, root: str, stage: int, before: str, after: str):
    """`resume_case` with the optimizer state in a swap file before the save and/or
    after the restore (`before`/`after`: "", "two_slots" or "in_place")."""
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    _, _, optimizer, state, step = _setup(world, stage, 2, 0, swap if before else "", before)
    assert (state.residence is not None) == bool(before)
    state, _ = _micro_steps(step, state, rank, world, 0, 3)
    fzero.checkpoint.save(root, state, optimizer=optimizer, tag="t")
    state, rest = _micro_steps(step, state, rank, world, 3, 3)
    straight = fzero.state_dict(state)
    _, _, _, fresh, step = _setup(world, stage, 2, 7, swap if after else "", after)
    restored = fzero.checkpoint.restore(root, fresh, optimizer=optimizer)
    state, again = _micro_steps(step, restored.state, rank, world, 3, 3)
    resumed = fzero.state_dict(state)
    same = all(torch.equal(straight[k], resumed[k]) for k in straight)
    return {"rest": rest, "again": again, "same": same}


@pytest.mark.parametrize(
    "stage,before,after",
    [
        (2, "two_slots", "two_slots"),
        (3, "in_place", "in_place"),
        (1, "two_slots", ""),
        (3, "", "in_place"),
    ],
)
def test_an_nvme_offloaded_state_saves_and_restores_exactly(tmp_path, stage, before, after):
    """train_step with NVMe offload: the checkpoint reads units back from the swap file,
    restore writes them to the file's next slots and commits; either side may hold its
    state in memory instead."""
    result = run_world(nvme_resume_case, 2, str(tmp_path), stage, before, after)
    assert result["rest"] == result["again"]
    assert result["same"]


@pytest.mark.parametrize("stage,at", [(3, 2), (3, 3), (1, 3), (0, 2)])
def test_restore_resumes_exactly_with_dropout_and_mid_accumulation(tmp_path, stage, at):
    result = run_world(resume_case, 2, str(tmp_path), stage, at)
    assert result["rest"] == result["again"]
    assert result["same"]


def reshard_save_case(rank: int, world: int, root: str) -> dict:
    model, _, optimizer, state, step = _setup(world, 3, 1, seed=0)
    state, _ = _micro_steps(step, state, rank, world, 0, 2)
    fzero.checkpoint.save(root, state, optimizer=optimizer, module=model)
    return fzero.state_dict(state, module=model)


def reshard_load_case(rank: int, world: int, root: str) -> dict:
    """World 1, stage 1, bf16: a ZeRO-3 world-2 save restores; the engine loads it too."""
    torch.manual_seed(5)
    model = Net()
    plan = _plan(model, world, 1)
    optimizer = fzero.optim.adamw(lr=1e-2, weight_decay=0.01)
    state = fzero.init(model, plan, optimizer, precision="bf16")
    restored = fzero.checkpoint.restore(root, state, optimizer=optimizer, module=model)
    torch.manual_seed(6)
    engine = fzero.shard(Net(), stage=2, optimizer=optimizer)
    engine.load_checkpoint(root)
    return {
        "functional": fzero.state_dict(restored.state, module=model),
        "engine": engine.state_dict(dtype=torch.float32),
        "steps": restored.state.counters.global_steps,
        "bf16": restored.state.units[0].params.dtype == torch.bfloat16,
        "consolidated": consolidated_state_dict(root),
    }


def test_restore_reshards_and_the_engine_loads_a_functional_checkpoint(tmp_path):
    saved = run_world(reshard_save_case, 2, str(tmp_path))
    loaded = run_world(reshard_load_case, 1, str(tmp_path))
    assert loaded["steps"] == 2 and loaded["bf16"]
    for view in ("functional", "engine", "consolidated"):
        assert list(loaded[view]) == list(saved), view  # the module's keys, in order
        for name, value in saved.items():
            assert torch.equal(loaded[view][name], value), (view, name)


def engine_to_state_case(rank: int, world: int, root: str) -> bool:
    torch.manual_seed(0)
    engine = fzero.shard(Net(), stage=2, optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
    for i in range(2):
        x, y = global_batch(i, MICRO * world)
        engine.backward(F.mse_loss(engine(x[rank * MICRO : (rank + 1) * MICRO]), y[:MICRO]))
        engine.step()
    engine.save_checkpoint(root)
    expected = engine.state_dict(dtype=torch.float32)
    torch.manual_seed(1)
    model = Net()
    optimizer = fzero.optim.sgd(lr=0.1, momentum=0.9)
    state = fzero.init(model, _plan(model, world, 3), optimizer)
    restored = fzero.checkpoint.restore(root, state, optimizer=optimizer, module=model).state
    got = fzero.state_dict(restored, module=model)
    momentum = [u.optim.momentum_buffer.abs().sum().item() for u in restored.units]
    assert restored.counters.global_steps == 2 and any(m > 0 for m in momentum)
    return rank != 0 or all(torch.equal(got[k], expected[k]) for k in expected)


def test_an_engine_checkpoint_restores_into_a_functional_state(tmp_path):
    assert run_world(engine_to_state_case, 2, str(tmp_path))


def _error(call) -> str:
    """`call()`'s exception as "Type: message" ("no error" when it returns)."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def errors_case(rank: int, world: int, root: str) -> dict:
    _, plan, optimizer, state, _ = _setup(world, 2, 1, seed=0)
    sgd = fzero.optim.sgd(lr=0.1, momentum=0.9)
    errors = {"missing": _error(lambda: fzero.checkpoint.restore(root, state, optimizer=optimizer))}
    fzero.checkpoint.save(root, state, optimizer=optimizer)
    errors["optimizer"] = _error(lambda: fzero.checkpoint.restore(root, state, optimizer=sgd))
    errors["no optimizer"] = _error(
        lambda: fzero.checkpoint.restore(root, state, load_optimizer_states=False)
    )
    fresh = fzero.init(Net(), plan, sgd)
    weights = fzero.checkpoint.restore(root, fresh, optimizer=sgd, load_optimizer_states=False)
    return {"errors": errors, "step": weights.state.units[0].optim.step}


def test_restore_errors_name_what_is_wrong(tmp_path):
    result = run_world(errors_case, 1, str(tmp_path))
    errors = result["errors"]
    assert re.match(r"CheckpointError: no checkpoint in .* \(tag None\)", errors["missing"])
    assert re.match(
        r"CheckpointError: rank 0: .*global_step0 holds adamw state \['optim.exp_avg', "
        r"'optim.exp_avg_sq'\]; this run uses sgd with .*: pass load_optimizer_states=False",
        errors["optimizer"],
    ), errors["optimizer"]
    assert errors["no optimizer"].startswith("ValueError: load_optimizer_states=False needs")
    assert result["step"] == 0  # weights only: the optimizer starts afresh


def nvme_failure_case(rank: int, world: int, root: str, commit: str) -> dict:
    """Rank 1's third swap write of the step ending micro-step 4 fails (ENOSPC).
    two_slots: every rank raises, the state is as before the call, and the same call run
    again trains on as if nothing failed. in_place: the state is refused until a
    checkpoint is restored into it."""
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    _, _, optimizer, state, step = _setup(world, 2, 2, 0, swap, commit)
    state, losses = _micro_steps(step, state, rank, world, 0, 3)
    fzero.checkpoint.save(root, state, optimizer=optimizer, tag="t")
    x, y = global_batch(3, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    holder = types.SimpleNamespace(nvme=state.residence.residency.nvme)
    result: dict = {}

    def call() -> None:
        result["state"] = step(state, (x[rows], y[rows]))

    message = failing_at_write(holder, 3 if rank == 1 else -1, call)
    refused = ""
    try:
        state, metrics = step(state, (x[rows], y[rows]))  # the same call again
    except (OSError, RuntimeError) as error:
        refused = str(error)
        state = fzero.checkpoint.restore(root, state, optimizer=optimizer).state
        state, metrics = step(state, (x[rows], y[rows]))
    losses.append(metrics["loss"].item())
    state, more = _micro_steps(step, state, rank, world, 4, 2)
    return {
        "message": message,
        "refused": refused,
        "losses": losses + more,
        "weights": fzero.state_dict(state),
    }


@pytest.mark.parametrize("commit", ["two_slots", "in_place"])
def test_a_failed_nvme_step_in_train_step_rolls_back_or_is_refused(tmp_path, commit):
    result = run_world(nvme_failure_case, 2, str(tmp_path), commit)
    assert "rank 1: " in result["message"] and "No space left on device" in result["message"]
    if commit == "two_slots":
        assert "optimizer step was not applied" in result["message"]
        assert result["refused"] == ""
    else:
        assert "commit 'in_place': step 2 failed after" in result["message"]
        assert result["refused"] == result["message"]
    reference = run_world(nvme_reference_case, 2, str(tmp_path / "ref"))
    assert result["losses"] == reference["losses"]
    for name, value in reference["weights"].items():
        assert torch.equal(result["weights"][name], value), name


def nvme_reference_case(rank: int, world: int, root: str) -> dict:
    """The same six micro-steps with nothing failing (and the state in memory)."""
    _, _, _, state, step = _setup(world, 2, 2, 0)
    state, losses = _micro_steps(step, state, rank, world, 0, 6)
    return {"losses": losses, "weights": fzero.state_dict(state)}
