"""fzero on a CUDA machine, in one command: kernels against their pure twins, the fused
AdamW kernel against torch's and the HBM floor, GPT-2-small training at every stage and
with CPU optimizer offload against plain PyTorch, and a checkpoint moved GPU -> CPU -> GPU.
Prints a table; exits 1 if any check fails.

    python benchmarks/gpu_check.py              # on a GPU machine (about 5 minutes on one H200)
    python benchmarks/gpu_check.py --smoke      # the same checks, tiny, on the CPU (CI)

Run it from a source checkout with fzero importable (`pip install -e .`, or
PYTHONPATH=. beside an installed torch). fzero needs cffi; on a machine without it and
without network, bring the wheel: on a machine with network,
`pip download cffi --only-binary=:all: --python-version 3.X --platform manylinux2014_x86_64
-d wheels/` (3.X: the GPU machine's Python), copy `wheels/` over, then
`pip install --no-index --find-links wheels/ cffi`. The CUDA kernels need NVRTC
(`libnvrtc`, which CUDA builds of torch install) and the driver; the C kernels need a
compiler at install time, else the CPU rows say why they were skipped.

Targets (issue 14): the fused AdamW kernel at most 1.1x the floor and faster than
`torch.optim.AdamW(fused=True)`; stages 0 and 1 at least 0.95x plain PyTorch's tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import native
from fzero.core.quantize import quantize
from fzero.optim import (
    adam,
    adamw,
    bf16_stochastic,
    lamb,
    lamb_direction_,
    segment_sq_sums,
    sgd,
)

ROWS: list[tuple[str, str, str]] = []  # (check, measured, verdict)
FAILED: list[str] = []


def record(check: str, measured: str, ok: bool | None) -> None:
    verdict = "skip" if ok is None else ("ok" if ok else "FAIL")
    ROWS.append((check, measured, verdict))
    if ok is False:
        FAILED.append(check)
    print(f"{verdict:>4}  {check}: {measured}", flush=True)


def guarded(name: str, fn: Callable[[], None]) -> None:
    """Run one section; an exception is a failed check, and the next section still runs."""
    try:
        fn()
    except Exception as error:  # reported, and the exit code says so
        record(name, f"{type(error).__name__}: {error}"[:300], False)


# ---- kernels against their pure twins ------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # the C kernels' tolerance (tests/test_native.py): about 2 fp32 ulps
    return bool(torch.allclose(a, b, rtol=3e-7, atol=1e-9))


def check_kernels(device: torch.device, sizes: list[int]) -> None:
    if not native.available(device):
        record(f"{device.type} kernels", native.why(device), None)
        return
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        p = torch.randn(n, generator=gen).to(device)
        g = torch.randn(n, generator=gen).to(device)
        ok = []
        for make, decoupled in ((adamw, True), (adam, False)):
            for bias_correction, scale in ((True, 1.0), (False, 0.5)):
                opt = make(lr=1e-3, weight_decay=0.01, bias_correction=bias_correction)
                ref_p, nat_p = p.clone(), p.clone()
                ref, nat = opt.init(p), opt.init(p)
                for step in (1, 2):
                    ref = opt.update_(g * scale, ref, ref_p)
                    native.adam_(
                        nat_p, g, nat.exp_avg, nat.exp_avg_sq, step=step, lr=1e-3,
                        betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=decoupled,
                        bias_correction=bias_correction, grad_scale=scale,
                    )  # fmt: skip
                    ok += [_close(nat_p, ref_p), _close(nat.exp_avg, ref.exp_avg)]
                    ok += [_close(nat.exp_avg_sq, ref.exp_avg_sq)]
                    nat_p.copy_(ref_p), nat.exp_avg.copy_(ref.exp_avg)
                    nat.exp_avg_sq.copy_(ref.exp_avg_sq)
        record(f"{device.type} adam/adamw vs twin, n={n}", f"{sum(ok)}/{len(ok)} close", all(ok))

        copies = []
        for dtype in (torch.bfloat16, torch.float16):
            q = p.clone()
            if n >= 3:
                q[:3] = torch.tensor([70000.0, -1e-8, float("inf")], device=device)
            out = torch.empty(n, dtype=dtype, device=device)
            m, v = torch.zeros_like(q), torch.zeros_like(q)
            native.adam_(q, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=0.0, decoupled=True, out=out)  # fmt: skip
            copies.append(torch.equal(out, q.to(dtype)))
        record(f"{device.type} bf16/fp16 copy-out, n={n}", f"bit-equal {copies}", all(copies))

        ok = []
        for momentum, nesterov in ((0.0, False), (0.9, False), (0.9, True)):
            opt = sgd(lr=0.1, momentum=momentum, weight_decay=1e-2, nesterov=nesterov)
            ref_p, nat_p = p.clone(), p.clone()
            ref, buf = opt.init(p), torch.zeros_like(p)
            for step in range(2):
                ref = opt.update_(g, ref, ref_p)
                native.sgd_(nat_p, g, buf, first=step == 0, lr=0.1, momentum=momentum,
                            dampening=0.0, weight_decay=1e-2, nesterov=nesterov)  # fmt: skip
                ok.append(_close(nat_p, ref_p))
                nat_p.copy_(ref_p)
                if momentum:
                    ok.append(_close(buf, ref.momentum_buffer))
                    buf.copy_(ref.momentum_buffer)
        record(f"{device.type} sgd vs twin, n={n}", f"{sum(ok)}/{len(ok)} close", all(ok))

        if n:
            opt = lamb(lr=1e-2, weight_decay=0.01)
            hp = opt.hparams
            ref, nat = opt.init(p), opt.init(p)
            update = torch.empty_like(p)
            want = lamb_direction_(g, ref, p.clone(), hp)
            # fzero corrects the bias in the step size (FusedLamb's), not the direction
            native.lamb_direction_(p.clone(), g, nat.exp_avg, nat.exp_avg_sq, update, step=1,
                                   betas=hp.betas, eps=hp.eps, weight_decay=0.01,
                                   bias_correction=False)  # fmt: skip
            segments = [(0, n // 3), (n // 3, n)]
            scales = [-1e-2, -2e-2]
            ref_p, nat_p = p.clone(), p.clone()
            for (a, b), s in zip(segments, scales):
                ref_p[a:b].add_(want[a:b], alpha=s)
            native.lamb_apply_(nat_p, want, segments, scales)
            ok = [_close(update, want), _close(nat.exp_avg, ref.exp_avg), _close(nat_p, ref_p)]
            spans = [(0, n), (0, n // 3), (n // 3, n), (n // 2, n // 2)]
            sums = native.segment_sq_sums(p, spans).cpu()
            ok.append(torch.allclose(sums, segment_sq_sums(p.cpu(), spans), rtol=1e-12))
            record(f"{device.type} lamb + segment sums vs twin, n={n}", f"{sum(ok)}/4 close",
                   all(ok))  # fmt: skip

        total, bad = native.sq_sum(g)
        want = g.double().square().sum().item()
        flagged = True
        if n:
            h = g.clone()
            h[n // 2] = float("nan")
            flagged = native.sq_sum(h)[1]
        good = math.isclose(total, want, rel_tol=1e-12, abs_tol=1e-12) and not bad and flagged
        record(f"{device.type} sum of squares + flag, n={n}", f"{total:.6g} vs {want:.6g}", good)

        x = p * 1e3
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        native.bf16_stochastic_(x, out, 7)
        same = torch.equal(
            out.cpu().view(torch.int16), bf16_stochastic(x.cpu(), 7).view(torch.int16)
        )
        record(f"{device.type} bf16 stochastic rounding, n={n}", f"bit-equal {same}", same)

        if n:  # blockwise int8 (qwZ, qgZ): the block-wide max needs a block of threads
            blocks = -(-n // 256)
            codes = torch.empty(blocks * 256, dtype=torch.int8, device=device)
            scales = torch.empty(blocks, device=device)
            native.quantize_int8_(x, codes, scales)
            want_codes, want_scales = quantize(x.cpu())
            same = torch.equal(codes.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)
            record(f"{device.type} int8 quantize, n={n}", f"bit-equal {same}", same)
            packed = torch.empty(blocks * 128, dtype=torch.uint8, device=device)
            native.quantize_int4_(x, packed, scales)  # + pairs packed across threads
            want_codes, want_scales = quantize(x.cpu(), bits=4)
            same = torch.equal(packed.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)
            record(f"{device.type} int4 quantize, n={n}", f"bit-equal {same}", same)


# ---- the fused AdamW kernel against torch's and the floor -----------------------------------


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm up (compiles, allocates)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _copy_bandwidth(device: torch.device, n: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy of n fp32 elements."""
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    return 2 * 4 * n / _timed(lambda: dst.copy_(src), device, repeats)


