"""A GPT-shaped language model trained as a DeepSpeed user would, with the config's
monitors, communication logger and FLOPs profiler on: runs the same under DeepSpeed
(`torchrun ... gpt_monitored.py --deepspeed_config ds.json`) and under fzero
(`fzero run --as-deepspeed -n 2 gpt_monitored.py --deepspeed_config ds.json`). It logs
events of its own both ways DeepSpeed's monitor tutorial shows: a `MonitorMaster` of
`DeepSpeedConfig(path).monitor_config`, and the engine's `engine.monitor`. Prints
`deepspeed.comm.log_summary()` at the end and writes rank 0's losses to `--out`."""

from __future__ import annotations

import argparse
import json
import math
import os

import deepspeed
import torch
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.runtime.config import DeepSpeedConfig
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, HEADS, DEPTH, CONTEXT = 96, 64, 4, 2, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln_1(h)).split(WIDTH, dim=2)
        q, k, v = (x.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for x in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, WIDTH))
        return h + self.out(F.gelu(self.fc(self.ln_2(h))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (micro, 1), generator=gen)
    rows = (start + torch.arange(CONTEXT + 1)) % VOCAB  # a pattern the model can learn
    return rows[:, :-1], rows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    rank = engine.global_rank
    micro = engine.train_micro_batch_size_per_gpu()
    ds_config = DeepSpeedConfig(args.deepspeed_config)  # the monitor tutorial's way
    monitor = MonitorMaster(ds_config.monitor_config)
    losses = []
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, targets = batch(step, rank, micro)
            logits = engine(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        monitor.write_events([("Custom/last_loss", losses[-1], engine.global_samples)])
        batch_size = ds_config.train_batch_size
        engine.monitor.write_events([("Custom/batch_size", batch_size, engine.global_samples)])
    deepspeed.comm.log_summary()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "samples": engine.global_samples}, f)
    # Without this a gloo process may abort at interpreter teardown ("terminate called
    # without an active exception", seen under DeepSpeed in CI): torch's advice.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
