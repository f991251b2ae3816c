"""What fzero's collective watch costs a training step: per collective, and per step.

    python benchmarks/watch_overhead.py [--calls 3000] [--steps 20] [--rounds 5]
                                        [--stages 1,3] [--results FILE]

The whole-step comparison (`step_time.py`'s "unwatched" rows) swings by more than the 1%
it is asked to show on a shared 2-core machine, so this benchmark takes the watch apart:

1. **Per collective**: `--calls` all-reduces of one float through `fzero.comm`, ten to a
   named operation as in a step (`backward`, `step`), timed back to back: under the
   watch as it runs by default ("watched"), without the order check ("unchecked",
   `FZERO_CHECK_COLLECTIVES=0`), and with waits neither sliced nor reported as well
   ("unwatched", `FZERO_WATCH_S=0 FZERO_REPORT_S=0`), beside raw
   `torch.distributed.all_reduce` in the same processes (the floor). A one-float
   collective is latency-bound: the watch's fixed cost is the largest share it can be.
   And the watch's own code alone: the same, on collectives that are done at once (a
   no-op through the watch), which no wait on gloo or the scheduler blurs.
2. **Per step**: the engine at each of `--stages` on `step_time.py`'s model (8.4M params,
   2 ranks), its median step and the collectives and agreements one step issues (the
   watch's own counters, `Watch.issued` / `Watch.agreed`).

The step overhead is then (watched - unwatched µs per collective) x collectives per step,
plus any agreement a step takes, over the unwatched step's time. Each row runs in its own
two processes, the rows interleaved over `--rounds` rounds (medians, min-max spread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness
from step_time import make_model

import fzero
from fzero import comm

WATCH_ROWS = {
    "watched": {},
    "unchecked": {"FZERO_CHECK_COLLECTIVES": "0"},
    "unwatched": {"FZERO_CHECK_COLLECTIVES": "0", "FZERO_WATCH_S": "0", "FZERO_REPORT_S": "0"},
}


def _per_call_us(call, calls: int) -> tuple[float, float]:
    """Median over 5 batches of µs per call, wall and this process's CPU (the CPU time
    is what the watch's own code adds, free of the other rank's scheduling), after a
    warm-up batch."""
    batch = max(calls // 5, 1)
    for _ in range(batch):
        call()
    wall, cpu = [], []
    for _ in range(5):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(batch):
            call()
        wall.append((time.perf_counter() - start) / batch * 1e6)
        cpu.append((time.process_time() - start_cpu) / batch * 1e6)
    return statistics.median(wall), statistics.median(cpu)


class _Done:
    """A collective's work that has completed (what `_no_op` starts)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _no_op(async_op: bool) -> _Done | None:
    """A collective that moves nothing and is done at once: issued through the watch, it
    times the watch's own code alone."""
    return _Done() if async_op else None


