"""DeepSpeed's scheduler, checkpoint and clipping contract as a script sees it, run the
same under DeepSpeed and under fzero (`--fzero`: `import deepspeed` served by fzero).

One process, a tiny model, AdamW from the config (DeepSpeed's own kernel or fzero's)
and a client torch AdamW with a torch scheduler; ZeRO stage from `--stage`. Prints one
JSON line: `initialize`'s scheduler, each step's lr and loss, resumes with and without
`load_lr_scheduler_states`, a scheduler detached by the client (Lightning's way), the
argument winning over the config block, and the first weights after training.
"""

import argparse
import json
import tempfile

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fzero", action="store_true")
parser.add_argument("--stage", type=int, default=2)
args = parser.parse_args()
if args.fzero:
    from fzero import compat

    compat.install()
import deepspeed  # noqa: E402

LOSSES: list[float] = []


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)


def train(engine, steps: int, start: int = 0) -> list[float]:
    lrs = []
    for step in range(start, start + steps):
        x, y = batch(step)
        lrs.append(engine.get_lr()[0])
        loss = nn.functional.mse_loss(engine(x), y)
        LOSSES.append(loss.item())
        engine.backward(loss)
        engine.step()
    return lrs


def weights(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().float().flatten() for p in module.parameters()]).tolist()


def initialize(config: dict, **kwargs):
    m = model()
    if "optimizer" not in kwargs:
        kwargs["model_parameters"] = m.parameters()
    return deepspeed.initialize(model=m, config=config, **kwargs)


base = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    "zero_optimization": {"stage": args.stage},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
}
warmup = {
    "type": "WarmupLR",
    "params": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.01,
        "warmup_num_steps": 4,
        "warmup_type": "linear",
    },
}
out: dict = {}
*_, scheduler = initialize(dict(base))
out["no_scheduler_returns"] = repr(scheduler)
engine, *_ = initialize({**base, "scheduler": warmup})
out["config_lrs"] = train(engine, 6)
out["config_weights"] = weights(engine.module)
out["clipping"] = engine.gradient_clipping()
log_warmup = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}
engine, *_ = initialize({**base, "scheduler": log_warmup})  # DeepSpeed's default: "log"
out["log_warmup_lrs"] = train(engine, 6)
with tempfile.TemporaryDirectory() as directory:
    engine, *_ = initialize({**base, "scheduler": warmup})
    train(engine, 3)
    engine.save_checkpoint(directory, tag="t3")
    for flag in (True, False):
        engine, *_ = initialize({**base, "scheduler": warmup})
        engine.load_checkpoint(directory, tag="t3", load_lr_scheduler_states=flag)
        out[f"resume_lrs_{flag}"] = train(engine, 3, start=3)
engine, *_ = initialize({**base, "scheduler": warmup})
detached, engine.lr_scheduler = engine.lr_scheduler, None
lrs = []
for step in range(4):
    lrs += train(engine, 1, start=step)
    detached.step()
out["detached_lrs"] = lrs
m = model()
opt = torch.optim.AdamW(m.parameters(), lr=0.01)
halving = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
client = {k: v for k, v in base.items() if k != "optimizer"}
engine, _, _, scheduler = deepspeed.initialize(
    model=m, optimizer=opt, lr_scheduler=halving, config={**client, "scheduler": warmup}
)
out["argument_wins"] = scheduler is halving
out["client_lrs"] = train(engine, 4)
out["client_weights"] = weights(engine.module)
out["losses"] = LOSSES
print("RESULT " + json.dumps(out), flush=True)
# Without this a gloo process may abort at interpreter teardown ("terminate called
# without an active exception", seen under DeepSpeed in CI): torch's advice.
torch.distributed.destroy_process_group()
