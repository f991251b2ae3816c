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


def train(rank, world, stage, precision, offload, root=None):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu" if offload else "none", "pin_memory": True},
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
    resumed = None
    if root is not None:
        torch.manual_seed(1)
        again = fzero.shard(
            Net(), optimizer=fzero.optim.adamw(lr=1e-2), precision=precision, config=config
        )
        again.load_checkpoint(root)
        resumed = [_step(again, rank, world, step) for step in range(STEPS // 2 + 1, STEPS)]
    return losses, engine.state_dict(dtype=torch.float32), held, planned, resumed


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_offload_trains_bit_for_bit_like_no_offload(world, stage, precision, tmp_path):
    losses, state, _, _, _ = run_world(train, world, stage, precision, False)
    offloaded, offloaded_state, held, planned, resumed = run_world(
        train, world, stage, precision, True, str(tmp_path)
    )
    assert offloaded == losses
    assert all(torch.equal(offloaded_state[k], v) for k, v in state.items())
    assert held == planned and planned.host > 0  # masters and Adam state on the host
    assert resumed == losses[STEPS // 2 + 1 :]  # checkpoints save and resume with offload on


def test_offload_needs_a_sharding_stage():
    with pytest.raises(ValueError, match=r"offload_optimizer' needs stage 1, 2 or 3, found 0"):
        fzero.shard(
            Net(), stage=0, config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
        )
