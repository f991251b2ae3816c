"""Small models and data shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


# ---- parity against one process: the torch run, the engine's config and its loop ----------


def torch_reference(
    optimizer: Callable[[list[dict]], torch.optim.Optimizer],
    *,
    steps: int,
    micro: int,
    accum: int,
    world: int,
    clip: float,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches (`micro * accum * world` rows a step), the two
    groups of `param_groups`: each step's loss and the final weights."""
    torch.manual_seed(0)
    model = Net()
    opt = optimizer(param_groups(model))
    losses = []
    for step in range(steps):
        x, y = global_batch(step, micro * accum * world)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parity_config(micro: int, accum: int, clip: float) -> dict[str, Any]:
    """The engine's config in the parity tests: several reduction buckets and prefetch of
    the next unit (Net's units hold 42-208 elements); stage 3 shards every tensor."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "zero_optimization": {
            "reduce_bucket_size": 300,
            "stage3_prefetch_bucket_size": 200,
            "stage3_param_persistence_threshold": 0,
        },
    }


def train_engine(engine: Any, rank: int, world: int, *, steps: int, micro: int) -> list[float]:
    """`steps` optimizer steps of `engine` on this rank's rows of the global batches (the
    engine's accumulation steps each): the mean loss over ranks and micro-steps."""
    accum = engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        x, y = global_batch(step, micro * accum * world)
        total = torch.zeros(1)
        for i in range(accum):
            rows = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
            loss = F.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * world))
    return losses
