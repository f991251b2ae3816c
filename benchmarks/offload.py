"""NVMe optimizer offload: peak memory against the optimizer state it keeps on disk, and
step time against the disk's own bandwidth measured in the same run.

    python benchmarks/offload.py [--width 2048 --depth 24 --steps 3 --dir DIR]

Model: `depth` Linear(width, width) layers (100.7M params at 2048 x 24), ZeRO stage 3,
bf16 compute, AdamW with `offload_optimizer: nvme`: 12 bytes per parameter (fp32
master, m, v) live in the swap file; gradients and bf16 parameter shards stay in host
memory (`swap_gradients: false`). The second configuration (ZeRO-Infinity) keeps the
gradient accumulators and the parameter shards (`offload_param: nvme`) on disk too.
Each runs in its own process (peak RSS is per process), the configurations interleaved
over `--rounds` rounds, each round also measuring the disk in its own process; the table
shows the median step with its min-max over rounds. The floor is the bytes one step must
read and write (24 per parameter, 38 with everything on NVMe) over the best sequential
bandwidth of the same directory over the rounds, read and written with O_DIRECT in 1 MiB
blocks (as the swap file is); a step faster than that is marked "under floor" with the
reason under the table. When DeepSpeed imports and its libaio op builds, a third row
runs DeepSpeed's ZeRO-Infinity on the same model with the same ZeRO knobs (its floor is
left blank: which bytes it moves is its own).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import fzero
from fzero.core import nvme as _nvme


def disk_bandwidth(directory: str, nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of an O_DIRECT sequential write then read of `nbytes` (same pool of I/O)."""
    swap = _nvme.SwapFile(directory, 0, [nbytes], threads=2, block_size=2**20, what="probe")
    buffer = _nvme.aligned_empty(nbytes // 4).fill_(1.0)
    start = time.perf_counter()
    swap.wait(swap.submit(0, buffer, write=True), "writing")
    os.fsync(swap.fd)
    swap.wait(swap.submit(0, buffer, write=False), "reading")
    seconds = time.perf_counter() - start
    swap.close()
    return 2 * nbytes / seconds


CONFIGS = {
    "optimizer": "NVMe optimizer (grads, params in memory)",
    "infinity": "NVMe optimizer + params (ZeRO-Infinity)",
    "deepspeed": "DeepSpeed, NVMe optimizer + params",
}
# the ZeRO knobs every configuration shares (fzero's and DeepSpeed's meaning)
ZERO = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 1,
    "reduce_bucket_size": 2**22,  # one unit: no whole-model gradient bucket
}


def median_step(engine: Any, x: torch.Tensor, steps: int) -> float:
    """Median seconds of `steps` training steps, after one warm-up step."""

    def step() -> None:
        engine.backward(engine(x).float().square().mean())
        engine.step()

    return statistics.median(_harness.time_steps(step, steps, warmup=1))


def deepspeed_available() -> str:
    """ "" when DeepSpeed imports and its libaio op builds here, else why not."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as error:
        return f"deepspeed does not import: {type(error).__name__}"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed's async_io op needs libaio's headers (libaio-dev)"
    return ""


def deepspeed_infinity(width: int, path: str) -> dict[str, Any]:
    """DeepSpeed's process group on gloo (one rank, no launcher) and its ZeRO-Infinity
    config for `width`-wide layers with the shared knobs: sub-groups one layer, swap
    files in `path`, no parameters kept in host memory."""
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="gloo")
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "aio": {"block_size": 2**20, "thread_count": 2},
        "zero_optimization": {
            **ZERO,
            "sub_group_size": width * width + width,
            "offload_optimizer": {"device": "nvme", "nvme_path": path},
            "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0},
        },
    }


def run_deepspeed(args: argparse.Namespace) -> dict[str, float]:
    """The same model and ZeRO knobs under DeepSpeed (CPU accelerator, gloo), with its
    sub-groups one layer and no parameters kept in host memory (`max_in_cpu` 0)."""
    import deepspeed

    config = deepspeed_infinity(args.width, args.dir)
    baseline = _harness.rss_mb()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    step = median_step(engine, torch.randn(4, args.width).bfloat16(), args.steps)
    params = args.depth * (args.width * args.width + args.width)
    return {
        "params": params,
        "baseline": baseline,
        "peak": _harness.peak_rss_mb(),
        "step": step,
        "moved": float("nan"),  # DeepSpeed's traffic is its own
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    """One configuration in this process: its peak RSS is this process's."""
    if args.config == "deepspeed":
        return run_deepspeed(args)
    baseline = _harness.rss_mb()
    torch.manual_seed(0)
    with fzero.init_context():  # never whole in memory
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    swap_gradients = args.config == "infinity"
    offload = {"device": "nvme", "nvme_path": args.dir, "swap_gradients": swap_gradients}
    zero = {**ZERO, "offload_optimizer": offload}
    if args.config == "infinity":
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.dir}
    config = {
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "aio": {"block_size": 2**20, "thread_count": 2},
        "zero_optimization": zero,
    }
    engine = fzero.shard(model, optimizer=fzero.optim.adamw(lr=1e-4), config=config)
    params = sum(rt.unit.numel for rt in engine.units)
    step = median_step(engine, torch.randn(4, args.width), args.steps)
    # Bytes one step moves per parameter: the optimizer reads master, m, v (12) and
    # writes them (12); ZeRO-Infinity also writes the gradient in backward and reads it
    # at the step (8), writes the bf16 shard (2) and reads it in forward and backward (4).
    moved = 24 + (14 if args.config == "infinity" else 0)
    return {
        "params": params,
        "baseline": baseline,
        "peak": _harness.peak_rss_mb(),
        "step": step,
        "moved": moved,
    }


