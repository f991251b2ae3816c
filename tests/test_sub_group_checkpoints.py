"""Checkpoints of NVMe units in sub-group pieces ([Note: checkpoints in pieces] in
`fzero.core.swap_pieces`): with `zero_optimization.sub_group_size` below a unit's
partition, saves and loads move it a piece at a time and write and load the bits whole
units do (the engine and the functional door)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fzero
from tests._dist import run_world
from tests.test_sub_groups import (
    _config,
    _engine,
    _micro_step,
    _optimizer_state,
    _squares,
    _squares_config,
    functional,
)


@pytest.mark.parametrize("stage", [1, 3])
def test_train_step_saves_and_restores_in_pieces_as_whole_units(stage, tmp_path):
    """The functional door: a `fzero.checkpoint` save and restore (its install reading
    the master back to publish it) in pieces resume as whole units and as no restore."""
    straight = run_world(functional, 2, str(tmp_path), stage, 5000)
    whole = run_world(functional, 2, str(tmp_path), stage, 10**9, str(tmp_path / "a"))
    pieces = run_world(functional, 2, str(tmp_path), stage, 5000, str(tmp_path / "b"))
    assert pieces[0] == whole[0] == straight[0]
    assert all(torch.equal(pieces[1][k], v) for k, v in whole[1].items())
    assert all(torch.equal(straight[1][k], v) for k, v in whole[1].items())


@contextlib.contextmanager
def _whole_units_counted(engine):
    """Inside: how many times a swapped unit was made resident whole (`counted[0]`)."""
    counted, real = [0], engine.residency.resident

    @contextlib.contextmanager
    def resident(rt, write_back):
        counted[0] += engine.residency.holds(rt.index)
        with real(rt, write_back):
            yield

    engine.residency.resident = resident
    try:
        yield counted
    finally:
        del engine.residency.resident


def checkpoint_pieces(rank, world, nvme_path, root, stage, precision, optim, bf16_states, size):
    """Three micro-steps (mid-window: its gradients saved too), a save; one more (a
    boundary), a save and an asynchronous one; then a new engine loads the mid-window
    one and runs the rest. Rank 0 returns both ranks' files of every save, what was
    made resident whole, and the resumed run's losses, weights and optimizer state."""
    from pathlib import Path

    from fzero.checkpoint._format import rank_file
    from fzero.checkpoint._save import wait_for_save

    config = _config(nvme_path, stage, precision, size, bf16_states)
    engine = _engine(config, optim)
    losses = [_micro_step(engine, rank, world, step) for step in range(3)]
    with _whole_units_counted(engine) as saved_whole:
        engine.save_checkpoint(root, tag="mid")
        losses.append(_micro_step(engine, rank, world, 3))
        engine.save_checkpoint(root, tag="end")
        engine.save_checkpoint(root, tag="async", async_save=True)  # host copies first
        wait_for_save(engine)
    files = {
        tag: [Path(root, tag, rank_file(r)).read_bytes() for r in range(world)]
        for tag in ("mid", "end", "async")
    }
    again = _engine(config, optim)
    with _whole_units_counted(again) as loaded_whole:
        again.load_checkpoint(root, tag="mid")
    resumed = [_micro_step(again, rank, world, step) for step in range(3, 8)]
    state = again.state_dict(dtype=torch.float32)
    counts = (saved_whole[0], loaded_whole[0], again.residency.sub_group)
    return files, counts, losses, resumed, state, _optimizer_state(again)


PIECE_CASES = [
    (3, "bf16", "adamw", True),  # bf16 moments in the file, gradients in it too
    (3, "fp32", "adam", False),
    (2, "bf16", "sgd", False),
    (1, "bf16", "adamw", False),  # gradients in memory
]


