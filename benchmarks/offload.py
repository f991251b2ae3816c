"""NVMe optimizer offload: peak memory against the optimizer state it keeps on disk, and
step time against the disk's own bandwidth measured in the same run.

    python benchmarks/offload.py [--width 2048 --depth 24 --steps 3 --dir DIR]

Model: `depth` Linear(width, width) layers (100.7M params at 2048 x 24), ZeRO stage 3,
bf16 compute, AdamW with `offload_optimizer: nvme`: 12 bytes per parameter (fp32
master, m, v) live in the swap file. The floor is the bytes one step must read and
write (24 per parameter) over the sequential bandwidth of the same directory, read and
written with O_DIRECT in 1 MiB blocks (as the swap file is).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import fzero
from fzero import _nvme


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def vm_rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    baseline = vm_rss_mb()
    torch.manual_seed(0)
    with fzero.init_context():  # never whole in memory
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    config = {
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "aio": {"block_size": 2**20, "thread_count": 2},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 1,
            "reduce_bucket_size": 2**22,  # one unit: no whole-model gradient bucket
            "offload_optimizer": {"device": "nvme", "nvme_path": args.dir},
        },
    }
    engine = fzero.shard(model, optimizer=fzero.optim.adamw(lr=1e-4), config=config)
    params = sum(rt.unit.numel for rt in engine.units)
    state_mb = 12 * params / 2**20
    x = torch.randn(4, args.width)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        engine.backward(engine(x).float().square().mean())
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    bandwidth = disk_bandwidth(args.dir)
    floor = 24 * params / bandwidth
    peak = vm_hwm_mb()
    print(f"NVMe optimizer offload, {params / 1e6:.1f}M params, stage 3, bf16, 1 rank")
    print(f"optimizer state on disk        {state_mb:>9.0f} MB (12 B/param)")
    print(f"peak RSS                       {peak:>9.0f} MB = {peak / state_mb:.0%} of it")
    print(f"  of which interpreter + torch {baseline:>9.0f} MB")
    model_side = peak - baseline
    print(f"  model side (peak - baseline) {model_side:>9.0f} MB = {model_side / state_mb:.0%}")
    print(f"disk bandwidth (O_DIRECT r+w)  {bandwidth / 1e9:>9.2f} GB/s")
    print(
        f"step                           {step:>9.2f} s; floor {floor:.2f} s -> {step / floor:.2f}x"
    )


if __name__ == "__main__":
    main()
