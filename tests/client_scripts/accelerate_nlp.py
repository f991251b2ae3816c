"""An Accelerate training script in the shape of Accelerate's `nlp_example`: its own
torch optimizer and scheduler (`get_linear_schedule_with_warmup`), `prepare`,
`accelerator.backward`, `save_state`/`load_state`. `--zero_stage N` turns on
`DeepSpeedPlugin(zero_stage=N)`; 0 runs Accelerate's plain DDP. Tiny model, data made
here. Writes the final weights (safetensors) and each step's lr and loss (JSON).

Run it as one process: Accelerate's DeepSpeed path takes its process count from an
accelerator backend, and on a machine without one (no CUDA) it counts one process
whatever the launcher started, so a 2-process run computes a train_batch_size for one
(and `Accelerator(cpu=True)` turns DeepSpeed off). The gradients are clipped at 1.0 in
both runs: Accelerate's DeepSpeed config does that by default."""

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch import nn
from transformers import get_linear_schedule_with_warmup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_state_at", type=int, default=0)
    parser.add_argument("--resume_from", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plugin = (
        DeepSpeedPlugin(zero_stage=args.zero_stage, zero3_save_16bit_model=True)
        if args.zero_stage
        else None
    )
    accelerator = Accelerator(deepspeed_plugin=plugin)
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    start = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start = args.save_state_at
    record = []
    batches = iter(loader)
    for step in range(args.steps):
        inputs, labels = next(batches)
        if step < start:
            continue
        lr = optimizer.param_groups[0]["lr"]
        loss = nn.functional.cross_entropy(model(inputs).float(), labels)
        accelerator.backward(loss)
        if plugin is None:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record.append({"step": step, "lr": lr, "loss": loss.item()})
        if step + 1 == args.save_state_at and not args.resume_from:
            accelerator.save_state(args.out + "-state")
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file(
            {k: v.float().contiguous() for k, v in weights.items()}, args.out + ".safetensors"
        )
        with open(args.out + ".json", "w") as f:
            json.dump(record, f)
    accelerator.end_training()  # destroys the process group: a clean exit


if __name__ == "__main__":
    main()