@pytest.mark.parametrize(("stage", "precision", "optim", "bf16_states"), PIECE_CASES)
def test_checkpoints_in_pieces_write_and_load_the_whole_units_bits(
    stage, precision, optim, bf16_states, tmp_path
):
    """sub_group_size 5000 (pieces of 4096) against the default: the rank files saved
    mid-window and at a boundary are the same bytes, no unit is made resident whole,
    and the mid-window checkpoint resumes with the same losses, weights and optimizer
    state bit for bit (the bf16 moments rounded as a whole unit's write rounds them)."""
    runs = {}
    for size in (1_000_000_000, 5000):
        (tmp_path / f"swap{size}").mkdir()
        root = str(tmp_path / f"ckpt{size}")
        runs[size] = run_world(
            checkpoint_pieces, 2, str(tmp_path / f"swap{size}"), root, stage, precision,
            optim, bf16_states, size,
        )  # fmt: skip
    files, counts, losses, resumed, state, optimizer_state = runs[1_000_000_000]
    got_files, got_counts, got_losses, got_resumed, got_state, got_optimizer = runs[5000]
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0  # whole units: resident
    assert got_counts == (0, 0, 4096)
    assert got_files == files  # both ranks, every tag: byte for byte
    assert files["async"] == files["end"]
    assert got_losses == losses and resumed[0] == losses[3]
    assert got_resumed == resumed
    assert all(torch.equal(got_state[k], v) for k, v in state.items())
    assert optimizer_state.keys() == got_optimizer.keys()
    for key, value in optimizer_state.items():
        same = torch.equal(got_optimizer[key], value) if isinstance(value, torch.Tensor) else None
        assert same or got_optimizer[key] == value, key


def resume_at(rank, world, nvme_path, root, size, with_state=True):
    """A new engine of `world` ranks loads the boundary checkpoint `root` (saved at world
    2; without `with_state`, its weights only) and runs four micro-steps; its losses and
    weights."""
    config = _config(nvme_path, 3, "bf16", size, bf16_states=True)
    engine = _engine(config, "adamw")
    engine.load_checkpoint(root, tag="end", load_optimizer_states=with_state)
    losses = [_micro_step(engine, rank, world, step) for step in range(4, 8)]
    return losses, engine.state_dict(dtype=torch.float32)


def test_a_checkpoint_in_pieces_loads_at_another_world_size_as_whole_units_do(tmp_path):
    """Saved at world 2 in pieces, loaded at world 1 in pieces and whole: the same
    training from there, bit for bit."""
    (tmp_path / "swap").mkdir()
    root = str(tmp_path / "ckpt")
    args = (3, "bf16", "adamw", True, 5000)
    run_world(checkpoint_pieces, 2, str(tmp_path / "swap"), root, *args)
    pieces = run_world(resume_at, 1, str(tmp_path / "swap"), root, 5000)
    whole = run_world(resume_at, 1, str(tmp_path / "swap"), root, 1_000_000_000)
    assert pieces[0] == whole[0]
    assert all(torch.equal(pieces[1][k], v) for k, v in whole[1].items())


def test_a_load_in_pieces_of_the_weights_only_starts_the_optimizer_as_whole_units_do(
    tmp_path,
):
    """`load_optimizer_states=False`: each piece's moments made afresh over its master
    (the optimizer's `init` is elementwise), the same training as whole units."""
    (tmp_path / "swap").mkdir()
    root = str(tmp_path / "ckpt")
    run_world(checkpoint_pieces, 2, str(tmp_path / "swap"), root, 3, "bf16", "adamw", True, 5000)
    pieces = run_world(resume_at, 2, str(tmp_path / "swap"), root, 5000, False)
    whole = run_world(resume_at, 2, str(tmp_path / "swap"), root, 1_000_000_000, False)
    kept = run_world(resume_at, 2, str(tmp_path / "swap"), root, 5000, True)
    assert pieces[0] == whole[0] != kept[0]
    assert all(torch.equal(pieces[1][k], v) for k, v in whole[1].items())


def checkpoint_memory(rank, world, swap, root, size):
    """`_squares` on NVMe, one micro-step of a window of two (gradients in the file):
    this rank's peak RSS while a checkpoint is saved, while it is loaded and while the
    16-bit model is saved, above its RSS before each, and the losses after."""
    from pathlib import Path

    from fzero.core import nvme
    from tests.test_offload import _kb

    engine = fzero.shard(
        _squares(), optimizer=fzero.optim.adamw(lr=1e-3), config=_squares_config(swap, size, 2)
    )
    peaks, losses = {}, []
    for step in range(2):
        x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(step * 2 + rank))
        engine.backward(engine(x).float().square().mean())
        engine.step()
        if step == 0:
            for phase, call in (
                ("save", lambda: engine.save_checkpoint(root)),
                ("load", lambda: engine.load_checkpoint(root)),
                ("16bit", lambda: engine.save_16bit_model(f"{root}/model")),
            ):
                engine.residency.pool.trim(0)  # what an earlier phase kept: not counted
                nvme.return_free_memory()
                Path("/proc/self/clear_refs").write_text("5")
                base = _kb("VmRSS")
                call()
                peaks[phase] = _kb("VmHWM") - base
        losses.append(engine(x).float().square().mean().item())
    return peaks, losses


