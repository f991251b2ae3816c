"""Activation checkpointing: DeepSpeed's configure/checkpoint, exact under every stage."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero.config import ConfigError
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, ACCUM, STEPS = 2, 2, 3


class CheckpointedNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + fzero.checkpointing.checkpoint(block, h)
        return self.head(h)


@pytest.fixture(autouse=True)
def _fresh_settings():
    fzero.checkpointing.reset()
    yield
    fzero.checkpointing.reset()


def test_configure_reads_the_config_block_and_keywords_override():
    config = {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4}}
    chosen = fzero.checkpointing.configure(None, deepspeed_config=config, profile=True)
    assert (chosen.cpu_checkpointing, chosen.number_checkpoints, chosen.profile) == (True, 4, True)
    assert fzero.checkpointing.is_configured()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_activations": True}, "partition_activations is true"),
        ({"contiguous_checkpointing": True}, "contiguous_memory_optimization is true"),
        ({"num_checkpoints": 0}, "number_checkpoints is 0"),
        ({"mpu_": object()}, "mpu_"),
    ],
)
def test_configure_refuses_what_needs_model_parallelism(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        fzero.checkpointing.configure(**kwargs)


def train(rank, world, stage, checkpointed, settings):
    if settings:
        fzero.checkpointing.configure(None, **settings)
    torch.manual_seed(0)
    model = CheckpointedNet() if checkpointed else Net()
    engine = fzero.shard(
        model,
        stage=stage,
        optimizer=fzero.optim.adamw(lr=1e-2),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
        },
    )
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * ACCUM * world)
        for i in range(ACCUM):
            rows = slice((i * world + rank) * MICRO, (i * world + rank + 1) * MICRO)
            loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    state = engine.state_dict()
    dist.barrier()
    return losses, state, fzero.checkpointing.timings()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointed_training_is_bitwise_the_same(stage):
    plain_losses, plain_state, _ = run_world(train, 2, stage, False, {})
    losses, state, _ = run_world(train, 2, stage, True, {})
    assert losses == plain_losses
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name


def test_cpu_checkpointing_and_profile_keep_results_and_time_both_passes():
    plain_losses, plain_state, _ = run_world(train, 2, 3, False, {})
    settings = {"checkpoint_in_cpu": True, "profile": True, "synchronize": True}
    losses, state, timings = run_world(train, 2, 3, True, settings)
    assert losses == plain_losses
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())
    assert timings["forward"] > 0 and timings["recompute"] > 0


def test_checkpointing_saves_fewer_activations():
    """What autograd keeps for backward, counted by a saved-tensor hook around forward."""

    def saved_bytes(model: nn.Module) -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        x = torch.randn(64, 7)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        return total

    torch.manual_seed(0)
    plain = saved_bytes(Net())
    torch.manual_seed(0)
    checkpointed = saved_bytes(CheckpointedNet())
    assert checkpointed < 0.6 * plain, (checkpointed, plain)
