"""Plans on a mesh, as a research user writes one: a strategy of your own, its picture and
communication volume, training with it through both doors, and its checkpoint restored
under a built-in preset.

    fzero run -n 4 examples/custom_partitioning.py [--steps 30] [--out out/custom_partitioning]

Four processes form a 2 x 2 mesh ("node" x "local", as 2 machines of 2 GPUs would). The
strategy: every unit's gradients and optimizer state split within the node and replicated
across nodes (MiCS/HSDP: the slow link carries one gradient shard per rank, never a
parameter gather), and a unit's parameters kept whole on every rank when it is small
(as DeepSpeed's persistence threshold does), else split within the node too.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero import partition

MESH = partition.Mesh({"node": 2, "local": 2})
SMALL = 2_000  # elements: a unit this small keeps whole parameters (this preset's own
# rule, so plans here say persistence_threshold=0 instead of DeepSpeed's 100,000)


def mics_small_whole(mesh: partition.Mesh, unit: partition.Unit) -> partition.UnitSharding:
    """Per unit and kind of state: which mesh axes it is split over (the rest replicate)."""
    local = mesh.sharding("local")
    params = mesh.replicated if unit.numel < SMALL else local
    return partition.UnitSharding(params=params, grads=local, optimizer=local)


PRESET = partition.Custom("mics_small_whole", mics_small_whole)


def strategy(manifest, *, world_size, stage, **options):
    """A strategy for the engine (`fzero.initialize(strategy=...)` or the config's
    `"strategy": "module:function"`): the same plan, laid out by `flat_even`."""
    return partition.mesh_plan(manifest, MESH, PRESET, persistence_threshold=0)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(100, 32),
        nn.Flatten(),
        nn.Linear(32 * 8, 64),
        nn.LayerNorm(64),
        nn.GELU(),
        nn.Linear(64, 100),
    )


def batches(rank: int, steps: int):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (128, 9), generator=gen)  # predict a fixed map of 8 tokens
    targets = (tokens[:, :8].sum(1) * 7) % 100
    for step in range(steps):
        rows = slice((step % 4) * 32 + rank * 8, (step % 4) * 32 + rank * 8 + 8)
        yield tokens[rows, :8], targets[rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="out/custom_partitioning")
    args = parser.parse_args()
    fzero.comm.init_distributed()
    rank = dist.get_rank()
    MESH.check_world(dist.get_world_size())

    # 1. The plan, as data: what each rank holds of each kind, and what a step sends.
    manifest = partition.describe(make_model())
    plan = partition.mesh_plan(manifest, MESH, PRESET, persistence_threshold=0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(partition.format_plan(plan))
        print(partition.format_comm_volume(partition.comm_volume(plan)), flush=True)
        try:
            with open(os.path.join(args.out, "plan.png"), "wb") as f:
                f.write(partition.plot_plan(plan))
            print(f"picture: {args.out}/plan.png", flush=True)
        except ImportError:
            print("picture: needs matplotlib (pip install fzero[bench])", flush=True)

    # 2. Training through the functional door: the plan is the state's.
    model = make_model()
    optimizer = fzero.optim.adamw(lr=3e-3, weight_decay=0.01)
    state = fzero.init(model, plan, optimizer)

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
    step = fzero.train_step(loss_fn, plan, optimizer, config)
    functional = []
    for batch in batches(rank, args.steps):
        state, metrics = step(state, batch)
        functional.append(metrics["loss"].item())

    # 3. The same through DeepSpeed's door, with the strategy.
    engine, *_ = fzero.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "steps_per_print": 0,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3},
        },
        strategy=strategy,
    )
    engine_losses = []
    for x, y in batches(rank, args.steps):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        engine_losses.append(loss.item())
    same = all(
        torch.equal(a, b)
        for a, b in zip(fzero.state_dict(state).values(), engine.state_dict().values())
    )
    if rank == 0:
        print(f"mesh {engine.plan.mesh.axes}, split over {engine.plan.mesh.shard}", flush=True)
        print(
            f"loss {functional[0]:.3f} -> {functional[-1]:.3f} (train_step), "
            f"{engine_losses[0]:.3f} -> {engine_losses[-1]:.3f} (initialize); "
            f"weights identical: {same}",
            flush=True,
        )

    # 4. Its checkpoint, restored under the built-in MiCS preset (DeepSpeed's key).
    engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag="done")
    mics, *_ = fzero.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "mics_shard_size": 2},
        },
    )
    mics.load_checkpoint(os.path.join(args.out, "ckpt"), tag="done")
    restored = all(
        torch.equal(a, b) for a, b in zip(engine.state_dict().values(), mics.state_dict().values())
    )
    if rank == 0:
        print(f"restored under preset {mics.plan.mesh.preset}: identical {restored}", flush=True)


if __name__ == "__main__":
    main()
