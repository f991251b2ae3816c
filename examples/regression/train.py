"""The DeepSpeed tutorial's regression model, ported by changing the import.

Linear 10->50, ReLU, Linear 50->1 on 1,000 random samples, batch 32, the tutorial's
ds_config.json (fp16, ZeRO stage 1, Adam) unchanged.
Run:  fzero run -n 2 examples/regression/train.py
"""

import argparse
from pathlib import Path

import torch
from torch import nn

import fzero as deepspeed  # the only change from the DeepSpeed script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    parser.add_argument("--save_dir", default=None, help="save a checkpoint at the end here")
    args = parser.parse_args()

    torch.manual_seed(42)
    x = torch.randn(1000, 10)
    y = x @ torch.randn(10, 1) + 0.1 * torch.randn(1000, 1)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 1))

    engine, _optimizer, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=args.config
    )
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for inputs, labels in loader:
            outputs = engine(inputs)
            loss = nn.functional.mse_loss(outputs.float(), labels)
            engine.backward(loss)
            engine.step()
            total, batches = total + loss.item(), batches + 1
        if engine.global_rank == 0:
            print(f"epoch {epoch} loss {total / batches:.4f}", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs})
        # a fresh engine on other weights loads it back: the same state, bit for bit
        torch.manual_seed(0)
        fresh = nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 1))
        other, *_ = deepspeed.initialize(
            model=fresh, model_parameters=fresh.parameters(), config=args.config
        )
        _, client = other.load_checkpoint(args.save_dir)
        same = all(
            torch.equal(a, b)
            for a, b in zip(engine.state_dict().values(), other.state_dict().values())
        )
        if engine.global_rank == 0:
            print(f"checkpoint round-trip: epoch {client['epoch']}, identical {same}", flush=True)


if __name__ == "__main__":
    main()
