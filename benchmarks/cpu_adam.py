"""One AdamW step over a 50M-element fp32 shard: fzero's native kernel against
torch.optim.AdamW (default, foreach, fused), DeepSpeedCPUAdam when it imports, and the
memory floor measured in the same run.

    python benchmarks/cpu_adam.py [--numel 50000000 --threads 2 --rounds 10]
                                  [--results FILE]

Every kernel and every bandwidth pattern runs once per round, the rounds interleaved:
this machine's memory bandwidth drifts (52 to 97 GB/s within minutes), so kernels timed
one after another would be compared at different bandwidths. The table shows each
row's median and min-max over the rounds.

The floor of a row is the bytes its operation must move (28 per element for an Adam
step: read p, g, m, v, write p, m, v; more with a copy-out or a second pass) over the
best bandwidth measured in this run: the fastest round of several access patterns over
buffers of the same size (the C stream loop with Adam's own 4-read 3-write pattern,
torch's in-place adds, copy and read-only sums), each credited with only the bytes it
must move. A kernel faster than that is marked "under floor" and the note under the
table says why, instead of printing a ratio below 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

from fzero import native
from fzero.optim import adamw

Call = Callable[[], object]
COLUMNS = (
    ("B/elem", "d"), ("ms", ".1f"), ("min", ".1f"), ("max", ".1f"), ("x floor", ".2f"),
    ("GB/s", ".1f"),
)  # fmt: skip


def patterns(n: int) -> list[tuple[str, int, Call]]:
    """(name, bytes per element it must move, call) of each bandwidth pattern, over its
    own four buffers (so the kernels' optimizer state stays what Adam made it)."""
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)

    def adds() -> None:
        for t in (p, m, v):
            t.add_(g)

    def sums() -> None:
        for t in (p, g, m, v):
            t.sum()

    return [
        ("floor: C stream p,m,v += g", 28, lambda: native.stream_floor_(p, g, m, v)),
        ("floor: torch p,m,v add_(g)", 36, adds),  # three passes: 3 x (read 8, write 4)
        ("floor: torch copy_", 8, lambda: m.copy_(p)),  # the write-allocate read not credited
        ("floor: torch sum x4 (read)", 16, sums),
    ]


def kernels(n: int) -> list[tuple[str, int, Call]]:
    """(name, bytes per element its operation must move, call) of each optimizer step."""
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def fzero_step(out=None, grad_scale=1.0):
        step[0] += 1
        native.adam_(param, grad, m, v, step=step[0], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.01, decoupled=True, grad_scale=grad_scale, out=out)  # fmt: skip

    copy = torch.empty(n, dtype=torch.bfloat16)
    copy16 = torch.empty(n, dtype=torch.float16)

    def fp16_step():
        # the whole fp16 optimizer step: one pass for overflow flag + norm, one for
        # unscale x clip + update + copy-out
        total, bad = native.sq_sum(grad)
        if not bad:
            fzero_step(copy16, grad_scale=(1 / 1024) * min(1.0, 1.0 / max(total**0.5 / 1024, 1e-6)))

    state = adamw(lr=1e-4).init(param)
    rows: list[tuple[str, int, Call]] = [
        ("fzero native AdamW", 28, fzero_step),
        ("fzero native AdamW + bf16 copy-out", 30, lambda: fzero_step(copy)),  # + 2 written
        ("fzero fp16 step (2 passes over grads)", 34, fp16_step),  # + 4 read, 2 written
        ("fzero torch path (update_)", 28, lambda: adamw(lr=1e-4).update_(grad, state, param)),
    ]
    p = torch.nn.Parameter(param.clone())
    p.grad = grad.clone()
    for name, kwargs in (
        ("default", {}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ):
        rows.append(
            (f"torch.optim.AdamW {name}", 28, torch.optim.AdamW([p], lr=1e-4, **kwargs).step)
        )
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # not installed, or its op fails to build
        print(f"(DeepSpeedCPUAdam unavailable: {type(error).__name__})")
    else:
        rows.append(("DeepSpeedCPUAdam", 28, DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True).step))
    return rows


def table(
    args: argparse.Namespace, rows: list[tuple[str, int, Call]], times: dict[str, list[float]]
) -> _harness.Table:
    n = args.numel
    best_name, best = max(
        ((name, size * n / min(times[name])) for name, size, _ in rows if name.startswith("floor")),
        key=lambda pair: pair[1],
    )
    lines, notes = [], []
    for name, size, _ in rows:
        seconds = _harness.spread(times[name])
        rate = size * n / seconds.median / 1e9
        ratio: float | None = seconds.median / (size * n / best)
        label = name
        if ratio < 1:
            # no pattern reached the bandwidth this kernel did, so the measured floor is
            # above what the machine can do: a ratio below 1 would read as beating a limit
            ratio, label = None, f"{name} (under floor)"
            notes.append(
                f"under floor: {name} moved {rate:.1f} GB/s at its median, above the best "
                f"pattern's {best / 1e9:.1f} GB/s: no pattern reached this machine's peak "
                f"in this run (its bandwidth drifts between rounds), so that floor bounds "
                f"nothing for it"
            )
        cells = (size, seconds.median * 1e3, seconds.low * 1e3, seconds.high * 1e3, ratio, rate)
        lines.append((label, cells))
    return _harness.Table(
        title=(
            f"AdamW step over {n / 1e6:.0f}M fp32 elements, {args.threads} threads, "
            f"{args.rounds} interleaved rounds"
        ),
        name_header="kernel",
        columns=COLUMNS,
        rows=tuple(lines),
        notes=(
            f"(floor: a row's B/elem over {best / 1e9:.1f} GB/s, the fastest round of "
            f"{best_name[len('floor: ') :]!r}, the best of the floor patterns)",
            *notes,
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", "--steps", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--results", default=None, help="also append the table to this file")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"native kernels: {native.why()}")
    torch.set_num_threads(args.threads)
    rows = patterns(args.numel) + kernels(args.numel)
    times = _harness.interleave([(name, call) for name, _, call in rows], args.rounds)
    _harness.report("cpu_adam", table(args, rows, times), args.results)


if __name__ == "__main__":
    main()
