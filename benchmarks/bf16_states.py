"""What bf16 optimizer states cost in accuracy: loss curves side by side.

    python benchmarks/bf16_states.py [--steps 600] [--dir DIR] [--plot bf16_states.png]

Model: a 3-layer MLP (64 -> 512 -> 512 -> 10, 300K parameters) regressing a fixed random
teacher network's outputs (mean squared error) from fresh batches of 256 synthetic
inputs, AdamW (lr 1e-3, betas 0.9/0.999, weight decay 0.01), fp32 compute, one process:
a loss that keeps falling over orders of magnitude, where small updates matter. Columns:

- fp32 states: `torch.optim.AdamW` (the reference);
- bf16, nearest: the same update with Adam's moments rounded to nearest bf16 after every
  step (what a plain `.to(torch.bfloat16)` store would do);
- bf16, stochastic: rounded stochastically (`fzero.optim.bf16_stochastic`) instead;
- fzero engine: `bf16.bf16_optimizer_states` with `offload_optimizer: nvme`
  (`commit: in_place`), the real path: moments rest in bf16 in the swap file.

The loss of each is the mean over the 50 steps before the row's step (the batches are
the same for every column), and the last row is the held-out loss on 4096 inputs.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

import fzero
from fzero.optim import bf16_stochastic

WIDTH, CLASSES, BATCH = 512, 10, 256


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
        nn.Linear(WIDTH, CLASSES),
    )  # fmt: skip


def teacher_labels(x: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(64, 128, generator=gen) / 8
    w2 = torch.randn(128, CLASSES, generator=gen) / 11
    return torch.tanh(x @ w1) @ w2


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(step))
    return x, teacher_labels(x)


def held_out(net: nn.Module) -> float:
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(10**6))
    with torch.no_grad():
        return nn.functional.mse_loss(net(x), teacher_labels(x)).item()


def torch_run(steps: int, rounding: str) -> tuple[list[float], float]:
    """torch.optim.AdamW, with the moments rounded after each step as `rounding` says."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rounding == "fp32":
            continue
        for i, state in enumerate(opt.state.values()):
            for k, name in enumerate(("exp_avg", "exp_avg_sq")):
                moment = state[name]
                if rounding == "nearest":
                    moment.copy_(moment.to(torch.bfloat16))
                else:
                    moment.copy_(bf16_stochastic(moment, seed=(step * 64 + i) * 2 + k))
    return losses, held_out(net)


def engine_run(steps: int, directory: str) -> tuple[list[float], float]:
    net = model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "steps_per_print": 0,
        "bf16": {"bf16_optimizer_states": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": directory, "commit": "in_place"},
        },
    }
    optimizer = fzero.optim.adamw(lr=1e-3, weight_decay=0.01)
    engine = fzero.shard(net, optimizer=optimizer, config=config)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.module.eval()
    return losses, held_out(engine.module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    runs = {
        "fp32 states": torch_run(args.steps, "fp32"),
        "bf16, nearest": torch_run(args.steps, "nearest"),
        "bf16, stochastic": torch_run(args.steps, "stochastic"),
        "fzero engine": engine_run(args.steps, args.dir),
    }
    print(f"AdamW, 300K-parameter MLP, {args.steps} steps; training loss (mean of 50 steps)")
    print(f"{'step':>6}" + "".join(f"{name:>18}" for name in runs))
    every = max(50, args.steps // 10 // 50 * 50)
    for end in range(every, args.steps + 1, every):
        means = [sum(losses[end - 50 : end]) / 50 for losses, _ in runs.values()]
        print(f"{end:>6}" + "".join(f"{m:>18.3e}" for m in means))
    print(f"{'held':>6}" + "".join(f"{final:>18.3e}" for _, final in runs.values()))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        for name, (losses, _) in runs.items():
            smooth = [sum(losses[max(0, i - 49) : i + 1]) / len(losses[max(0, i - 49) : i + 1])
                      for i in range(len(losses))]  # fmt: skip
            axis.plot(smooth, label=name)
        axis.set(xlabel="step", ylabel="training loss (50-step mean)", yscale="log")
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
