"""ZeRO-Offload (optimizer state and update on the host): same training, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fzero
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, STEPS = 2, 20


def _step(engine, rank, world, step):
    x, y = global_batch(step, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
    engine.backward(loss)
    engine.step()
    return loss.item()


def train(rank, world, stage, precision, offload, root=None, nvme_path=None, param=None):
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
        Net(), optimizer=fzero.optim.adamw(lr=1e-2), precision=precision, config=config
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
            Net(), optimizer=fzero.optim.adamw(lr=1e-2), precision=precision, config=config
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
CASES += [(1, 2, "bf16", "cpu"), (1, 3, "fp32", "nvme")]


@pytest.mark.parametrize(("world", "stage", "precision", "device"), CASES)
def test_offload_trains_bit_for_bit_like_no_offload(world, stage, precision, device, tmp_path):
    losses, state, *_ = run_world(train, world, stage, precision, None)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    offloaded, offloaded_state, held, planned, resumed, swap = run_world(
        train, world, stage, precision, device, str(tmp_path / "ckpt"), str(swap_dir)
    )
    assert offloaded == losses
    assert all(torch.equal(offloaded_state[k], v) for k, v in state.items())
    assert resumed == losses[STEPS // 2 + 1 :]  # checkpoints save and resume with offload on
    if device == "cpu":
        assert held == planned and planned.host > 0  # masters and Adam state on the host
    else:
        assert held.master == held.optimizer_state == 0  # all of it in the swap file
        assert swap.startswith(str(swap_dir)) and not list(swap_dir.iterdir())  # removed


def test_a_full_disk_names_the_swap_file_and_the_bytes(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    with pytest.raises(
        OSError,
        match=r"cannot allocate the optimizer swap file .*fzero-optimizer-.*: [\d,]+ bytes needed",
    ):
        fzero.shard(Net(), stage=2, config=config)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_offload_needs_a_sharding_stage():
    with pytest.raises(ValueError, match=r"offload_optimizer' needs stage 1, 2 or 3, found 0"):
        fzero.shard(
            Net(), stage=0, config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
        )


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("param", "optimizer"), [("cpu", "cpu"), ("nvme", "nvme"), ("nvme", None)])
def test_stage3_parameter_offload_trains_bit_for_bit(world, param, optimizer, tmp_path):
    losses, state, *_ = run_world(train, world, 3, "bf16", None)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    offloaded, offloaded_state, held, _, resumed, _ = run_world(
        train, world, 3, "bf16", optimizer, str(tmp_path / "ckpt"), str(swap_dir), param
    )
    assert offloaded == losses and resumed == losses[STEPS // 2 + 1 :]
    assert all(torch.equal(offloaded_state[k], v) for k, v in state.items())
    if param == "nvme":
        assert held.params == 0  # between steps no parameter shard is in memory
        assert not list(swap_dir.iterdir())
