"""Ranks that take different paths (issue: ranks that disagree never hang). Measured so
far: parameters one rank leaves unused get zero contributions from it at stages 1-2, as
DDP with `find_unused_parameters` (below). A stage-3 module one rank skips still ends in
the named error only after the collective timeout (see the README's "Launching")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from tests._dist import run_world


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 4, generator=gen)


def unused_case(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = fzero.shard(Branches(), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    x, y = _data()
    rows = slice(rank * 2, rank * 2 + 2)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x[rows], rank == 0), y[rows]))  # rank 1: no b
        engine.step()
    return engine.state_dict(dtype=torch.float32)


def reference() -> dict:
    """One process: the mean of the two ranks' losses, each over its own path."""
    torch.manual_seed(0)
    model = Branches()
    x, y = _data()
    for _ in range(2):
        model.zero_grad()
        loss = F.mse_loss(model(x[:2], True), y[:2]) + F.mse_loss(model(x[2:], False), y[2:])
        (loss / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_one_rank_leaves_unused_get_zero_contributions(stage):
    got = run_world(unused_case, 2, stage)
    for name, value in reference().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)
