"""bf16 with gradient accumulation and a PyTorch-style `loss.backward()` (DeepSpeed >= 0.17)
instead of `model_engine.backward(loss)`; `--engine-backward` runs the classic call."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--engine-backward", action="store_true")
    parser.add_argument("--out", required=True)
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    engine, _, _, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(4 * accumulation * world, 6, generator=gen),
            torch.randn(4 * accumulation * world, 3, generator=gen),
        )
        for i in range(accumulation):
            rows = slice((i * world + rank) * 4, (i * world + rank + 1) * 4)
            loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            if args.engine_backward:
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
        losses.append(loss.item())
    state = {k: v.float().tolist() for k, v in engine.state_dict().items()}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "state": state, "lr": scheduler.get_last_lr()}, f)


if __name__ == "__main__":
    main()
