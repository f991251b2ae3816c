"""The `deepspeed.utils` accessors a training script reads between backward and step:
`safe_get_full_grad` (the averaged gradient of the step's micro-batches, on every rank),
then, after the step, `safe_get_full_fp32_param` and `safe_get_full_optimizer_state`.
Two micro-batches per step on every rank; every rank calls the accessors (collective at
stage 3) and rank 0 writes what they returned, per step and parameter, to `--out` as
JSON. Run under DeepSpeed and under `fzero run --as-deepspeed` with the same config."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", type=str, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 7))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    rank, world = engine.global_rank, engine.world_size
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    names = [name for name, _ in model.named_parameters()]
    record = []
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(accum * world * micro, 12, generator=generator)
        y = torch.randn(accum * world * micro, 7, generator=generator)
        for a in range(accum):
            rows = slice((a * world + rank) * micro, (a * world + rank + 1) * micro)
            loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            if a == accum - 1:  # the boundary's gradients, before the step
                grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            engine.step()
        params = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        moments = {
            n: safe_get_full_optimizer_state(p, "exp_avg")
            for n, p in engine.module.named_parameters()
        }
        record.append(
            {
                kind: {n: values[n].float().flatten().tolist() for n in names}
                for kind, values in (("grad", grads), ("param", params), ("exp_avg", moments))
            }
        )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    # Without this a gloo process may abort at interpreter teardown ("terminate called
    # without an active exception", seen under DeepSpeed in CI): torch's advice.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
