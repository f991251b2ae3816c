"""What the NVMe swap file costs on disk: `offload_optimizer.commit` "in_place" (one copy
of master and optimizer state instead of two) and `bf16.bf16_optimizer_states` (moments in
bf16, stochastically rounded). Each against the default two-slot, fp32-state run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fzero
from fzero.config import ConfigError
from fzero.optim import bf16_stochastic
from tests._dist import failing_at_write, run_world
from tests.models import Net, global_batch
from tests.test_offload import MICRO, _step


def _config(nvme_path: str, commit: str, bf16_states: bool, stage: int = 3) -> dict:
    zero = {
        "stage": stage,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "commit": commit},
    }
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True, "bf16_optimizer_states": bf16_states},
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": zero,
    }


def _engine(nvme_path: str, commit: str, bf16_states: bool, stage: int = 3):
    torch.manual_seed(0)
    config = _config(nvme_path, commit, bf16_states, stage)
    return fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=1e-2), config=config)


def train(rank, world, nvme_path, commit, bf16_states, root, stage=3):
    """8 steps with a checkpoint after step 4, then steps 5-7 again from it in a new
    engine; also the swap file's size and whether every moment is a bf16 value."""
    engine = _engine(nvme_path, commit, bf16_states, stage)
    losses = []
    for step in range(8):
        losses.append(_step(engine, rank, world, step))
        if step == 4:
            engine.save_checkpoint(root)
    moments_bf16 = True
    for index in range(len(engine.units)):
        with engine.train_state.residence.resident(index) as unit:
            for moment in (unit.optim.exp_avg, unit.optim.exp_avg_sq):
                moments_bf16 &= torch.equal(moment.to(torch.bfloat16).float(), moment)
    swap_bytes = engine.nvme.nbytes
    state = engine.state_dict(dtype=torch.float32)
    again = _engine(nvme_path, commit, bf16_states, stage)
    again.load_checkpoint(root)
    resumed = [_step(again, rank, world, step) for step in range(5, 8)]
    return losses, state, resumed, swap_bytes, moments_bf16