def test_nvme_checkpoints_hold_pieces_not_units(tmp_path):
    """sub_group_size 300,000 (pieces of 299,008 elements, 1.2 MiB) against whole units
    of 2M elements (8 MiB in fp32) per rank, mid-window. A save holds one piece, not the
    unit's master, moments and gradient. A load holds a piece of each kind, then the
    units' bf16 copies it publishes, as many as parameter writes are in flight
    (`offload_param.buffer_count`, 5: 20 MiB, as in the step), not new fp32 partitions
    and the unit resident again to publish it. `save_16bit_model` reads the master
    alone (the gathered unit and its bf16 copy are the same). Measured per rank in
    8 MiB parts: save 0.5, load 3.3-4.6 and 16-bit 6.2 against 5.3, 15.5 and 9.0 whole
    (the same losses after)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    part_kb = 8 * 1024
    peaks, losses = run_world(
        checkpoint_memory, 2, str(tmp_path / "a"), str(tmp_path / "ca"), 300_000, fresh=True
    )
    whole, whole_losses = run_world(
        checkpoint_memory, 2, str(tmp_path / "b"), str(tmp_path / "cb"), 10**9, fresh=True
    )
    assert losses == whole_losses
    assert peaks["save"] <= part_kb * 3 // 4 and peaks["load"] <= 6 * part_kb, (peaks, whole)
    assert whole["save"] >= 4 * part_kb and whole["load"] >= 12 * part_kb, (peaks, whole)
    assert peaks["16bit"] <= whole["16bit"] - 2 * part_kb, (peaks, whole)


def failing_load(rank, world, nvme_path, root, commit, write):
    """A boundary checkpoint after three steps, two more steps, then a load of it whose
    `write`-th swap-file write on rank 1 fails: what the load raised, what the next
    step said, and the losses after loading it again."""
    from fzero.checkpoint import CheckpointError
    from tests._dist import failing_at_write

    config = _config(nvme_path, 3, "bf16", 5000, bf16_states=True)
    config["gradient_accumulation_steps"] = 1
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {**zero["offload_optimizer"], "commit": commit}
    engine = _engine(config, "adamw")
    losses = [_micro_step(engine, rank, world, step) for step in range(3)]
    engine.save_checkpoint(root)
    losses += [_micro_step(engine, rank, world, step) for step in range(3, 5)]
    before = engine.state_dict(dtype=torch.float32)
    try:
        failed = failing_at_write(
            engine, write if rank == 1 else -1, lambda: engine.load_checkpoint(root)
        )
    except CheckpointError as error:
        failed = str(error)
    try:
        after = engine.state_dict(dtype=torch.float32)
        unchanged = all(torch.equal(before[k], v) for k, v in after.items())
        next_loss = _micro_step(engine, rank, world, 5)
    except RuntimeError as error:
        unchanged, next_loss = None, str(error)
    engine.load_checkpoint(root)
    resumed = [_micro_step(engine, rank, world, step) for step in range(3, 6)]
    return failed, next_loss, unchanged, losses, resumed


@pytest.mark.parametrize("commit", ["two_slots", "in_place"])
def test_a_failed_load_in_pieces_is_as_documented(commit, tmp_path):
    """An ENOSPC on rank 1 in the middle of a load in pieces (its fifth write, after a
    whole unit was written): every rank raises `CheckpointError`; with two slots nothing
    changed and training goes on, in place the engine refuses to step until a checkpoint
    loads; loading again resumes as the first run went."""
    (tmp_path / "swap").mkdir()
    failed, next_loss, unchanged, losses, resumed = run_world(
        failing_load, 2, str(tmp_path / "swap"), str(tmp_path / "ckpt"), commit, 5
    )
    assert "rank 1: " in failed and "No space left on device" in failed
    if commit == "two_slots":
        assert isinstance(next_loss, float) and unchanged
    else:
        assert "overwritten in place" in next_loss and "load a checkpoint again" in next_loss
    assert resumed[:2] == losses[3:]
