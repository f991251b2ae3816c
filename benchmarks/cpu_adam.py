"""One AdamW step over a 50M-element fp32 shard: fzero's native kernel against
torch.optim.AdamW (default, foreach, fused), DeepSpeedCPUAdam when it imports, and the
memory floor measured in the same run.

    python benchmarks/cpu_adam.py [--numel 50000000 --threads 2 --steps 10]

The floor is a plain OpenMP C loop over the same four buffers that reads p, g, m, v
and writes p, m, v: the 28 bytes per element any Adam step must move.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fzero import native
from fzero.optim import adamw


def median_times(kernels: list[tuple[str, Callable[[], object]]], rounds: int) -> list[float]:
    """Median seconds of each kernel over `rounds` rounds, every kernel once per round:
    this machine's memory bandwidth drifts (52 to 97 GB/s within minutes), so kernels
    timed one after another would be compared at different bandwidths."""
    for _, step in kernels:
        step()  # warm-up: first touch of pages, thread start
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(rounds):
        for (_, step), acc in zip(kernels, times):
            start = time.perf_counter()
            step()
            acc.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    kernels: list[tuple[str, Callable[[], object]]] = []
    if not native.available():
        raise SystemExit(f"native kernels: {native.why()}")
    kernels.append(
        ("memory floor (C stream, 28 B/elem)", lambda: native.stream_floor_(param, grad, m, v))
    )
    step = [0]

    def fzero_step(out=None, grad_scale=1.0):
        step[0] += 1
        native.adam_(param, grad, m, v, step=step[0], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.01, decoupled=True, grad_scale=grad_scale, out=out)  # fmt: skip

    kernels.append(("fzero native AdamW", fzero_step))
    copy = torch.empty(n, dtype=torch.bfloat16)
    kernels.append(("fzero native AdamW + bf16 copy-out", lambda: fzero_step(copy)))

    def fp16_step():
        # the whole fp16 optimizer step: one pass for overflow flag + norm, one for
        # unscale x clip + update + copy-out
        total, bad = native.sq_sum(grad)
        if not bad:
            fzero_step(copy16, grad_scale=(1 / 1024) * min(1.0, 1.0 / max(total**0.5 / 1024, 1e-6)))

    copy16 = torch.empty(n, dtype=torch.float16)
    kernels.append(("fzero fp16 step (2 passes over grads)", fp16_step))
    state = adamw(lr=1e-4).init(param)
    kernels.append(
        ("fzero torch path (update_)", lambda: adamw(lr=1e-4).update_(grad, state, param))
    )
    p = torch.nn.Parameter(param.clone())
    p.grad = grad.clone()
    for name, kwargs in (
        ("default", {}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ):
        opt = torch.optim.AdamW([p], lr=1e-4, **kwargs)
        kernels.append((f"torch.optim.AdamW {name}", opt.step))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # not installed, or its op fails to build
        print(f"(DeepSpeedCPUAdam unavailable: {type(error).__name__})")
    else:
        ds = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
        kernels.append(("DeepSpeedCPUAdam", ds.step))
    rows = list(zip([name for name, _ in kernels], median_times(kernels, args.steps)))
    floor = rows[0][1]
    print(
        f"AdamW step over {n / 1e6:.0f}M fp32 elements, {args.threads} threads, median of "
        f"{args.steps} interleaved rounds"
    )
    print(f"{'kernel':<40} {'ms':>8} {'x floor':>8} {'GB/s':>7}")
    for name, seconds in rows:
        rate = 28 * n / seconds / 1e9
        print(f"{name:<40} {seconds * 1e3:>8.1f} {seconds / floor:>8.2f} {rate:>7.1f}")


if __name__ == "__main__":
    main()
