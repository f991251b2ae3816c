"""DeepSpeed's scheduler classes built by a script over its own optimizer run the same
under DeepSpeed and under fzero (`--fzero`: `import deepspeed` served by fzero).

One process. Each class over a two-group torch Adam, with per-group values where it
takes them, stepped past its end: the lrs written after each step, `get_lr()` and
`state_dict()`, the betas OneCycle cycles. Then a WarmupLR and a OneCycle cycling
momentum built over the client optimizer and handed to `initialize(lr_scheduler=...)`
at stages 0 and 2, the script setting a group's weight decay at the fourth step: the
lrs and the weights after five steps. Prints one JSON line.
"""

import argparse
import json

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fzero", action="store_true")
args = parser.parse_args()
if args.fzero:
    from fzero import compat

    compat.install()
import deepspeed  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")


def two_groups() -> torch.optim.Optimizer:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    return torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}])


CASES = {
    "WarmupLR default": lambda o: lr_schedules.WarmupLR(o, warmup_num_steps=4),
    "WarmupLR lists": lambda o: lr_schedules.WarmupLR(
        o, warmup_min_lr=[0.01, 0.0], warmup_max_lr=[0.5, 0.05], warmup_num_steps=3,
        warmup_type="linear"),
    "WarmupDecayLR": lambda o: lr_schedules.WarmupDecayLR(o, 8, warmup_num_steps=3),
    "WarmupCosineLR": lambda o: lr_schedules.WarmupCosineLR(
        o, 6, warmup_min_ratio=0.1, warmup_num_steps=2, cos_min_ratio=0.01),
    "OneCycle momentum": lambda o: lr_schedules.OneCycle(
        o, 0.01, 0.1, cycle_first_step_size=3, cycle_min_mom=[0.85, 0.8],
        decay_step_size=2, decay_mom_rate=0.1),
    "OneCycle stairs": lambda o: lr_schedules.OneCycle(
        o, [0.01, 0.001], [0.1, 0.01], cycle_first_step_size=4, cycle_first_stair_count=2,
        decay_step_size=2, decay_lr_rate=0.5, cycle_momentum=False),
    "LRRangeTest": lambda o: lr_schedules.LRRangeTest(
        o, lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=3,
        lr_range_test_staircase=True),
}  # fmt: skip
out: dict = {}
for name, build in CASES.items():
    optimizer = two_groups()
    scheduler = build(optimizer)
    lrs = [[g["lr"] for g in optimizer.param_groups]]
    betas = [[list(g["betas"]) for g in optimizer.param_groups]]
    for _ in range(12):
        scheduler.step()
        lrs.append(list(scheduler.get_last_lr()))
        betas.append([list(g["betas"]) for g in optimizer.param_groups])
    out[name] = {"lrs": lrs, "betas": betas, "get_lr": scheduler.get_lr(),
                 "state": scheduler.state_dict()}  # fmt: skip
errors = {}
for name, build in {
    "steps 0": lambda o: lr_schedules.WarmupLR(o, warmup_num_steps=0),
    "list length": lambda o: lr_schedules.WarmupLR(o, warmup_max_lr=[1.0]),
    "not an optimizer": lambda o: lr_schedules.WarmupLR(object()),
}.items():
    try:
        build(two_groups())
        errors[name] = "accepted"
    except (ValueError, TypeError) as error:
        errors[name] = type(error).__name__
out["errors"] = errors

HANDED = {
    "WarmupLR": lambda o: lr_schedules.WarmupLR(o, warmup_num_steps=3, warmup_type="linear"),
    "OneCycle momentum": lambda o: lr_schedules.OneCycle(o, 0.01, 0.05, cycle_first_step_size=2),
}
for name, build in HANDED.items():
    for stage in (0, 2):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        scheduler = build(optimizer)
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                  "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}  # fmt: skip
        engine, _, _, handed = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        lrs = []
        for step in range(5):
            if step == 3:  # a script's own schedule of another hyper-parameter
                engine.optimizer.param_groups[0]["weight_decay"] = 0.5
            engine.backward(engine(torch.randn(2, 3)).pow(2).sum())
            engine.step()
            lrs.append(handed.get_last_lr()[0])
        weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        out[f"handed to initialize: {name}, stage {stage}"] = {
            "same object": handed is scheduler,
            "lrs": lrs,
            "weights": weights.tolist(),
        }
print("RESULT " + json.dumps(out), flush=True)
torch.distributed.destroy_process_group()
