"""A transformer LM trained the way DeepSpeed's bf16 master-weight example trains one:
`--deepspeed_config` names a JSON file (`bf16_master_weights_and_grads`,
`bf16_optimizer_states`, `torch_autocast`), `deepspeed.initialize(model=...,
model_parameters=..., config=path)`, the forward under `torch.autocast` when the JSON
enables it, a PyTorch-style `loss.backward()`, `model_engine.step()`, a per-step loss CSV
and a closing `SUMMARY:` line. Data: a token sequence with a learnable pattern."""

import argparse
import json
import time

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, length):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(length, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden_dim", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=97)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_length", type=int, default=32)
    parser.add_argument("--num_steps", type=int, default=30)
    parser.add_argument("--deepspeed_config", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--loss_log_file", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    device = get_accelerator().device_name(max(args.local_rank, 0))
    torch.manual_seed(args.seed)
    model = LM(args.vocab_size, args.hidden_dim, args.num_layers, args.num_heads, args.seq_length)
    with open(args.deepspeed_config) as f:
        autocast = json.load(f).get("torch_autocast", {})
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    engine.train()
    criterion = nn.CrossEntropyLoss()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    losses, times = [], []
    for step in range(args.num_steps):
        gen = torch.Generator().manual_seed(step * world + rank)
        starts = torch.randint(0, args.vocab_size, (args.batch_size, 1), generator=gen)
        ids = (starts + 3 * torch.arange(args.seq_length + 1)) % args.vocab_size
        inputs, labels = ids[:, :-1].to(device), ids[:, 1:].to(device)
        start = time.time()
        if autocast.get("enabled", False):
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                logits = engine(inputs)
        else:
            logits = engine(inputs)
        loss = criterion(logits.float().view(-1, args.vocab_size), labels.reshape(-1))
        loss.backward()
        engine.step()
        times.append(time.time() - start)
        losses.append(loss.item())
    if rank == 0 and args.loss_log_file:
        with open(args.loss_log_file, "w") as f:
            f.write("step,loss\n")
            f.writelines(f"{i},{value}\n" for i, value in enumerate(losses))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"SUMMARY: config={args.deepspeed_config} params={params} "
        f"avg_step_time={sum(times) / len(times):.4f}",
        flush=True,
    )
    engine.destroy()
    # Without this a gloo process may abort at interpreter teardown ("terminate called
    # without an active exception", seen under DeepSpeed in CI): torch's advice.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
