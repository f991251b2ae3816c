"""Masked-LM pre-training in the shape of DeepSpeed's BERT scripts: `deepspeed.zero.Init`,
ZeRO-3 with CPU optimizer offload, `save_checkpoint`/`load_checkpoint` with client state,
resumed in a second run with `--resume` (random token data)."""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn

VOCAB, HIDDEN, SEQ, MASK = 23, 12, 6, 0


class TinyMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN))
            for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def batch(step, rank, micro):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, VOCAB, (2 * micro, SEQ), generator=gen)
    mask = torch.rand(tokens.shape, generator=gen) < 0.3
    labels = torch.where(mask, tokens, torch.full_like(tokens, -100))
    inputs = torch.where(mask, torch.full_like(tokens, MASK), tokens)
    rows = slice(rank * micro, (rank + 1) * micro)
    return inputs[rows], labels[rows]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--output_dir", required=True)
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = TinyMLM()
    model_engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    start = 0
    if args.resume:
        _, client = model_engine.load_checkpoint(args.output_dir)
        start = client["next_step"]
    rank, micro = deepspeed.comm.get_rank(), model_engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(start, args.steps):
        tokens, labels = batch(step, rank, micro)
        loss = model_engine(tokens, labels)
        model_engine.backward(loss)
        model_engine.step()
        total = loss.detach().clone()
        deepspeed.comm.all_reduce(total)
        losses.append(total.item() / deepspeed.comm.get_world_size())
        if step + 1 == args.save_at:
            model_engine.save_checkpoint(args.output_dir, client_state={"next_step": step + 1})
    state = {k: v.tolist() for k, v in model_engine.state_dict().items()}
    name = "resumed.json" if args.resume else "run.json"
    if rank == 0:
        with open(os.path.join(args.output_dir, name), "w") as f:
            json.dump({"losses": losses, "state": state}, f)


if __name__ == "__main__":
    main()
