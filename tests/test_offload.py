"""ZeRO-Offload (optimizer state and update on the host): same training, bit for bit."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fzero
from tests._dist import failing_at_write, run_world
from tests.models import Net, global_batch

MICRO, STEPS = 2, 20


def _step(engine, rank, world, step):
    x, y = global_batch(step, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
    engine.backward(loss)
    engine.step()
    return loss.item()


def train(
    rank, world, stage, precision, offload, root=None, nvme_path=None, param=None, optim="adamw"
):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.5,
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {
                "device": offload or "none",
                "pin_memory": True,
                "nvme_path": nvme_path,
            },
            "offload_param": {"device": param or "none", "nvme_path": nvme_path},
        },
    }
    engine = fzero.shard(
        Net(), optimizer=getattr(fzero.optim, optim)(lr=1e-2), precision=precision, config=config
    )
    losses = []
    for step in range(STEPS):
        losses.append(_step(engine, rank, world, step))
        if root is not None and step == STEPS // 2:
            engine.save_checkpoint(root)
    held, planned = engine.memory_held(), engine.memory_planned()
    swap = engine.nvme.path if engine.nvme is not None else None
    resumed = None
    if root is not None:
        torch.manual_seed(1)
        again = fzero.shard(
            Net(),
            optimizer=getattr(fzero.optim, optim)(lr=1e-2),
            precision=precision,
            config=config,
        )
        again.load_checkpoint(root)
        resumed = [_step(again, rank, world, step) for step in range(STEPS // 2 + 1, STEPS)]
    return losses, engine.state_dict(dtype=torch.float32), held, planned, resumed, swap


# every stage and precision at world size 2; world size 1 once per device
CASES = [
    (2, stage, precision, device)
    for stage in (1, 2, 3)
    for precision in ("fp32", "bf16")
    for device in ("cpu", "nvme")
]
CASES = [(*case, "adamw") for case in CASES]
CASES += [(1, 2, "bf16", "cpu", "adamw"), (1, 3, "fp32", "nvme", "adamw")]
CASES += [(2, 3, "bf16", "nvme", "sgd")]  # momentum buffer as the one state kind
# Lamb over NVMe: two passes, the update direction parked in the swap file
CASES += [
    (2, 2, "bf16", "nvme", "lamb"),
    (2, 3, "fp32", "nvme", "lamb"),
    (1, 1, "bf16", "nvme", "lamb"),
]


@pytest.mark.parametrize(("world", "stage", "precision", "device", "optim"), CASES)
def test_offload_trains_bit_for_bit_like_no_offload(
    world, stage, precision, device, optim, tmp_path
):
    losses, state, *_ = run_world(train, world, stage, precision, None, None, None, None, optim)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    offloaded, offloaded_state, held, planned, resumed, swap = run_world(
        train, world, stage, precision, device, str(tmp_path / "ckpt"), str(swap_dir), None, optim
    )
    assert offloaded == losses
    assert all(torch.equal(offloaded_state[k], v) for k, v in state.items())
    assert resumed == losses[STEPS // 2 + 1 :]  # checkpoints save and resume with offload on
    if device == "cpu":
        assert held == planned and planned.host > 0  # masters and Adam state on the host
    else:
        # all of it in the swap file (with the gradient sums at stages 2-3), none on the host
        assert held == planned and planned.host == 0
        assert held.nvme >= held.master + held.optimizer_state > 0
        assert (held.nvme > held.master + held.optimizer_state) == (stage >= 2)
        assert swap.startswith(str(swap_dir)) and not list(swap_dir.iterdir())  # removed


@pytest.fixture
def own_group():
    """For tests that build an engine in this process (it starts a world-1 process
    group): end the group after the test, so none is left for the tests that follow."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_full_disk_names_the_swap_file_and_the_bytes(tmp_path, monkeypatch, own_group):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    with pytest.raises(
        OSError,
        match=r"cannot allocate the optimizer swap file .*fzero-optimizer-.*: [\d,]+ bytes "
        r"needed, [\d,]+ free",
    ):
        fzero.shard(Net(), stage=2, config=config)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_memory_too_small_for_the_swap_buffers_is_named_before_training(
    tmp_path, monkeypatch, own_group
):
    monkeypatch.setattr("fzero.core.nvme.available_memory", lambda: 1000)
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    with pytest.raises(
        MemoryError,
        match=r"NVMe offload needs at least [\d,]+ bytes of host buffers per rank \(\d+ units in "
        r"flight x \d tensors x [\d,]+ elements x 4 bytes\) x 1 local rank\(s\); 1,000 bytes "
        r"are available",
    ):
        fzero.shard(Net(), stage=2, config=config)
    assert not list(tmp_path.iterdir())