def run_row(args: argparse.Namespace) -> None:
    """One watch setting in this launch's two processes: rank 0 writes µs per collective
    (fzero's and raw torch's) and, per stage, the step time and collectives per step."""
    os.environ.update(WATCH_ROWS[args.row])
    comm.init_distributed()
    one = torch.ones(1)

    def fzero_ten() -> None:  # as in a step: inside a named operation
        with comm.named_operation("benchmark"):
            for _ in range(10):
                comm.all_reduce(one)

    def raw_ten() -> None:
        for _ in range(10):
            dist.all_reduce(one)

    def null_ten() -> None:  # the watch's own code: collectives that are already done
        with comm.named_operation("benchmark, no-op collectives"):
            for _ in range(10):
                comm._issue("all_reduce", one, "", False, _no_op)

    def bare_ten() -> None:  # the same no-ops started directly: the floor
        for _ in range(10):
            _no_op(False)

    null_us = _per_call_us(null_ten, args.calls // 10)[0] / 10
    bare_us = _per_call_us(bare_ten, args.calls // 10)[0] / 10
    fzero_us, fzero_cpu_us = (t / 10 for t in _per_call_us(fzero_ten, args.calls // 10))
    raw_us, raw_cpu_us = (t / 10 for t in _per_call_us(raw_ten, args.calls // 10))
    out = {
        "null_us": null_us,
        "bare_us": bare_us,
        "fzero_us": fzero_us,
        "fzero_cpu_us": fzero_cpu_us,
        "raw_us": raw_us,
    }
    out["raw_cpu_us"] = raw_cpu_us
    watch = comm._group_watch()
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(dist.get_rank()))
    for stage in args.stages:
        engine = fzero.shard(
            make_model(1024, 8),
            stage=stage,
            optimizer=fzero.optim.adamw(lr=1e-3),
            config={
                "steps_per_print": 0,
                "zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 2**20},
            },
        )

        def step(engine=engine) -> None:
            engine.backward(engine(x).square().mean())
            engine.step()

        times = _harness.time_steps(step, 3)  # warm-up steps, and the first step's agreements
        issued, agreed = watch.issued, watch.agreed
        times = _harness.time_steps(step, args.steps, warmup=0, sync=dist.barrier)
        # the barriers the timing adds are fzero-free (raw torch), so issued counts the step's own
        out[f"stage{stage}"] = {
            "seconds": statistics.median(times),
            "issued": (watch.issued - issued) / args.steps,
            "agreed": (watch.agreed - agreed) / args.steps,
        }
        engine.destroy()
    if dist.get_rank() == 0:
        _harness.write_row(args.json, out)
    dist.barrier()
    dist.destroy_process_group()


def table(args: argparse.Namespace, results: dict[str, list[dict]]) -> _harness.Table:
    def med(row: str, *path: str) -> _harness.Spread:
        values = []
        for value in results[row]:
            for key in path:
                value = value[key]
            values.append(value)
        return _harness.spread(values)

    rows = []
    for row in results:
        per = med(row, "null_us")
        rows.append((f"{row}: no-op collective, µs", tuple(per)))
    bare = _harness.spread([r["bare_us"] for rounds in results.values() for r in rounds])
    rows.append(("no-op started directly, µs (all rows)", tuple(bare)))
    for key, what in (("us", "wall"), ("cpu_us", "CPU")):
        for row in results:
            per = med(row, f"fzero_{key}")
            rows.append((f"{row}: one-float all_reduce, {what} µs", tuple(per)))
        raw = _harness.spread([r[f"raw_{key}"] for rounds in results.values() for r in rounds])
        rows.append((f"raw torch all_reduce, {what} µs (all rows)", tuple(raw)))
    null_us, wall_us, cpu_us = (
        med("watched", key).median - med("unwatched", key).median
        for key in ("null_us", "fzero_us", "fzero_cpu_us")
    )
    for stage in args.stages:
        key = f"stage{stage}"
        for row in results:
            step = med(row, key, "seconds")
            rows.append((f"stage {stage} {row}: s/step", tuple(step)))
        issued = statistics.median(r[key]["issued"] for r in results["watched"])
        agreed = statistics.median(r[key]["agreed"] for r in results["watched"])
        step = med("unwatched", key, "seconds").median
        rows.append((f"stage {stage}: collectives per step", (issued, None, None)))
        rows.append((f"stage {stage}: agreements per step", (agreed, None, None)))
        for delta, what in ((null_us, "no-op"), (wall_us, "wall"), (cpu_us, "CPU")):
            share = delta * 1e-6 * issued / step * 100
            name = f"stage {stage}: watch cost from {what} µs, % of step"
            rows.append((name, (share, None, None)))
        whole = (med("watched", "null_us").median - bare.median) * 1e-6 * issued / step * 100
        name = f"stage {stage}: fzero.comm's whole own code (watched no-op - direct), % of step"
        rows.append((name, (whole, None, None)))
    return _harness.Table(
        title=(
            f"collective watch overhead, 2 ranks (gloo), {args.calls} one-float all-reduces "
            f"per row, {args.steps} steps per stage, {args.rounds} interleaved rounds"
        ),
        name_header="measure",
        columns=(("median", ".4g"), ("min", ".4g"), ("max", ".4g")),
        rows=tuple(rows),
        notes=(
            "watch cost = (watched - unwatched µs per collective) x collectives per step, "
            "over the unwatched step's median; no-op: the watch's own code, timed on "
            "collectives that are done at once (free of gloo's and the scheduler's noise)",
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--results", default=None, help="also append the table to this file")
    parser.add_argument("--row", choices=list(WATCH_ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",") if s.strip()]
    if args.row:
        run_row(args)
        return
    shape = ["--calls", str(args.calls), "--steps", str(args.steps)]
    shape += ["--stages", ",".join(map(str, args.stages))]
    results = _harness.run_rows(
        list(WATCH_ROWS),
        lambda name, out: _harness.torchrun(2, __file__, *shape, "--row", name, "--json", out),
        args.rounds,
    )
    _harness.report("watch_overhead", table(args, results), args.results)


if __name__ == "__main__":
    main()
