"""Main job: a small character-level transformer LM trained with ZeRO-3 on 2 CPU processes.

    fzero run -n 2 examples/train_transformer.py

Data is the text of Python's own help topics (`pydoc_data.topics`, in the stdlib), so
nothing is downloaded. Prints the loss as it falls, each rank's model-state memory
against the plan's estimate, and throughput.
"""

from __future__ import annotations

import argparse
import time
from pydoc_data.topics import topics

import torch
from torch import nn

import fzero


class TinyLM(nn.Module):
    """Pre-norm transformer with the output projection tied to the embedding."""

    def __init__(self, vocab: int, width: int = 128, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        h = self.embed(tokens) + self.position(torch.arange(length))
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batches(text: torch.Tensor, *, micro: int, length: int, rank: int, world: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(text) - length - 1, (micro * world,), generator=gen)
        mine = starts[rank * micro : (rank + 1) * micro]
        rows = torch.stack([text[s : s + length + 1] for s in mine.tolist()])
        yield rows[:, :-1], rows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()

    corpus = "".join(topics[k] for k in sorted(topics))
    vocab = sorted(set(corpus))
    text = torch.tensor([vocab.index(c) for c in corpus[:200_000]])
    torch.manual_seed(0)
    model = TinyLM(len(vocab))
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "zero_optimization": {"stage3_param_persistence_threshold": 1000},
    }
    engine = fzero.shard(
        model, stage=args.stage, optimizer=fzero.optim.adamw(lr=3e-3), config=config
    )
    engine.telemetry.expect_steps(args.steps)  # the progress bar's total
    rank, world = engine.global_rank, engine.world_size
    data = batches(text, micro=args.micro, length=args.length, rank=rank, world=world, seed=1)
    first = last = None
    start = time.perf_counter()
    for _ in range(args.steps):
        tokens, targets = next(data)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        engine.backward(loss)
        engine.step()
        first = loss.item() if first is None else first
        last = loss.item()
    elapsed = time.perf_counter() - start
    held, planned = engine.memory_held(), engine.memory_planned()
    for r in range(world):
        if r == rank:
            print(
                f"rank {rank}: model-state memory held {held.total / 1e6:.2f} MB, "
                f"plan estimate {planned.total / 1e6:.2f} MB "
                f"(params {held.params / 1e6:.2f}/{planned.params / 1e6:.2f}, "
                f"grads {held.grads / 1e6:.2f}/{planned.grads / 1e6:.2f}, "
                f"optimizer {held.optimizer_state / 1e6:.2f}/{planned.optimizer_state / 1e6:.2f})",
                flush=True,
            )
        torch.distributed.barrier()
    if rank == 0:
        tokens_per_s = args.steps * args.micro * world * args.length / elapsed
        print(
            f"ZeRO-{args.stage} on {world} ranks: {engine.plan.manifest.numel:,} "
            f"params; rank 0's batch loss {first:.3f} at step 1 -> {last:.3f} at step "
            f"{args.steps}; over all {args.steps} steps (the first included): "
            f"{tokens_per_s:,.0f} tokens/s, {elapsed / args.steps:.3f} s/step (MB = 10^6 bytes)"
        )


if __name__ == "__main__":
    main()