def test_a_disk_too_small_is_named_before_anything_is_written(tmp_path, monkeypatch, own_group):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("shutil.disk_usage", lambda _: usage._replace(free=4096))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    with pytest.raises(
        OSError,
        match=r"offload_optimizer.nvme_path '.*' cannot hold the optimizer swap files: 2 local "
        r"rank\(s\) x [\d,]+ bytes needed, 4,096 bytes free",
    ):
        fzero.shard(Net(), stage=2, config=config)
    assert not list(tmp_path.iterdir())


def test_offload_needs_a_sharding_stage(own_group):
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match=r"offload_optimizer' needs stage 1, 2 or 3, found 0"):
        fzero.shard(Net(), stage=0, config=offload)
    engine = fzero.shard(Net(), stage=2, config=offload)  # the stage given only here
    assert engine.offload and offload == {  # the caller's dict is not changed
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("param", "optimizer"), [("cpu", "cpu"), ("nvme", "nvme"), ("nvme", None)])
def test_stage3_parameter_offload_trains_bit_for_bit(world, param, optimizer, tmp_path):
    losses, state, *_ = run_world(train, world, 3, "bf16", None)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    offloaded, offloaded_state, held, planned, resumed, _ = run_world(
        train, world, 3, "bf16", optimizer, str(tmp_path / "ckpt"), str(swap_dir), param
    )
    assert offloaded == losses and resumed == losses[STEPS // 2 + 1 :]
    assert all(torch.equal(offloaded_state[k], v) for k, v in state.items())
    assert held == planned
    if param == "nvme":
        # between steps the parameter shards are in the swap file, not in memory
        assert held.nvme >= held.params > 0
    else:
        assert held.host >= held.params > 0  # in host memory
        assert not list(swap_dir.iterdir())


def train_window(rank, world, stage, nvme_path, root, swap_gradients=True):
    """fp16 with accumulation 2 and clipping; a poisoned micro-step on rank 1 overflows
    (the step is skipped); a checkpoint saved mid-window resumes in a new engine."""
    torch.manual_seed(0)
    offload = {
        "device": "nvme",
        "nvme_path": nvme_path,
        "buffer_count": 12,
        "swap_gradients": swap_gradients,
    }
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": offload if nvme_path else {"device": "none"},
        },
    }

    def build():
        return fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=1e-2), config=config)

    def micro_step(engine, step):
        x, y = global_batch(step, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        poison = float("inf") if step == 2 and rank == 1 else 1.0
        loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows]) * poison
        engine.backward(loss)
        engine.step()
        return loss.item()

    engine = build()
    losses = [micro_step(engine, step) for step in range(10)]
    engine.save_checkpoint(root, tag="mid")  # after 10 micro-steps: saved at a boundary
    losses.append(micro_step(engine, 10))
    engine.save_checkpoint(root, tag="mid-window")
    losses += [micro_step(engine, step) for step in range(11, 14)]
    again = build()
    again.load_checkpoint(root, tag="mid-window")
    resumed = [micro_step(again, step) for step in range(11, 14)]
    return losses, engine.state_dict(dtype=torch.float32), engine.skipped_steps, resumed


@pytest.mark.parametrize(("stage", "swap_gradients"), [(2, True), (3, True), (3, False)])
def test_nvme_gradients_accumulate_overflow_and_resume_mid_window(stage, swap_gradients, tmp_path):
    """Stages 2-3 keep gradient accumulators in the swap file (unless `swap_gradients`
    is off): the same norms, overflow checks, accumulation and mid-window checkpoints as
    without offload (three buffer sets in the step pipeline: buffer_count 12)."""
    (tmp_path / "swap").mkdir()
    ref = run_world(train_window, 2, stage, None, str(tmp_path / "ref"))
    got = run_world(
        train_window, 2, stage, str(tmp_path / "swap"), str(tmp_path / "got"), swap_gradients
    )
    losses, state, skipped, resumed = got
    assert skipped == ref[2] == 1
    assert losses == ref[0] and resumed == losses[11:]
    assert all(torch.equal(state[k], v) for k, v in ref[1].items())


