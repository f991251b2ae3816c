"""The largest model this machine trains: ZeRO-Infinity (stage 3, parameters, gradients,
master weights and optimizer state on NVMe), sized up until the disk says no.

    python benchmarks/scale.py [--sizes 0.5,1,2,4] [--width 4096] [--dir DIR]
                               [--checkpoint-up-to 1] [--plot scale.png]

Model: `depth` Linear(width, width) layers built inside
`fzero.init_context(dtype=torch.bfloat16, remote_device="nvme")` (each partition written
to a file under the swap directory as its module is made: never whole in memory, one
rank's partitions being the whole model), bf16 compute, AdamW, one rank,
`offload_optimizer.commit: in_place` and `bf16.bf16_optimizer_states` (what fits the
most parameters on a disk: 4 B fp32 master + 2 + 2 B bf16 moments + 4 B fp32 gradient +
2 B bf16 parameter = 14 B/param). Each size runs in its own process (peak RSS is per
process; each phase's peak is taken after resetting the kernel's high-water mark). The
floor of a step is the bytes it must move (30 per parameter: the step reads master,
moments and gradient, 12, and writes master and moments, 8; backward writes the
gradient, 4; the bf16 parameter is written once and read by forward and backward, 6)
over the disk's O_DIRECT bandwidth measured in the same run. Sizes up to
`--checkpoint-up-to` billion parameters also save a checkpoint (streamed from the swap
files), resume from it, and consolidate it to `model.safetensors`, if the disk can hold
that beside the swap files. `--bf16-masters` keeps the masters and the gradient sums in
bf16 too (`bf16_master_weights_and_grads`, `data_types.grad_accum_dtype` "bf16"): 10
B/param in the swap files, 22 moved by a step, a checkpoint of 6 (fp32 masters: 8).

When DeepSpeed imports and its async I/O op builds, its ZeRO-Infinity runs the same
sizes with the same knobs, each only when its measured bytes per parameter at the
smallest size say it fits on the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import peak_rss_mb, rss_mb
from offload import ZERO, deepspeed_available, deepspeed_infinity, disk_bandwidth

import fzero

MOVED = 30  # bytes per parameter a step moves (see above)
MOVED_BF16 = 22  # --bf16-masters: master and gradient 2 bytes each wherever they move

# DeepSpeed's ZeRO-Infinity bytes on disk per parameter with these knobs, assumed until
# its first row measures them (18.0 measured here), so no attempt can fill the disk
DEEPSPEED_GUESS = 20.0


def reset_peak() -> None:
    """Start a new peak-RSS window (Linux: the high-water mark back to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def swap_bytes(directory: str) -> int:
    """Bytes the swap files in `directory` take on disk (allocated blocks)."""
    total = 0
    for name in os.listdir(directory):
        if name.endswith(".swap"):
            total += os.stat(os.path.join(directory, name)).st_blocks * 512
    return total


def config(args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 0,
        "bf16": {
            "enabled": True,
            "bf16_optimizer_states": True,
            "bf16_master_weights_and_grads": args.bf16_masters,
        },
        "data_types": {"grad_accum_dtype": "bf16" if args.bf16_masters else None},
        "aio": {"block_size": 2**20, "thread_count": 2},
        "zero_optimization": {
            **ZERO,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": swap_dir,
                "commit": "in_place",
                "buffer_count": 8,
            },
            "offload_param": {"device": "nvme", "nvme_path": swap_dir},
        },
    }


