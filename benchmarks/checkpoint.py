"""Checkpoint save/load time: fzero (sync, async) against torch.distributed.checkpoint
with FSDP2, and DeepSpeed ZeRO-3 when `deepspeed` imports; same model, 2 ranks, one run.

    fzero run -n 2 benchmarks/checkpoint.py [--width 2048 --depth 24 --dir DIR]

Model: `depth` Linear(width, width) layers (100.7M params at 2048 x 24), AdamW with
one step taken so its state exists. Both saves are durable: DCP's writer fsyncs each
file by default; fzero fsyncs its files and directories and verifies an XXH3-64
checksum of every tensor on load. Loads read from the page cache the saves left, as a
restart on the same node would. Saves and loads of the two libraries alternate, each
after an `os.sync()` that writes back what came before, and the table shows medians
of `--repeats` with their min-max (ratios: the median of the per-repeat ratios).
Also: consolidation to one model.safetensors and its peak RSS against the largest
tensor (rank 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import fzero


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def timed(fn, *args, **kwargs) -> float:
    return _harness.time_call(lambda: fn(*args, **kwargs), sync=dist.barrier)


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def settle() -> None:
    """Write back earlier dirty pages (untimed) so no save pays for another's."""
    dist.barrier()
    os.sync()
    dist.barrier()


def fzero_engine(args):
    engine = fzero.shard(
        make_model(args.width, args.depth),
        stage=3,
        optimizer=fzero.optim.adamw(lr=1e-4),
        config={
            "steps_per_print": 0,
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
        },
    )
    engine.backward(engine(torch.randn(4, args.width)).square().mean())
    engine.step()
    return engine


def dcp_functions(args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_model(args.width, args.depth)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, args.width)).square().mean().backward()
    opt.step()

    def save(path: str) -> None:
        # DCP's FileSystemWriter fsyncs each file (sync_files=True by default)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    def load(path: str) -> None:
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return save, load


def measure(args, root: str) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each library's save and load, alternating, into fresh directories (the previous
    ones removed untimed): seconds of each of `--repeats` by what was timed, and the
    bytes of each library's checkpoint."""
    dcp_path, fzero_path = os.path.join(root, "dcp"), os.path.join(root, "fzero")
    dcp_save, dcp_load = dcp_functions(args)
    engine = fzero_engine(args)
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for rep in range(args.repeats):
        if dist.get_rank() == 0:
            for name in os.listdir(root):
                if name != "fzero":
                    shutil.rmtree(os.path.join(root, name))
            shutil.rmtree(fzero_path, ignore_errors=True)
        settle()
        record("dcp", timed(dcp_save, f"{dcp_path}{rep}"))
        settle()
        record("fzero", timed(engine.save_checkpoint, fzero_path, tag=f"sync{rep}"))
        settle()
        returned = timed(engine.save_checkpoint, fzero_path, tag=f"async{rep}", async_save=True)
        record("returns", returned)
        record("written", returned + timed(engine.wait_for_checkpoint))
        record("load_dcp", timed(dcp_load, f"{dcp_path}{rep}"))
        record("load_fzero", timed(engine.load_checkpoint, fzero_path, tag=f"sync{rep}"))
    sizes = {
        "fzero": dir_bytes(os.path.join(fzero_path, f"sync{args.repeats - 1}")),
        "dcp": dir_bytes(f"{dcp_path}{args.repeats - 1}"),
    }
    return times, sizes


# (row, its save times, its load times or None, its library) of the table
ROWS = (
    ("torch DCP + FSDP2", "dcp", "load_dcp", "dcp"),
    ("fzero stage 3 (fsynced)", "fzero", "load_fzero", "fzero"),
    ("fzero stage 3 async: returns", "returns", None, "fzero"),
    ("fzero stage 3 async: written", "written", None, "fzero"),
)
COLUMNS = (
    ("save s", ".3f"), ("min", ".3f"), ("max", ".3f"), ("x DCP", ".2f"),
    ("load s", ".3f"), ("min", ".3f"), ("max", ".3f"), ("x DCP", ".2f"),
    ("GB", ".2f"), ("save GB/s", ".2f"),
)  # fmt: skip


def table(
    args, times: dict[str, list[float]], sizes: dict[str, int], notes: tuple[str, ...]
) -> _harness.Table:
    rows = []
    for name, save_key, load_key, library in ROWS:
        save = _harness.spread(times[save_key])
        cells: list[float | None] = [*save, _harness.paired_ratio(times[save_key], times["dcp"])]
        if load_key:
            load = _harness.spread(times[load_key])
            cells += [*load, _harness.paired_ratio(times[load_key], times["load_dcp"])]
        else:
            cells += [None] * 4
        size = sizes[library] / 1e9
        rows.append((name, (*cells, size, size / save.median)))
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    return _harness.Table(
        title=(
            f"checkpoint, {params / 1e6:.1f}M params + AdamW state, {dist.get_world_size()} "
            f"ranks, medians of {args.repeats} alternating repeats"
        ),
        name_header="library",
        columns=COLUMNS,
        rows=tuple(rows),
        notes=notes,
    )


def consolidation_row(args, root: str) -> str:
    """Consolidate in a fresh process so its peak RSS is its own."""
    # VmHWM (not ru_maxrss, which survives exec from this big process) is the child's own
    peak = "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
    code = f"import sys, fzero.checkpoint as c; c.consolidate(sys.argv[1], sys.argv[2]); {peak}"
    baseline = f"import torch, fzero.checkpoint; {peak}"
    out = os.path.join(root, "consolidated")
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", code, os.path.join(root, "fzero"), out],  # latest: the last async
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - start
    peak = float(run.stdout.split()[-1]) / 1024
    base = (
        float(
            subprocess.run(
                [sys.executable, "-c", baseline], capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
        / 1024
    )
    largest = args.width * args.width * 4 / 2**20
    size = dir_bytes(out) / 2**20
    return (
        f"consolidate to model.safetensors ({size:.0f} MB): {seconds:.2f} s, peak RSS "
        f"{peak:.0f} MB = interpreter+torch {base:.0f} MB + {peak - base:.0f} MB "
        f"(largest tensor {largest:.0f} MB fp32)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5, help="median of this many")
    parser.add_argument("--results", default=None, help="also append the table to this file")
    args = parser.parse_args()
    fzero.comm.init_distributed()
    rank = dist.get_rank()
    root = args.dir or os.path.join(tempfile.gettempdir(), "fzero-checkpoint-bench")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    times, sizes = measure(args, root)
    if rank == 0:
        notes = (
            consolidation_row(args, root),
            f"peak RSS rank 0: {_harness.peak_rss_mb():.0f} MB",
        )
        _harness.report("checkpoint", table(args, times, sizes, notes), args.results)
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