def failing_step(rank, world, stage, nvme_path, param, optim, failing_write):
    """Rank 1's third state write of step 3 fails with ENOSPC; the step is retried."""
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "offload_param": {"device": param, "nvme_path": nvme_path},
        },
    }
    engine = fzero.shard(Net(), optimizer=getattr(fzero.optim, optim)(lr=1e-2), config=config)
    losses = [_step(engine, rank, world, step) for step in range(3)]
    before = engine.state_dict(dtype=torch.float32)
    x, y = global_batch(3, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
    engine.backward(loss)
    # the third write, or the first of Lamb's second pass (its first writes 3 per unit)
    at = 3 if failing_write == "first pass" else 3 * len(engine.units) + 1
    message = failing_at_write(engine, at if rank == 1 else -1, engine.step)
    after_failure = engine.state_dict(dtype=torch.float32)
    steps = engine.global_steps
    engine.step()  # the same gradients, now written
    losses.append(loss.item())
    losses += [_step(engine, rank, world, step) for step in range(4, 7)]
    unchanged = rank != 0 or all(torch.equal(before[k], v) for k, v in after_failure.items())
    return message, unchanged, steps, losses


@pytest.mark.parametrize(
    ("stage", "param", "optim", "write"),
    [
        (2, "none", "adamw", "first pass"),
        (3, "nvme", "adamw", "first pass"),
        (2, "none", "lamb", "first pass"),
        (2, "none", "lamb", "second pass"),
    ],
)
def test_a_failed_nvme_step_changes_nothing_and_can_be_run_again(
    stage, param, optim, write, tmp_path
):
    """An ENOSPC on one rank in the middle of a step (in Lamb's second pass, after
    parameters were published locally) leaves every rank as before it."""
    (tmp_path / "swap").mkdir()
    message, unchanged, steps, losses = run_world(
        failing_step, 2, stage, str(tmp_path / "swap"), param, optim, write
    )
    assert "optimizer step was not applied" in message
    assert "rank 1: " in message and "No space left on device" in message
    assert unchanged and steps == 3
    reference = run_world(train, 2, stage, "bf16", None, None, None, None, optim)[0]
    assert losses == reference[:7]


def window_config(nvme_path):
    """Stage 3, accumulation 2, gradients on NVMe when `nvme_path` is given."""
    offload = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "none"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": offload,
        },
    }


def failing_backward(rank, world, nvme_path):
    """Rank 1's second gradient write of micro-step 3 fails; the window is run again."""
    torch.manual_seed(0)
    config = window_config(nvme_path)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=1e-2), config=config)
    losses = [_step(engine, rank, world, step) for step in range(3)]  # 2 opens a window
    message = failing_at_write(
        engine, 2 if rank == 1 else -1, lambda: _step(engine, rank, world, 3)
    )
    window_start = engine.micro_steps
    losses += [_step(engine, rank, world, step) for step in range(2, 8)]  # the window again
    return message, window_start, losses


def test_a_failed_gradient_write_drops_the_window_on_every_rank(tmp_path):
    (tmp_path / "swap").mkdir()
    message, window_start, losses = run_world(failing_backward, 2, str(tmp_path / "swap"))
    assert "gradients of this accumulation window were dropped" in message
    assert "rank 1: " in message and "No space left on device" in message
    assert window_start == 2  # micro-step 2 opened the window that failed
    again = losses[:2] + losses[3:]  # micro-step 2's first run was dropped with the window
    reference = run_world(train_reference_window, 2, None)
    assert again == reference


def train_reference_window(rank, world, _):
    torch.manual_seed(0)
    config = window_config(None)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=1e-2), config=config)
    return [_step(engine, rank, world, step) for step in range(8)]


def checkpoint_residency(rank, world, nvme_path, root):
    """How many units are resident at once while a checkpoint is saved and loaded."""
    torch.manual_seed(0)
    config = window_config(nvme_path)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=1e-2), config=config)
    for step in range(3):  # ends mid-window: gradients are saved too
        _step(engine, rank, world, step)
    live, most = [0], [0]
    real = engine.residency.resident

    @contextlib.contextmanager
    def counted(rt, write_back):
        with real(rt, write_back):
            live[0] += 1
            most[0] = max(most[0], live[0])
            try:
                yield
            finally:
                live[0] -= 1

    engine.residency.resident = counted
    engine.save_checkpoint(root)
    saved_most, most[0] = most[0], 0
    before = engine.state_dict(dtype=torch.float32)
    engine.load_checkpoint(root)
    after = engine.state_dict(dtype=torch.float32)
    same = rank != 0 or all(torch.equal(before[k], v) for k, v in after.items())
    return saved_most, most[0], len(engine.units), same


