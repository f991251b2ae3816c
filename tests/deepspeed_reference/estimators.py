"""DeepSpeed's memory estimators and `see_memory_usage`, run the same under DeepSpeed and
under fzero (`--fzero`: `import deepspeed` served by fzero).

One process, no process group. The ZeRO-3 and ZeRO-2 `_all_live` estimators over a small
model with a tied head and a second parameter over the embedding's storage (counted once)
and the `_all_cold` ones over given sizes (ints and floats), for several GPUs per node,
nodes and buffer factors: the text each prints and what it returns; the per-option
estimates (`repr`, so an int and a float differ); `model_to_params`. Then what
`see_memory_usage` prints without `force` and with it, its figures masked (they are this
process's). Prints one JSON line.
"""

import argparse
import contextlib
import io
import json
import re

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fzero", action="store_true")
args = parser.parse_args()
if args.fzero:
    from fzero import compat

    compat.install()
from deepspeed.runtime.utils import see_memory_usage  # noqa: E402
from deepspeed.runtime.zero import stage3, stage_1_and_2  # noqa: E402

HARDWARE = [(1, 1), (2, 1), (8, 1), (4, 2), (3, 3), (16, 4)]  # (GPUs per node, nodes)
SIZES = [(7_000_000_000, 300_000_000), (1.3e9, 5e7), (125_000, 125_000), (0, 0)]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.body = nn.Sequential(nn.Linear(64, 3000), nn.GELU(), nn.Linear(3000, 64))
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter
        # another Parameter over the embedding's storage, and one over a later row of it
        self.alias = nn.Parameter(self.embed.weight.detach())
        self.row = nn.Parameter(self.embed.weight.detach()[1])


def printed(fn, *args, **kwargs) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        returned = fn(*args, **kwargs)
    return {"printed": out.getvalue(), "returned": repr(returned)}


torch.manual_seed(0)
models = {"tied": Tied(), "linear": nn.Linear(1000, 1000)}
result: dict = {"model_to_params": {}, "live": {}, "cold": {}, "options": {}}
for name, model in models.items():
    result["model_to_params"][name] = [
        repr(stage3.model_to_params(model)),
        repr(stage_1_and_2.model_to_params(model)),
    ]
    for gpus, nodes in HARDWARE:
        key = f"{name} {gpus}x{nodes}"
        result["live"][key] = [
            printed(stage3.estimate_zero3_model_states_mem_needs_all_live, model, gpus, nodes),
            printed(
                stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, model, gpus, nodes
            ),
        ]
    result["live"][f"{name} defaults"] = [
        printed(stage3.estimate_zero3_model_states_mem_needs_all_live, model),
        printed(stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, model),
    ]
for total, largest in SIZES:
    for gpus, nodes in HARDWARE:
        for factor in (1.5, 1.0, 2.25):
            key = f"{total} {largest} {gpus}x{nodes} {factor}"
            result["cold"][key] = [
                printed(
                    stage3.estimate_zero3_model_states_mem_needs_all_cold,
                    total, largest, num_gpus_per_node=gpus, num_nodes=nodes,
                    additional_buffer_factor=factor,
                ),
                printed(
                    stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold,
                    total, gpus, nodes, additional_buffer_factor=factor,
                ),
            ]  # fmt: skip
            options = []
            for offload, offload_params, zero_init in (
                (o, p, z) for o in (True, False) for p in (True, False) for z in (True, False)
            ):
                options.append(
                    repr(stage3.estimate_zero3_model_states_mem_needs(
                        total, largest, gpus, nodes, cpu_offload=offload,
                        cpu_offload_params=offload_params, zero_init=zero_init,
                        additional_buffer_factor=factor,
                    ))
                )  # fmt: skip
                options.append(
                    repr(stage_1_and_2.estimate_zero2_model_states_mem_needs(
                        total, gpus, nodes, cpu_offload=offload, additional_buffer_factor=factor
                    ))
                )  # fmt: skip
            result["options"][key] = options
result["cold defaults"] = [
    printed(stage3.estimate_zero3_model_states_mem_needs_all_cold, 2_000_000, 1_000_000),
    printed(stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold, 2_000_000),
    repr(stage3.estimate_zero3_model_states_mem_needs(2_000_000, 1_000_000)),
    repr(stage_1_and_2.estimate_zero2_model_states_mem_needs(2_000_000)),
]
unforced = printed(see_memory_usage, "before the model")
forced = printed(see_memory_usage, "after the model", force=True)
result["see_memory_usage"] = {
    "unforced": unforced,
    "forced": re.sub(r"\d+(\.\d+)?", "N", forced["printed"]),
    "returned": forced["returned"],
}
print("RESULT " + json.dumps(result))
