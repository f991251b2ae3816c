"""`engine.module_state_dict()` after two steps, with and without frozen parameters and
with a prefix: rank 0 writes each entry's shape and values to `--out` as JSON. The
model has a buffer and a frozen bias. With `--save DIR` the engine also saves a
checkpoint there (for its conversion scripts). Run under DeepSpeed and under
`fzero run --as-deepspeed` with the same config."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True)
    parser.add_argument("--save", type=str, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model[2].bias.requires_grad_(False)
    model.register_buffer("scale", torch.tensor([2.0]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable, config=args.deepspeed_config
    )
    for step in range(2):
        x = torch.randn(
            2, 8, generator=torch.Generator().manual_seed(10 * step + engine.global_rank)
        )
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    record = {}
    for name, kwargs in (("all", {}), ("trained", {"exclude_frozen_parameters": True}),
                         ("prefixed", {"prefix": "m."})):  # fmt: skip
        state = engine.module_state_dict(**kwargs)
        record[name] = {k: [list(v.shape), v.float().flatten().tolist()] for k, v in state.items()}
    if engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    if args.save:
        engine.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