@pytest.mark.parametrize(("stage", "bf16_states"), [(3, False), (3, True), (2, True)])
def test_in_place_commit_trains_like_two_slots_on_half_the_disk(stage, bf16_states, tmp_path):
    """Stage 3 (parameters and optimizer on NVMe) or stage 2 (optimizer), 2 ranks: in
    place, the losses and weights equal the two-slot run's bitwise, a checkpoint resumes
    bitwise, and the state part of the swap file is half as large. bf16 moments: every
    moment at rest is a bf16 value, a run resumes bitwise, and the state takes 8 bytes per
    element, not 12."""
    (tmp_path / "swap").mkdir()
    runs = {
        commit: run_world(
            train, 2, str(tmp_path / "swap"), commit, bf16_states, str(tmp_path / commit), stage
        )
        for commit in ("two_slots", "in_place")
    }
    (slots_losses, slots_state, slots_resumed, slots_bytes, slots_bf16) = runs["two_slots"]
    (losses, state, resumed, swap_bytes, moments_bf16) = runs["in_place"]
    assert losses == slots_losses and resumed == slots_resumed == losses[5:]
    assert all(torch.equal(state[k], v) for k, v in slots_state.items())
    assert moments_bf16 == slots_bf16 == bf16_states
    numel = sum(p.numel() for p in Net().parameters())
    grads = 4 * -(-numel // 2)  # this rank's fp32 gradient shard, in the same file
    state_bytes = (4 + 2 * (2 if bf16_states else 4)) * -(-numel // 2)
    # regions round up to 4 KiB each: compare with that much slack per region
    slack = 4096 * 2 * 4 * len(Net().state_dict())
    assert abs(slots_bytes - (2 * state_bytes + grads)) < slack
    assert abs(swap_bytes - (state_bytes + grads)) < slack


def test_bf16_optimizer_states_track_fp32_states(tmp_path):
    """The accuracy cost of bf16 moments over 8 steps of the test model: losses within
    1% of the fp32-state run's."""
    (tmp_path / "swap").mkdir()
    fp32 = run_world(train, 1, str(tmp_path / "swap"), "in_place", False, str(tmp_path / "a"))
    bf16 = run_world(train, 1, str(tmp_path / "swap"), "in_place", True, str(tmp_path / "b"))
    torch.testing.assert_close(torch.tensor(bf16[0]), torch.tensor(fp32[0]), rtol=1e-2, atol=0)
    assert bf16[0] != fp32[0]  # the moments did round


def failing_in_place(rank, world, nvme_path, root, stage=3):
    """Rank 1's third state write of step 3 fails in place: the engine stops (step,
    forward, save, state_dict) until the step-2 checkpoint is loaded, then trains on."""
    engine = _engine(nvme_path, "in_place", False, stage)
    losses = [_step(engine, rank, world, step) for step in range(3)]
    engine.save_checkpoint(root)
    x, y = global_batch(3, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(nn.functional.mse_loss(engine(x[rows]).float(), y[rows]))
    message = failing_at_write(engine, 3 if rank == 1 else -1, engine.step)
    refused = []
    for attempt in (
        engine.step,
        lambda: engine(x[rows]),
        lambda: engine.save_checkpoint(root, tag="after_failure"),
        engine.state_dict,
    ):
        try:
            attempt()
            refused.append("")
        except RuntimeError as error:
            refused.append(str(error))
    engine.load_checkpoint(root)
    losses += [_step(engine, rank, world, step) for step in range(3, 6)]
    return message, refused, losses


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_in_place_step_stops_the_engine_until_a_checkpoint_loads(stage, tmp_path):
    """No partial step is ever trained on or saved: every rank raises the step's error,
    refuses to go on, and after loading the last checkpoint trains as if nothing failed."""
    (tmp_path / "swap").mkdir()
    message, refused, losses = run_world(
        failing_in_place, 2, str(tmp_path / "swap"), str(tmp_path / "ckpt"), stage
    )
    assert "commit 'in_place': step 4 failed after" in message
    assert "rank 1: " in message and "No space left on device" in message
    assert "load the last checkpoint" in message
    assert refused == [message] * 4
    reference = run_world(
        train, 2, str(tmp_path / "swap"), "in_place", False, str(tmp_path / "r"), stage
    )
    assert losses == reference[0][:6]


def test_in_place_config_errors(tmp_path):
    """A commit that is not one is refused by name."""
    allowed = r"commit' is 'in-place'; allowed: \['two_slots', 'in_place'\]"
    with pytest.raises(ConfigError, match=allowed):
        fzero.config.load_config(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"commit": "in-place"}}}
        )


def lamb_in_place(rank, world, nvme_path):
    config = _config(nvme_path, "in_place", False)
    try:
        fzero.shard(Net(), optimizer=fzero.optim.lamb(lr=1e-2), config=config)
    except ValueError as error:
        return str(error)
    return "no error"


def test_lamb_refuses_in_place_commits(tmp_path):
    (tmp_path / "swap").mkdir()
    message = run_world(lamb_in_place, 1, str(tmp_path / "swap"))
    assert "commit 'in_place' does not work with LAMB" in message


