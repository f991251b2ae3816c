"""Activation memory with and without `fzero.checkpointing`, ZeRO stage 3, same run.

    fzero run -n 2 benchmarks/activation_memory.py [--width 512 --depth 16 --batch 512]

Model: `depth` residual blocks of Linear(w, 4w) + GELU + Linear(4w, w). For each
variant, on rank 0: the resident memory that forward adds and keeps until backward
(the activations autograd holds; RSS after forward minus RSS before it), and
seconds per step (forward + backward + step). The baseline is the same model
without checkpointing, measured in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fzero


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, width: int, depth: int, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = fzero.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        return x


def return_freed_memory() -> None:
    """glibc keeps freed blocks below a moving threshold in its heap, hiding frees from
    RSS; serving every block of 64 KiB or more by mmap makes RSS track live tensors."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_mmap_threshold = -3
    if not libc.mallopt(m_mmap_threshold, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: this benchmark needs glibc")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args: argparse.Namespace, checkpointed: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    engine = fzero.shard(
        Model(args.width, args.depth, checkpointed),
        stage=3,
        optimizer=fzero.optim.adamw(lr=1e-4),
        config={"steps_per_print": 0, "zero_optimization": {"stage3_max_reuse_distance": 0}},
    )
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    held, times = [], []
    for step in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        before = rss_bytes()
        loss = engine(x).square().mean()
        held.append(rss_bytes() - before)
        engine.backward(loss)
        engine.step()
        if step >= 2:  # the first steps record the stage-3 trace
            times.append(time.perf_counter() - start)
    return statistics.median(held[2:]) / 2**20, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    return_freed_memory()
    fzero.comm.init_distributed()
    rows = [
        ("no checkpointing", *measure(args, False)),
        ("fzero.checkpointing", *measure(args, True)),
    ]
    if dist.get_rank() == 0:
        activations = args.batch * args.width * 4 * (1 + 4 + 4) * args.depth / 2**20
        print(
            f"activation memory, stage 3, {dist.get_world_size()} ranks, {args.depth} blocks "
            f"of width {args.width}, batch {args.batch} per rank "
            f"(fp32 activations by count: {activations:.0f} MB)"
        )
        print(f"{'variant':<22} {'held after forward MB':>22} {'x baseline':>11} {'s/step':>8}")
        base = rows[0][1]
        for name, held, seconds in rows:
            print(f"{name:<22} {held:>22.1f} {held / base:>11.2f} {seconds:>8.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
