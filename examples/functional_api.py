"""fzero's functional side: look at a plan, train with your own partitioning function,
and compare the plan's memory estimate with what the engine holds.

    fzero run -n 2 examples/functional_api.py [--steps 30]

The custom strategy puts every tensor in a unit of its own (the finest granularity
there is), cut into equal aligned shards: a plan is plain data, so a research idea
about partitioning is one function.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero import partition


def one_unit_per_tensor(manifest, *, world_size, stage, **options):
    """A user partitioning function: `flat_even` with a one-element budget per unit, so
    every tensor starts a unit of its own."""
    return partition.flat_even(
        manifest, world_size=world_size, stage=stage, unit_numel=1, **options
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(100, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.GELU(), nn.Linear(64, 100)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save_dir", default="out/functional_api")
    args = parser.parse_args()
    fzero.comm.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. A plan, computed without a process group, on a model that needs no memory.
    with fzero.init_context():
        manifest = partition.describe(make_model())
    plan = partition.plan(manifest, world_size=world, stage=3, strategy=one_unit_per_tensor)
    if rank == 0:
        print(partition.format_plan(plan))

    # 2. Training with that strategy.
    engine = fzero.shard(
        make_model(),
        stage=3,
        optimizer=fzero.optim.adamw(lr=3e-3),
        strategy=one_unit_per_tensor,
        config={
            "steps_per_print": 0,
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
        },
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (64, 9), generator=gen)  # predict the 9th token: a fixed map
    targets = (tokens[:, :8].sum(1) * 7) % 100
    first = last = None
    for step in range(args.steps):
        rows = slice(rank * 8 + (step % 4) * 16, rank * 8 + (step % 4) * 16 + 8)
        loss = nn.functional.cross_entropy(engine(tokens[rows, :8]), targets[rows])
        engine.backward(loss)
        engine.step()
        first = loss.item() if first is None else first
        last = loss.item()

    # 3. A checkpoint, loaded into an engine with the default plan: resharded on load.
    path = engine.save_checkpoint(args.save_dir)
    other = fzero.shard(make_model(), stage=2, optimizer=fzero.optim.adamw(lr=3e-3))
    other.load_checkpoint(args.save_dir)
    same = all(
        torch.equal(a, b) for a, b in zip(engine.state_dict().values(), other.state_dict().values())
    )
    if rank == 0:
        print(f"checkpoint {path} into stage 2, default plan: identical {same}", flush=True)

    # 4. The plan's estimate against what this rank holds.
    held, planned = engine.memory_held(), engine.memory_planned()
    print(
        f"rank {rank}: loss {first:.3f} -> {last:.3f}; memory held {held.total:,} B, "
        f"memory_per_rank {planned.total:,} B ({'equal' if held == planned else 'DIFFERENT'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