def run_fzero(args: argparse.Namespace) -> dict[str, Any]:
    """One size in this process: build, train, and (small enough) save, resume and
    consolidate; the peak RSS of each phase."""
    swap_dir = tempfile.mkdtemp(prefix="fzero-scale-", dir=args.dir)
    row: dict[str, Any] = {"baseline": rss_mb()}
    try:
        torch.manual_seed(0)
        reset_peak()
        start = time.perf_counter()
        # in memory, one rank's partitions would be the whole model (4 B/param at fp32)
        with fzero.init_context(dtype=torch.bfloat16, remote_device="nvme", nvme_path=swap_dir):
            model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
        engine = fzero.shard(
            model, optimizer=fzero.optim.adamw(lr=1e-4), config=config(args, swap_dir)
        )
        row["build_s"], row["build_peak"] = time.perf_counter() - start, peak_rss_mb()
        row["params"] = sum(rt.unit.numel for rt in engine.units)
        row["disk"] = swap_bytes(swap_dir)
        x = torch.randn(4, args.width)
        times = []
        reset_peak()
        for _ in range(args.steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            engine.backward(engine(x).float().square().mean())
            engine.step()
            times.append(time.perf_counter() - start)
        row["step_s"], row["peak"] = min(times[1:]), peak_rss_mb()
        row["loss_finite"] = bool(torch.isfinite(engine(x).float().square().mean()))
        if row["params"] <= args.checkpoint_up_to * 1e9:
            row.update(checkpoint_phases(engine, args, swap_dir))
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    return row


def checkpoint_phases(engine: Any, args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    """Save (streamed from the swap files), resume into the same engine, consolidate to
    bf16 `model.safetensors`: seconds and peak RSS of each, the checkpoint's bytes."""
    row: dict[str, Any] = {}
    # the checkpoint (master 4 or 2 + bf16 moments 4) and the bf16 model, 2
    need = (8 if args.bf16_masters else 10) * sum(rt.unit.numel for rt in engine.units)
    if shutil.disk_usage(swap_dir).free < 1.1 * need:
        row["checkpoint"] = "skipped: the disk cannot hold a checkpoint beside the swap files"
        return row
    root = tempfile.mkdtemp(prefix="fzero-scale-ckpt-", dir=args.dir)
    try:
        for phase, action in (
            ("save", lambda: engine.save_checkpoint(root)),
            ("resume", lambda: engine.load_checkpoint(root)),
            (
                "consolidate",
                lambda: fzero.checkpoint.consolidate(root, os.path.join(root, "out"), dtype="bf16"),
            ),
        ):
            reset_peak()
            start = time.perf_counter()
            action()
            row[f"{phase}_s"], row[f"{phase}_peak"] = time.perf_counter() - start, peak_rss_mb()
            if phase == "save":
                row["checkpoint_bytes"] = sum(
                    os.path.getsize(os.path.join(d, f))
                    for d, _, files in os.walk(root)
                    for f in files
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return row


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    """The same model and knobs under DeepSpeed's ZeRO-Infinity (CPU accelerator)."""
    import deepspeed

    swap_dir = tempfile.mkdtemp(prefix="ds-scale-", dir=args.dir)
    row: dict[str, Any] = {"baseline": rss_mb()}
    try:
        ds_config = deepspeed_infinity(args.width, swap_dir)
        torch.manual_seed(0)
        reset_peak()
        start = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        row["build_s"], row["build_peak"] = time.perf_counter() - start, peak_rss_mb()
        row["params"] = args.depth * (args.width * args.width + args.width)
        x = torch.randn(4, args.width).bfloat16()
        times = []
        reset_peak()
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            engine.backward(engine(x).float().square().mean())
            engine.step()
            times.append(time.perf_counter() - start)
        row["step_s"], row["peak"] = min(times[1:]), peak_rss_mb()
        row["disk"] = sum(
            os.stat(os.path.join(d, f)).st_blocks * 512
            for d, _, files in os.walk(swap_dir)
            for f in files
        )
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    return row


def attempt(system: str, size: float, args: argparse.Namespace) -> dict[str, Any]:
    """One system at one size in its own process; a failure becomes the row's note."""
    depth = max(1, round(size * 1e9 / (args.width * args.width + args.width)))
    command = [
        sys.executable, __file__, "--one", system, "--depth", str(depth),
        "--width", str(args.width), "--dir", args.dir, "--steps", str(args.steps),
        "--checkpoint-up-to", str(args.checkpoint_up_to),
        *(["--bf16-masters"] if args.bf16_masters else []),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit code {done.returncode}"
        if done.returncode < 0:
            why = f"killed by signal {-done.returncode} (out of memory?)"
        return {"params": depth * (args.width**2 + args.width), "failed": why[:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[str, dict[str, Any]]], bandwidth: float, moved: int = MOVED) -> None:
    print(
        f"{'system':<8} {'params':>7} {'peak RSS MB':>11} {'disk GB':>8} {'B/param':>7} "
        f"{'s/step':>7} {'floor s':>7} {'x floor':>7} {'build s':>7} {'build MB':>8}"
    )
    for system, r in rows:
        params = r["params"]
        if "failed" in r:
            print(f"{system:<8} {params / 1e9:>6.2f}B  failed: {r['failed']}")
            continue
        floor = moved * params / bandwidth
        print(
            f"{system:<8} {params / 1e9:>6.2f}B {r['peak']:>11.0f} {r['disk'] / 1e9:>8.1f} "
            f"{r['disk'] / params:>7.1f} {r['step_s']:>7.1f} {floor:>7.1f} "
            f"{r['step_s'] / floor:>7.2f} {r['build_s']:>7.1f} {r['build_peak']:>8.0f}"
        )
    phases = [(s, r) for s, r in rows if "save_s" in r or "checkpoint" in r]
    if phases:
        print(f"\n{'system':<8} {'params':>7} {'phase':<12} {'seconds':>8} {'peak RSS MB':>11}")
        for system, r in phases:
            if "checkpoint" in r:
                print(f"{system:<8} {r['params'] / 1e9:>6.2f}B {r['checkpoint']}")
                continue
            for phase in ("save", "resume", "consolidate"):
                print(
                    f"{system:<8} {r['params'] / 1e9:>6.2f}B {phase:<12} "
                    f"{r[f'{phase}_s']:>8.1f} {r[f'{phase}_peak']:>11.0f}"
                )
            print(f"{'':<8} {'':>7} checkpoint: {r['checkpoint_bytes'] / 1e9:.1f} GB")


def plot(
    rows: list[tuple[str, dict[str, Any]]], bandwidth: float, path: str, moved: int = MOVED
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, step) = plt.subplots(1, 2, figsize=(10, 4))
    for system in sorted({s for s, _ in rows}):
        done = [r for s, r in rows if s == system and "failed" not in r]
        sizes = [r["params"] / 1e9 for r in done]
        memory.plot(sizes, [r["peak"] / 1024 for r in done], "o-", label=f"{system} peak RSS")
        memory.plot(sizes, [r["disk"] / 1e9 / 10 for r in done], "s--", label=f"{system} disk / 10")
        step.plot(sizes, [r["step_s"] for r in done], "o-", label=f"{system} step")
        if system == "fzero":
            floors = [moved * r["params"] / bandwidth for r in done]
            step.plot(sizes, floors, "k:", label="disk floor")
    memory.set(xlabel="parameters (billions)", ylabel="GB", title="memory and disk", ylim=(0, None))
    step.set(xlabel="parameters (billions)", ylabel="seconds per step", title="step time")
    memory.legend()
    step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0.5,1,2,4", help="billions of parameters")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1, help="timed steps after a warm-up")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--checkpoint-up-to", type=float, default=1.0)
    parser.add_argument("--plot", default="")
    parser.add_argument("--results", default="", help="write the rows here (JSON)")
    parser.add_argument("--replot", default="", help="table and plot from saved results")
    parser.add_argument("--one", choices=["fzero", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--bf16-masters", action="store_true", help="bf16 masters and gradient sums on NVMe"
    )
    args = parser.parse_args()
    if args.one:
        run = run_fzero if args.one == "fzero" else run_deepspeed
        print(json.dumps(run(args)))
        return
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        rows = [(system, row) for system, row in saved["rows"]]
        moved = saved.get("moved", MOVED)
        table(rows, saved["bandwidth"], moved)
        if args.plot:
            plot(rows, saved["bandwidth"], args.plot, moved)
        return
    bandwidth = disk_bandwidth(args.dir)
    free = shutil.disk_usage(args.dir).free
    print(f"disk: {free / 1e9:.0f} GB free, {bandwidth / 1e9:.2f} GB/s (O_DIRECT write + read)")
    moved = MOVED_BF16 if args.bf16_masters else MOVED
    missing = "--bf16-masters: fzero only" if args.bf16_masters else deepspeed_available()
    if missing:
        print(f"(DeepSpeed rows left out: {missing})")
    rows: list[tuple[str, dict[str, Any]]] = []
    ds_bytes_per_param = DEEPSPEED_GUESS  # until a DeepSpeed row measures it
    for size in [float(s) for s in args.sizes.split(",")]:
        rows.append(("fzero", attempt("fzero", size, args)))
        print(json.dumps(rows[-1][1]), file=sys.stderr, flush=True)
        if missing:
            continue
        if ds_bytes_per_param * size * 1e9 > 0.9 * free:
            note = f"not run: {ds_bytes_per_param:.1f} B/param would not fit the disk"
            rows.append(("deepspeed", {"params": size * 1e9, "failed": note}))
            continue
        rows.append(("deepspeed", attempt("deepspeed", size, args)))
        if "disk" in rows[-1][1]:
            ds_bytes_per_param = rows[-1][1]["disk"] / rows[-1][1]["params"]
    print(f"ZeRO-Infinity on this machine: stage 3, bf16, AdamW, 1 rank, width {args.width}")
    table(rows, bandwidth, moved)
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"bandwidth": bandwidth, "moved": moved, "rows": rows}, f)
    if args.plot:
        plot(rows, bandwidth, args.plot, moved)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
