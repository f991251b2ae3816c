"""Greedy decoding with a ZeRO-3 sharded model: per-token latency against the unsharded
model, and against DeepSpeed ZeRO-3 on the same model, in the same run.

    python benchmarks/generate.py [--tokens 16 --rounds 2]
    FZERO_DEEPSPEED_PYTHON=<a python with deepspeed> python benchmarks/generate.py

Model: GPT-2 small's shape (`GPT2Config()`, 124M parameters, fp32) built from its config
with seed 0; a 16-token prompt per rank; `generate(max_new_tokens=N, min_new_tokens=N,
do_sample=False, synced_gpus=True)` under `torch.no_grad()`. A row's per-token latency is
(time of N new tokens - time of 1) / (N - 1): the decode steps, without the prompt's
forward. Every rank is one thread (2 ranks on this 2-core machine; the unsharded row is
one process, one thread). Rows: the unsharded model; fzero ZeRO-3 at world 2 releasing
each unit after use (the default, as in training); fzero with
`stage3_eval_live_parameters` above the model's size (units stay gathered across
tokens: each is gathered once per `generate`); with the bound at half the model (the
units past it are released and gathered again each token, prefetched along the trace
the first forward recorded); DeepSpeed ZeRO-3 at world 2 when
`FZERO_DEEPSPEED_PYTHON` names a python where it imports. Each row runs in its own
processes, the rows interleaved over `--rounds`; the table shows the median over rounds
with the min-max, and whether the tokens equal the unsharded model's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

ROWS = {
    "unsharded": "unsharded model, 1 process",
    "release": "fzero ZeRO-3, world 2, release after use",
    "keep": "fzero ZeRO-3, world 2, eval_live_parameters 2e8",
    "half": "fzero ZeRO-3, world 2, eval_live_parameters 6.2e7 (half)",
    "deepspeed": "DeepSpeed ZeRO-3, world 2",
}


def model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config()).eval()


def prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(rank))


def decode_time(net: Any, rank: int, tokens: int, synced: bool) -> tuple[float, list[int]]:
    """Seconds per decoded token (see the module docstring) and the tokens."""

    def run(count: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        with torch.no_grad():
            out = net.generate(
                prompt(rank),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                synced_gpus=synced,
                pad_token_id=0,
            )
        return time.perf_counter() - start, out

    run(2)  # warm-up (the first forward records stage 3's trace)
    one, _ = run(1)
    many, out = run(tokens)
    return (many - one) / (tokens - 1), out[0].tolist()


def run_row(name: str, tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    if name == "unsharded":
        seconds, out = decode_time(model(), 0, tokens, synced=False)
        return {"seconds": seconds, "tokens": out}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if name == "keep":
        zero["stage3_eval_live_parameters"] = 200_000_000
    if name == "half":  # half the model stays gathered; the rest is prefetched per token
        zero["stage3_eval_live_parameters"] = 62_000_000
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    if name == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model(), config=config)
    else:
        import fzero

        engine = fzero.shard(model(), stage=3, config=config)
    rank = torch.distributed.get_rank()
    seconds, out = decode_time(engine.module, rank, tokens, synced=True)
    times = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(times, torch.tensor([seconds]))
    return {"seconds": max(t.item() for t in times), "tokens": out, "rank": rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--results", help="append the table to this file")
    args = parser.parse_args()
    if args.row:
        result = run_row(args.row, args.tokens)
        if _harness.launched_rank() in (None, 0):
            _harness.write_row(args.json, result)
        return
    names = ["unsharded", "release", "keep", "half"]
    deepspeed_python = os.environ.get("FZERO_DEEPSPEED_PYTHON")
    if deepspeed_python:
        names.append("deepspeed")
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))

    def command(name: str, out: str) -> list[str]:
        argv = [here, "--row", name, "--json", out, "--tokens", str(args.tokens)]
        if name == "unsharded":
            return [sys.executable, *argv]
        python = deepspeed_python if name == "deepspeed" else sys.executable
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    results = _harness.run_rows(names, command, args.rounds)
    base = [r["seconds"] for r in results["unsharded"]]
    reference = results["unsharded"][0]["tokens"]
    rows = []
    for name in names:
        seconds = [r["seconds"] for r in results[name]]
        s = _harness.spread(seconds)
        same = "yes" if results[name][0]["tokens"] == reference else "no"
        ratio = statistics.median(a / b for a, b in zip(seconds, base))
        rows.append((ROWS[name], (1e3 * s.median, 1e3 * s.low, 1e3 * s.high, ratio, same)))
    table = _harness.Table(
        title=(
            f"greedy decoding, GPT-2 small shape (124M, fp32), {args.tokens} new tokens, "
            f"{args.rounds} interleaved rounds; tokens compared on rank 0's prompt"
        ),
        name_header="row",
        columns=(
            ("ms/token", ".1f"),
            ("min", ".1f"),
            ("max", ".1f"),
            ("x unsharded", ".2f"),
            ("same tokens", ""),
        ),
        rows=tuple(rows),
    )
    _harness.report("generate", table, args.results)


if __name__ == "__main__":
    main()
