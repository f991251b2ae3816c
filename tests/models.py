"""Small models and data shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 7, 13, 3


class Net(nn.Module):
    """Uneven parameter sizes (none divisible by 4), blocks, LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.LayerNorm(HIDDEN))
            for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Awkward(nn.Module):
    """Tied embedding/head, a frozen layer, an unused layer, a block called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.block = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(6, 5)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h)) + self.frozen(h)
        return self.head(h)


def param_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """Two groups, as BERT pre-training does: no decay for biases and LayerNorm."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or ".2." in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN, generator=gen)
    y = torch.randn(size, OUT, generator=gen)
    return x, y
