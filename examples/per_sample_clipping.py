"""DP-SGD style training — per-sample gradient clipping with `vmap(grad(...))` — under
ZeRO-3, through `fzero.train_step(grad_fn=...)`.

    fzero run -n 2 examples/per_sample_clipping.py [--steps 40] [--noise 0.0]

Differentially private SGD (Abadi et al. 2016, Algorithm 1) clips each example's
gradient to norm C, sums them, adds Gaussian noise N(0, sigma^2 C^2) and divides by the
batch size. Per-example gradients are one torch.func line: `vmap(grad(loss))` over the
batch. Here the parameters are sharded ZeRO-3 style across ranks: fzero gathers them for
`grad_fn`, averages the clipped gradients over ranks into each rank's shard and updates
the shards. (DeepSpeed documents torch.func transforms for ZeRO stages 0-2.)

Each rank draws its share of the noise, sigma * C / sqrt(world), from its own seed, so
the sum over ranks has the standard deviation DP-SGD asks for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import fzero

FEATURES, CLASSES = 20, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def make_batch(step: int, rows: int) -> tuple[Tensor, Tensor]:
    """A global batch of a fixed teacher's classification problem (the same on all ranks)."""
    teacher = torch.Generator().manual_seed(1234)
    weights = torch.randn(FEATURES, CLASSES, generator=teacher)
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(rows, FEATURES, generator=gen)
    return x, (x @ weights).argmax(dim=1)


def clipped_mean_grads(
    model: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor, clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The batch's loss, and the mean of its per-example gradients each clipped to norm
    `clip` (no noise): the part of DP-SGD that is the same on every rank."""

    def example_loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, x, y)
    squares = sum(g.flatten(1).square().sum(dim=1) for g in per_example.values())
    factors = (clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    grads = {k: torch.einsum("b,b...->...", factors, g) / len(x) for k, g in per_example.items()}
    with torch.no_grad():
        loss = F.cross_entropy(functional_call(model, params, (x,)), y)
    return loss, grads


def dp_grad_fn(
    model: nn.Module, clip: float, noise: float, batch_size: int, seed: int
) -> Callable[[dict[str, Tensor], tuple[Tensor, Tensor]], tuple[Tensor, dict[str, Tensor]]]:
    """`grad_fn` for `fzero.train_step`: clipped per-example gradients plus this rank's
    share of the Gaussian noise."""
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(seed)

    def grad_fn(params, batch):
        loss, grads = clipped_mean_grads(model, params, *batch, clip)
        if noise > 0:
            std = noise * clip * world**0.5 / batch_size  # averaged over ranks afterwards
            grads = {
                k: g + std * torch.randn(g.shape, generator=generator) for k, g in grads.items()
            }
        return loss, grads

    return grad_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    parser.add_argument("--clip", type=float, default=1.0, help="per-example norm bound C")
    parser.add_argument("--noise", type=float, default=0.5, help="noise multiplier sigma")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    fzero.comm.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    model = make_model()
    plan = fzero.partition.plan(
        fzero.partition.describe(model), world_size=world, stage=3, persistence_threshold=0
    )
    optimizer = fzero.optim.sgd(lr=args.lr)
    state = fzero.init(model, plan, optimizer)
    grad_fn = dp_grad_fn(model, args.clip, args.noise, args.batch * world, seed=1000 + rank)
    step = fzero.train_step(plan=plan, optimizer=optimizer, grad_fn=grad_fn)
    losses = []
    for i in range(args.steps):
        x, y = make_batch(i, args.batch * world)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        state, metrics = step(state, (x[mine], y[mine]))
        loss = metrics["loss"].clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if rank == 0 and (i % 10 == 0 or i == args.steps - 1):
            print(f"step {i:3d}  loss {losses[-1]:.4f}  grad norm {metrics['grad_norm']:.4f}")
    weights = fzero.state_dict(state)
    if rank == 0:
        held = sum(u.master.numel() for u in state.units)
        print(
            f"ZeRO-3 over {world} ranks: rank 0 holds {held} of {plan.manifest.numel} fp32 "
            f"weights; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            f"{len(weights)} tensors consolidated"
        )


if __name__ == "__main__":
    main()
