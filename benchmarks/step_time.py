"""Seconds per training step: DDP, FSDP2 and fzero stages 0-3, same model and batches, 2 ranks.

    fzero run -n 2 benchmarks/step_time.py [--width 1024 --depth 8 --micro 8 --steps 20]
                                           [--bucket 1048576] [--rounds 3] [--rows A,B]
                                           [--results FILE]

Model: `depth` blocks of Linear(width, width) + GELU (8.4M params at 1024 x 8), AdamW.
Each row runs in its own processes (torchrun on as many ranks as the launch had, 2
when run with plain `python`), the rows interleaved over `--rounds` rounds. Prints one
table: s/step (the median over rounds of each round's median step) with its min-max
over rounds, the ratio to DDP (the median of the per-round ratios: a round's rows ran
minutes apart at most), and the row's own peak RSS (the largest VmHWM of its ranks over
the rounds).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import fzero

Step = Callable[[], None]


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def torch_step(model: nn.Module, x: torch.Tensor) -> Step:
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


def ddp(args: argparse.Namespace, x: torch.Tensor) -> Step:
    return torch_step(nn.parallel.DistributedDataParallel(make_model(args.width, args.depth)), x)


def fsdp2(reshard: bool) -> Callable[[argparse.Namespace, torch.Tensor], Step]:
    def build(args: argparse.Namespace, x: torch.Tensor) -> Step:
        from torch.distributed.fsdp import fully_shard

        model = make_model(args.width, args.depth)
        for block in model:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return torch_step(model, x)

    return build


def engine(
    stage: int, compiled: bool = False, **extra: int
) -> Callable[[argparse.Namespace, torch.Tensor], Step]:
    """The engine (`compiled`: over `torch.compile(model)`)."""

    def build(args: argparse.Namespace, x: torch.Tensor) -> Step:
        zero = {"overlap_comm": True, "reduce_bucket_size": args.bucket, **extra}
        model = make_model(args.width, args.depth)
        sharded = fzero.shard(
            torch.compile(model) if compiled else model,
            stage=stage,
            optimizer=fzero.optim.adamw(lr=1e-3),
            config={"steps_per_print": 0, "zero_optimization": zero},
        )

        def step() -> None:
            sharded.backward(sharded(x).square().mean())
            sharded.step()

        return step

    return build


def train_step(
    stage: int, compiled: bool = False
) -> Callable[[argparse.Namespace, torch.Tensor], Step]:
    """The functional front door on the same model and plan as the engine's row:
    fzero.train_step over a TrainState (`compiled`: over `torch.compile(loss_fn)`)."""

    def build(args: argparse.Namespace, x: torch.Tensor) -> Step:
        model = make_model(args.width, args.depth)
        zero = fzero.load_config({}).zero_optimization  # the engine's defaults, as its rows
        options = {"persistence_threshold": zero.stage3_param_persistence_threshold}
        options = options if stage == 3 else {}
        manifest = fzero.partition.describe(model)
        plan = fzero.partition.plan(
            manifest, world_size=dist.get_world_size(), stage=stage, **options
        )
        optimizer = fzero.optim.adamw(lr=1e-3)
        state = {"now": fzero.init(model, plan, optimizer)}

        def loss_fn(params, batch):
            return torch.func.functional_call(model, params, (batch,)).square().mean()

        config = {"zero_optimization": {"reduce_bucket_size": args.bucket}}
        train = fzero.train_step(
            torch.compile(loss_fn) if compiled else loss_fn, plan, optimizer, config=config
        )

        def step() -> None:
            state["now"], _ = train(state["now"], x)

        return step

    return build


# Rows run under fzero's watch variables, set before the row's process group starts (the
# watch reads them then, once): "unchecked" turns the order check off
# (`FZERO_CHECK_COLLECTIVES=0`: what comparing each collective with the one issued there
# last step costs when nothing diverges); "unwatched" also leaves waits unsliced and
# unreported (`FZERO_WATCH_S=0`, `FZERO_REPORT_S=0`: what asking the other ranks costs).
UNCHECKED = {"FZERO_CHECK_COLLECTIVES": "0"}
UNWATCHED = {**UNCHECKED, "FZERO_WATCH_S": "0", "FZERO_REPORT_S": "0"}
WATCH_ROWS = {"unchecked": UNCHECKED, "unwatched": UNWATCHED}


# Stage 3 twice: DeepSpeed's defaults (a unit reused within stage3_max_reuse_distance
# elements stays gathered from forward into backward) and strict release after every use
# (reuse distance 0: like FSDP2's reshard_after_forward=True).
ROWS: dict[str, Callable[[argparse.Namespace, torch.Tensor], Step]] = {
    "DDP": ddp,
    "FSDP2 reshard_after_forward=False": fsdp2(False),
    "FSDP2 reshard_after_forward=True": fsdp2(True),
    **{f"fzero stage {stage}": engine(stage) for stage in range(4)},
    "fzero stage 3 max_reuse_distance=0": engine(3, stage3_max_reuse_distance=0),
    "fzero stage 3 compiled model": engine(3, compiled=True),
    **{f"fzero stage {stage} {how}": engine(stage) for stage in (1, 3) for how in WATCH_ROWS},
    **{f"fzero.train_step stage {stage}": train_step(stage) for stage in range(4)},
    **{f"fzero.train_step stage 3 {how}": train_step(3) for how in WATCH_ROWS},
    "fzero.train_step stage 3 compiled": train_step(3, compiled=True),
}
BASELINE = "DDP"
COLUMNS = (
    ("s/step", ".3f"), ("min", ".3f"), ("max", ".3f"), ("x DDP", ".2f"), ("peak RSS MB", ".0f"),
)  # fmt: skip


def run_row(args: argparse.Namespace) -> None:
    """One row in this launch's processes: rank 0 writes the median of its step times and
    the largest peak RSS of the ranks to `--json`."""
    os.environ.update(WATCH_ROWS.get(args.row.rsplit(" ", 1)[-1], {}))
    fzero.comm.init_distributed()
    x = torch.randn(
        args.micro, args.width, generator=torch.Generator().manual_seed(dist.get_rank())
    )
    step = ROWS[args.row](args, x)
    times = _harness.time_steps(step, args.steps, sync=dist.barrier)
    del step  # the model and its hooks go before the process group they hold work of
    gc.collect()
    peaks: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(peaks, _harness.peak_rss_mb())
    if dist.get_rank() == 0:
        _harness.write_row(
            args.json,
            {
                "seconds": statistics.median(times),
                "peak_rss_mb": max(peaks),
                "world": dist.get_world_size(),
                "threads": torch.get_num_threads(),
            },
        )
    dist.barrier()
    dist.destroy_process_group()


def table(args: argparse.Namespace, results: dict[str, list[dict]]) -> _harness.Table:
    base = [r["seconds"] for r in results[BASELINE]] if BASELINE in results else None
    rows = []
    for name, rounds in results.items():
        times = [r["seconds"] for r in rounds]
        seconds = _harness.spread(times)
        ratio = _harness.paired_ratio(times, base) if base else None
        rss = max(r["peak_rss_mb"] for r in rounds)
        rows.append((name, (seconds.median, seconds.low, seconds.high, ratio, rss)))
    first = next(iter(results.values()))[0]
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    return _harness.Table(
        title=(
            f"step time, {params / 1e6:.1f}M params, micro batch {args.micro}, "
            f"{first['world']} ranks, {first['threads']} threads/rank, median of {args.steps} "
            f"steps per round, {args.rounds} interleaved rounds"
        ),
        name_header="engine",
        columns=COLUMNS,
        rows=tuple(rows),
        notes=("(each row in its own processes: peak RSS is that row's, largest rank)",),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    parser.add_argument(
        "--bucket",
        type=int,
        default=2**20,
        help="fzero reduce_bucket_size in elements (DDP's bucket is 25 MB)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all rows")
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks per row (default: the launch's, else 2)"
    )
    parser.add_argument("--results", default=None, help="also append the table to this file")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        run_row(args)
        return
    if _harness.launched_rank() not in (None, 0):
        return  # under `fzero run -n N`, rank 0 launches the rows on N ranks
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", 2))
    names = [name.strip() for name in args.rows.split(",") if name.strip()] or list(ROWS)
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; expected some of {list(ROWS)}")
    shape = [
        "--width", str(args.width), "--depth", str(args.depth), "--micro", str(args.micro),
        "--steps", str(args.steps), "--bucket", str(args.bucket),
    ]  # fmt: skip
    results = _harness.run_rows(
        names,
        lambda name, out: _harness.torchrun(nproc, __file__, *shape, "--row", name, "--json", out),
        args.rounds,
    )
    _harness.report("step_time", table(args, results), args.results)


if __name__ == "__main__":
    main()