COLUMNS = (
    ("peak RSS MB", ".0f"), ("% state", ".0f"), ("- interp.", ".0f"), ("% state", ".0f"),
    ("step s", ".2f"), ("min", ".2f"), ("max", ".2f"), ("floor s", ".2f"), ("x floor", ".2f"),
)  # fmt: skip


def table(results: dict[str, list[dict[str, float]]], rounds: int) -> _harness.Table:
    bandwidth = max(r["bandwidth"] for r in results.pop("bandwidth"))
    params = results["optimizer"][0]["params"]
    state_mb = 12 * params / 2**20
    rows, notes = [], []
    for name, measured in results.items():
        peak = max(r["peak"] for r in measured)
        model_side = peak - statistics.median([r["baseline"] for r in measured])
        step = _harness.spread([r["step"] for r in measured])
        floor: float | None = measured[0]["moved"] * params / bandwidth
        if math.isnan(floor):  # DeepSpeed's: which bytes it moves is its own
            floor = None
        ratio = step.median / floor if floor else None
        label = CONFIGS[name]
        if ratio is not None and ratio < 1:
            ratio, label = None, f"{label} (under floor)"
            notes.append(
                f"under floor: {CONFIGS[name]} stepped in {step.median:.2f} s, under the "
                f"{floor:.2f} s its bytes take at the best disk bandwidth measured: the "
                f"probe (512 MiB written, then read, once a round) did not reach the disk's "
                f"peak, so that floor bounds nothing for it"
            )
        cells = (
            peak, 100 * peak / state_mb, model_side, 100 * model_side / state_mb,
            *step, floor, ratio,
        )  # fmt: skip
        rows.append((label, cells))
    return _harness.Table(
        title=(
            f"NVMe offload, {params / 1e6:.1f}M params, stage 3, bf16, AdamW, 1 rank, "
            f"{rounds} interleaved rounds; optimizer state on disk {state_mb:.0f} MB "
            f"(12 B/param); disk {bandwidth / 1e9:.2f} GB/s (best O_DIRECT write + read)"
        ),
        name_header="configuration",
        columns=COLUMNS,
        rows=tuple(rows),
        notes=(
            "('- interp.': peak minus the RSS of the interpreter with torch imported; "
            "'% state': of the state on disk)",
            *notes,
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--results", default=None, help="also append the table to this file")
    parser.add_argument("--config", choices=[*CONFIGS, "bandwidth"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config == "bandwidth":
        _harness.write_row(args.json, {"bandwidth": disk_bandwidth(args.dir)})
        return
    if args.config:
        _harness.write_row(args.json, run(args))
        return
    names = ["bandwidth", *CONFIGS]
    missing = deepspeed_available()
    if missing:
        print(f"(DeepSpeed row left out: {missing})")
        names.remove("deepspeed")
    shape = [
        "--width", str(args.width), "--depth", str(args.depth), "--steps", str(args.steps),
        "--dir", args.dir,
    ]  # fmt: skip
    results = _harness.run_rows(
        names,
        lambda name, out: [sys.executable, __file__, *shape, "--config", name, "--json", out],
        args.rounds,
    )
    _harness.report("offload", table(results, args.rounds), args.results)


if __name__ == "__main__":
    main()