def time_adamw(device: torch.device, n: int, repeats: int) -> None:
    if not native.available(device):
        record(f"{device.type} AdamW timing", native.why(device), None)
        return
    p, g = torch.randn(n, device=device), torch.randn(n, device=device)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    bandwidth = _copy_bandwidth(device, n, repeats)
    floor = 28 * n / bandwidth  # read p, g, m, v; write p, m, v

    def ours() -> None:
        native.adam_(p, g, m, v, step=3, lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.01, decoupled=True)  # fmt: skip

    fzero_s = _timed(ours, device, repeats)
    param = nn.Parameter(p)
    param.grad = g
    torch_opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    torch_s = _timed(torch_opt.step, device, repeats)
    record(
        f"{device.type} AdamW over {n / 1e6:.0f}M fp32",
        f"fzero {fzero_s * 1e3:.2f} ms = {fzero_s / floor:.2f}x floor ({floor * 1e3:.2f} ms at "
        f"{bandwidth / 1e9:.0f} GB/s copy); torch fused {torch_s * 1e3:.2f} ms",
        fzero_s <= 1.1 * floor and fzero_s < torch_s if device.type == "cuda" else None,
    )


# ---- GPT-2-small training --------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's shape (Radford et al. 2019): learned positions, pre-norm blocks, the
    output layer tied to the token embedding; 124M parameters at 12 x 768, 50257."""

    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's initialisation
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def batches(shape: dict, steps: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    distinct = [
        torch.randint(shape["vocab"], (shape["batch"], shape["context"]), generator=gen)
        for _ in range(4)
    ]  # repeated, so the loss falls
    return [distinct[i % 4].to(device) for i in range(steps)]


def train(shape: dict, device: torch.device, steps: int, stage: int | None, offload: bool):
    """Losses, tokens/s (after 5 warm-up steps), and (allocated, planned) device bytes."""
    gc.collect()  # the previous run's engine (its hooks make cycles)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    torch.manual_seed(0)
    model = GPT(shape["vocab"], shape["context"], shape["width"], shape["depth"], shape["heads"])
    model = model.to(device)
    data = batches(shape, steps, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, memory = [], None
    if stage is None:  # plain PyTorch: fp32 weights, bf16 autocast, fused AdamW
        opt = torch.optim.AdamW(
            model.parameters(), lr=3e-4, weight_decay=0.01, fused=device.type == "cuda"
        )

        def step(tokens: torch.Tensor) -> float:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    else:
        zero: dict = {"stage3_param_persistence_threshold": 0}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine = fzero.shard(
            model,
            stage=stage,
            optimizer=fzero.optim.adamw(lr=3e-4, weight_decay=0.01),
            precision="bf16",
            config={"steps_per_print": 0, "zero_optimization": zero},
        )
        del model

        def step(tokens: torch.Tensor) -> float:
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            return loss.item()

    for i, tokens in enumerate(data):
        if i == 5:
            sync()
            begin = time.perf_counter()
        losses.append(step(tokens))
    sync()
    seconds = time.perf_counter() - begin
    if stage is not None:
        planned = engine.memory_planned()
        allocated = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
        memory = (allocated, planned.device, planned.total)
    tokens_per_s = (steps - 5) * shape["batch"] * shape["context"] / seconds
    return losses, tokens_per_s, memory


def check_training(device: torch.device, shape: dict, steps: int) -> None:
    runs = {"torch": train(shape, device, steps, None, False)}
    for stage in range(4):
        runs[f"stage {stage}"] = train(shape, device, steps, stage, False)
    runs["stage 2 + cpu offload"] = train(shape, device, steps, 2, True)
    base_losses, base_rate, _ = runs["torch"]
    record("plain PyTorch + AdamW", f"{base_rate:,.0f} tokens/s, loss {base_losses[0]:.3f} -> "
           f"{base_losses[-1]:.3f}", base_losses[-1] < base_losses[0])  # fmt: skip
    reference = runs["stage 0"][0]
    for name, (losses, rate, memory) in runs.items():
        if name == "torch":
            continue
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        ratio = rate / base_rate
        text = f"{rate:,.0f} tokens/s = {ratio:.2f}x torch; losses within {worst:.1e} of stage 0"
        ok = worst <= 2e-2 and losses[-1] < losses[0]
        if name in ("stage 0", "stage 1") and device.type == "cuda":
            ok = ok and ratio >= 0.95
        if memory is not None and memory[0] is not None:
            allocated, planned_device, _ = memory
            text += (
                f"; allocated {allocated / 2**20:,.0f} MiB, plan {planned_device / 2**20:,.0f} MiB"
            )
            ok = ok and abs(allocated - planned_device) <= 0.02 * planned_device + 64 * 2**20
        record(f"{device.type} GPT {shape['params']} {name}", text, ok)


# ---- a checkpoint GPU -> CPU -> GPU ------------------------------------------------------------


def _masters(engine) -> dict[str, torch.Tensor]:
    return {f"unit{rt.index}": rt.master.detach().cpu().clone() for rt in engine.units}


def _small_engine(device: torch.device):
    torch.manual_seed(0)
    model = GPT(512, 32, 64, 2, 4).to(device)
    return fzero.shard(
        model, stage=2, optimizer=fzero.optim.adamw(lr=1e-3), precision="bf16",
        config={"steps_per_print": 0},
    )  # fmt: skip


def cpu_side(directory: str) -> None:
    """In a CPU-only child process: load the GPU's checkpoint, check it against the
    masters the parent wrote, train one step, save it back."""
    from safetensors.torch import load_file, save_file

    engine = _small_engine(torch.device("cpu"))
    engine.load_checkpoint(directory, tag="gpu")
    want = load_file(os.path.join(directory, "gpu_masters.safetensors"))
    same = all(torch.equal(want[k], v) for k, v in _masters(engine).items())
    engine.backward(engine(torch.randint(512, (2, 32))))
    engine.step()
    engine.save_checkpoint(directory, tag="cpu")
    save_file(_masters(engine), os.path.join(directory, "cpu_masters.safetensors"))
    print(json.dumps({"same": same}))


def check_checkpoint(device: torch.device) -> None:
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as directory:
        engine = _small_engine(device)
        engine.backward(engine(torch.randint(512, (2, 32), device=device)))
        engine.step()
        engine.save_checkpoint(directory, tag="gpu")
        save_file(_masters(engine), os.path.join(directory, "gpu_masters.safetensors"))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "29531"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
            env.pop(key, None)
        child = subprocess.run(
            [sys.executable, __file__, "--cpu-side", directory],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        if child.returncode != 0:
            record("checkpoint GPU -> CPU", child.stderr[-300:], False)
            return
        on_cpu = json.loads(child.stdout.strip().splitlines()[-1])["same"]
        record(f"checkpoint {device.type} -> CPU", f"masters bit-equal: {on_cpu}", on_cpu)
        back = _small_engine(device)
        back.load_checkpoint(directory, tag="cpu")
        want = load_file(os.path.join(directory, "cpu_masters.safetensors"))
        same = all(torch.equal(want[k], v) for k, v in _masters(back).items())
        record(f"checkpoint CPU -> {device.type}", f"masters bit-equal: {same}", same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--cpu-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_side:
        fzero.comm.init_distributed()
        cpu_side(args.cpu_side)
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke")
    fzero.comm.init_distributed()  # one rank: NCCL with CUDA, gloo without
    print(f"fzero {fzero.__version__} on {torch.cuda.get_device_name(0) if cuda else 'CPU'}, "
          f"torch {torch.__version__}; native: cpu {native.why('cpu')}, "
          f"cuda {native.why('cuda')}")  # fmt: skip
    if args.smoke:
        sizes, timing_n, steps = [0, 1, 17, 65_537], 2**20, 8
        shape = {"vocab": 512, "context": 32, "width": 64, "depth": 2, "heads": 4, "batch": 2}
    else:
        sizes, timing_n, steps = [0, 1, 17, 65_537, 50_000_000], 500_000_000, 30
        shape = {"vocab": 50257, "context": 1024, "width": 768, "depth": 12, "heads": 12,
                 "batch": 8}  # fmt: skip
    shape["params"] = "small" if args.smoke else "124M"
    guarded("CPU kernels", lambda: check_kernels(torch.device("cpu"), sizes[:4]))
    if cuda:
        guarded("CUDA kernels", lambda: check_kernels(device, sizes))
    guarded("AdamW timing", lambda: time_adamw(device, timing_n, 3 if args.smoke else 10))
    guarded("training", lambda: check_training(device, shape, steps))
    guarded("checkpoint", lambda: check_checkpoint(device))
    width = max(len(c) for c, _, _ in ROWS)
    print(f"\n{'check':<{width}}  verdict  measured")
    for check, measured, verdict in ROWS:
        print(f"{check:<{width}}  {verdict:<7}  {measured}")
    print(f"\n{len(ROWS) - len(FAILED)} of {len(ROWS)} checks ok or skipped; failed: {FAILED}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