def test_nvme_checkpoints_hold_one_unit_at_a_time(tmp_path):
    """Saving streams each unit from the swap file into the rank file; loading writes
    each unit to the swap file's other slot as it is read (slots flip once all ranks
    have read theirs): the host never holds the whole partition."""
    (tmp_path / "swap").mkdir()
    saved, loaded, units, same = run_world(
        checkpoint_residency, 2, str(tmp_path / "swap"), str(tmp_path / "ckpt")
    )
    assert units > 1 and saved == 1 and loaded == 1 and same


def test_buffer_pool_reuses_aligned_buffers_and_trims():
    from fzero.core.nvme import ALIGN, BufferPool

    pool = BufferPool(1000)
    first, second = pool.take(), pool.take()
    assert first.numel() == 1000 and first.data_ptr() % ALIGN == 0
    pool.give(first)
    pool.give(second)
    assert pool.take() is second and pool.take() is first  # reused, no new mapping
    pool.give(first)
    pool.give(second)
    pool.trim(1)
    assert pool.take() is first and pool.take() is not second
    with pytest.raises(ValueError, match="buffer of 10 elements; the pool's are 1000"):
        pool.give(torch.empty(10))


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def nvme_step_memory(rank, world, swap):
    """Everything on NVMe with bf16 moments (the big-model configuration), 8 units of
    one 2048 x 2048 matrix: this rank's peaks above its RSS once the engine is built, in
    the backward and in the step of the second step, and after it."""
    from fzero.core import nvme

    nvme_keys = {"device": "nvme", "nvme_path": swap}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True, "bf16_optimizer_states": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "overlap_comm": False,
            "reduce_bucket_size": 1_000_000,
            "stage3_prefetch_bucket_size": 1_000_000,
            "stage3_max_live_parameters": 1_000_000,
            "stage3_max_reuse_distance": 0,
            "offload_param": nvme_keys,
            "offload_optimizer": {**nvme_keys, "commit": "in_place", "buffer_count": 8},
        },
    }
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    engine = fzero.shard(model, optimizer=fzero.optim.adamw(lr=1e-3), config=config)
    nvme.return_free_memory()
    base = _kb("VmRSS")
    peaks = {}
    for step in range(2):
        x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(step * 2 + rank))
        loss = engine(x).float().square().mean()
        Path("/proc/self/clear_refs").write_text("5")
        engine.backward(loss)
        peaks["backward"] = _kb("VmHWM") - base
        Path("/proc/self/clear_refs").write_text("5")
        engine.step()
        peaks["step"] = _kb("VmHWM") - base
        peaks["between"] = _kb("VmRSS") - base
    return peaks


def test_nvme_steps_hold_the_step_pipeline_only_in_the_step(tmp_path):
    """Everything on NVMe, bf16 moments, `buffer_count` 8: backward keeps as many
    gradient writes in flight as the step pipelines units (2), not `buffer_count`; the
    step's buffers go when it ends (the pool keeps none between steps) and its bf16
    moments travel inside their fp32 buffers (the same bits: `tests/test_nvme_disk.py`).
    Per rank, in 8 MiB parts (a unit's 2M-element fp32 part): measured 9.1 parts in
    backward, 12.8 in the step, 1.6 between steps; before, with 9 buffers kept from step
    to step and separate bf16 staging buffers, 16.1, 14.6 and 11.6 (the same losses).
    Since each unit's gradient is reduced and written in pieces of 2^20 elements
    (`reduce_bucket_size` 1e6: [Note: gradients reduced in pieces]), backward holds 6.5
    parts."""
    peaks = run_world(nvme_step_memory, 2, str(tmp_path), fresh=True)
    part_kb = 8 * 1024
    assert peaks["between"] <= 3 * part_kb, peaks  # no pool buffer, and a margin
    assert peaks["backward"] <= 8 * part_kb, peaks
    assert peaks["step"] <= 14 * part_kb, peaks  # 8 pool buffers, 6 bf16 shard writes


def test_fixing_the_mmap_threshold_leaves_a_users_own_setting_alone(monkeypatch):
    """glibc reads `MALLOC_MMAP_THRESHOLD_` (or the `glibc.malloc.mmap_threshold` tunable)
    at start; fzero's `mallopt` would overwrite it, so with either set it does not call it."""
    from fzero.core import nvme as _nvme

    calls = []

    class Libc:
        def mallopt(self, option: int, value: int) -> int:
            calls.append((option, value))
            return 1

    monkeypatch.setattr(_nvme, "_libc", Libc())
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    _nvme.map_large_buffers()
    assert calls == [(-3, 2**20)]  # M_MMAP_THRESHOLD, 1 MiB
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    _nvme.map_large_buffers()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    _nvme.map_large_buffers()
    assert calls == [(-3, 2**20)]