def test_bf16_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    """Each value goes to one of its two bf16 neighbours, the error averages to zero,
    bf16 values stay, the same seed gives the same bits, non-finite values round to
    nearest."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    rounded = bf16_stochastic(x, seed=7).float()
    bits = x.view(torch.int32).bitwise_and(-65536)
    toward_zero, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)
    assert bool(((rounded == toward_zero) | (rounded == away)).all())
    down = x.to(torch.bfloat16).float()
    assert abs(float((rounded - x).mean())) < 1e-4 * float(x.abs().mean())
    assert float((down - x).abs().mean()) < float((rounded - x).abs().mean())
    assert torch.equal(bf16_stochastic(x, seed=7), bf16_stochastic(x, seed=7))
    assert not torch.equal(bf16_stochastic(x, seed=7), bf16_stochastic(x, seed=8))
    assert torch.equal(bf16_stochastic(down, seed=3).float(), down)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3e38])
    assert torch.equal(bf16_stochastic(special, seed=1)[:4], special[:4].to(torch.bfloat16))
    # 1 + 2^-9 lies a quarter of the way from 1 to 1 + 2^-7: rounds up a quarter of the time
    quarter = bf16_stochastic(torch.full((40_000,), 1 + 2**-9), seed=5).float()
    assert abs(float((quarter > 1).float().mean()) - 0.25) < 0.01
    with pytest.raises(TypeError, match=r"rounds fp32 values, found torch\.float64"):
        bf16_stochastic(x.double(), seed=0)


def damaged_load_in_place(rank, world, nvme_path, root):
    """In place, a load that fails after overwriting units (a byte flipped in the last
    tensor) leaves the engine refusing to train until a good checkpoint loads."""
    from fzero.checkpoint import CheckpointError

    engine = _engine(nvme_path, "in_place", True)
    for step in range(2):
        _step(engine, rank, world, step)
    engine.save_checkpoint(root, tag="good")
    _step(engine, rank, world, 2)
    engine.save_checkpoint(root, tag="damaged")
    rank_file = os.path.join(root, "damaged", "rank00000.safetensors")
    with open(rank_file, "r+b") as f:
        f.seek(os.path.getsize(rank_file) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        engine.load_checkpoint(root, tag="damaged")
        failed = "no error"
    except CheckpointError as error:
        failed = str(error)
    try:
        _step(engine, rank, world, 3)
        refused = "no error"
    except RuntimeError as error:
        refused = str(error)
    engine.load_checkpoint(root, tag="good")
    losses = [_step(engine, rank, world, step) for step in range(2, 5)]
    fresh = _engine(nvme_path, "in_place", True)
    fresh.load_checkpoint(root, tag="good")
    expected = [_step(fresh, rank, world, step) for step in range(2, 5)]
    return failed, refused, losses, expected


def test_a_damaged_load_in_place_stops_the_engine_until_a_good_one_loads(tmp_path):
    (tmp_path / "swap").mkdir()
    failed, refused, losses, expected = run_world(
        damaged_load_in_place, 1, str(tmp_path / "swap"), str(tmp_path / "ckpt")
    )
    assert "fails its xxh3_64 check" in failed
    assert refused.startswith("loading ") and "overwritten in place" in refused
    assert "load a checkpoint again to go on" in refused
    assert losses == expected


@pytest.mark.parametrize("use_native", [True, False])
def test_bf16_moments_round_and_widen_in_their_fp32_buffers_bit_for_bit(use_native, monkeypatch):
    """A bf16 moment is rounded into its fp32 swap buffer's bf16 view and widened back
    from the buffer's upper part in place, in chunks (1,000 elements here): the bits of
    one rounding of the whole partition into a separate buffer, and the read target on a
    4 KiB boundary within the buffer, the whole pages read included."""
    from fzero import native
    from fzero.core import swap_buffers as residency  # the bf16 packing lives there
    from fzero.core.nvme import ALIGN, aligned_empty

    if use_native and not native.available():
        pytest.skip("native kernels not built")
    monkeypatch.setattr(native, "available", lambda *_: use_native)
    monkeypatch.setattr(residency, "CHUNK", 1000)
    largest, seed = 10_000, 2**70 + 12_345  # a seed past 2^64, as the swap file's are
    for numel in (1, 999, 1000, 2049, 4097, largest):
        buffer = aligned_empty(residency.swap_buffer_numel(largest))
        moment = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        buffer[:numel].copy_(moment)
        cut = numel // 3  # two tensors' parts, each with its own seed, across chunks
        spans = [(0, cut, seed), (cut, numel, seed + 7)]
        rounded = residency.narrow_in_place(buffer, numel, spans)
        assert rounded.data_ptr() == buffer.data_ptr()
        parts = [bf16_stochastic(moment[a:b], s % 2**64) for a, b, s in spans]
        assert torch.equal(rounded, torch.cat(parts)), numel
        target = residency.packed(buffer, numel)
        assert target.data_ptr() % ALIGN == 0
        end = target.data_ptr() + -(-2 * numel // ALIGN) * ALIGN
        assert end <= buffer.data_ptr() + 4 * buffer.numel()
        expected = rounded.clone()
        target.copy_(expected)  # as the swap file's read puts it there
        below = (target.data_ptr() - buffer.data_ptr()) // 2  # nothing else is read back
        buffer.view(torch.bfloat16)[:below].fill_(float("nan"))
        assert torch.equal(residency.widen_packed(buffer, numel), expected.float()), numel
