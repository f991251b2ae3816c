"""Seconds per training step: DDP, FSDP2 and fzero stages 0-3, same model and batches, 2 ranks.

    fzero run -n 2 benchmarks/step_time.py [--width 1024 --depth 8 --micro 8 --steps 20]
                                           [--bucket 1048576]

Model: `depth` blocks of Linear(width, width) + GELU (8.4M params at 1024 x 8), AdamW.
Prints one table on rank 0: s/step (median over timed steps), ratio to DDP measured
in the same run, peak RSS per rank. DeepSpeed rows appear when `deepspeed` imports.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fzero


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def timed(step, steps: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--bucket",
        type=int,
        default=2**20,
        help="fzero reduce_bucket_size in elements (DDP's bucket is 25 MB)",
    )
    args = parser.parse_args()
    fzero.comm.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.micro, args.width, generator=gen)
    rows: list[tuple[str, float, float]] = []

    def torch_step(model, opt):
        def step(_):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

        return step

    ddp = nn.parallel.DistributedDataParallel(make_model(args.width, args.depth))
    rows.append(
        (
            "DDP",
            timed(torch_step(ddp, torch.optim.AdamW(ddp.parameters())), args.steps),
            peak_rss_mb(),
        )
    )
    del ddp

    from torch.distributed.fsdp import fully_shard

    for reshard in (False, True):
        model = make_model(args.width, args.depth)
        for block in model:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        name = f"FSDP2 reshard_after_forward={reshard}"
        rows.append(
            (
                name,
                timed(torch_step(model, torch.optim.AdamW(model.parameters())), args.steps),
                peak_rss_mb(),
            )
        )
        del model

    # Stage 3 twice: DeepSpeed's defaults (a unit reused within stage3_max_reuse_distance
    # elements stays gathered from forward into backward) and strict release after every
    # use (reuse distance 0: like FSDP2's reshard_after_forward=True).
    variants = [(stage, {}) for stage in range(4)]
    variants.append((3, {"stage3_max_reuse_distance": 0}))
    for stage, extra in variants:
        zero = {"overlap_comm": True, "reduce_bucket_size": args.bucket, **extra}
        engine = fzero.shard(
            make_model(args.width, args.depth),
            stage=stage,
            optimizer=fzero.optim.adamw(lr=1e-3),
            config={"steps_per_print": 0, "zero_optimization": zero},
        )

        def step(_, engine=engine):
            engine.backward(engine(x).square().mean())
            engine.step()

        name = f"fzero stage {stage}" + "".join(f" {k[7:]}={v}" for k, v in extra.items())
        rows.append((name, timed(step, args.steps), peak_rss_mb()))
        del engine

    # The functional front door on the same model: fzero.train_step over a TrainState.
    for stage in (1, 3):
        model = make_model(args.width, args.depth)
        options = {"persistence_threshold": 0} if stage == 3 else {}
        manifest = fzero.partition.describe(model)
        plan = fzero.partition.plan(manifest, world_size=world, stage=stage, **options)
        optimizer = fzero.optim.adamw(lr=1e-3)
        state = {"now": fzero.init(model, plan, optimizer)}

        def loss_fn(params, batch, model=model):
            return torch.func.functional_call(model, params, (batch,)).square().mean()

        train = fzero.train_step(loss_fn, plan, optimizer)

        def step(_, state=state, train=train):
            state["now"], _ = train(state["now"], x)

        rows.append((f"fzero.train_step stage {stage}", timed(step, args.steps), peak_rss_mb()))
        del state, model

    if rank == 0:
        base = rows[0][1]
        params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
        print(
            f"step time, {params / 1e6:.1f}M params, micro batch {args.micro}, {world} ranks, "
            f"{torch.get_num_threads()} threads/rank"
        )
        print(f"{'engine':<34} {'s/step':>8} {'x DDP':>7} {'peak RSS MB':>12}")
        for name, seconds, rss in rows:
            print(f"{name:<34} {seconds:>8.3f} {seconds / base:>7.2f} {rss:>12.0f}")
        print("(peak RSS is the process high-water mark so far: it only grows down the table)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
