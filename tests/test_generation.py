"""Stage 3 under forwards without gradients (generation, evaluation): with
`stage3_eval_live_parameters` set, units stay gathered from one forward to the next, so
decoding gathers each unit once instead of once per token; the tokens and logits are the
unsharded model's, and a step (or a checkpoint load) releases the stale copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fzero
from fzero import comm
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO = 2


def _gathers() -> int:
    return comm.traffic().get("all_gather", (0, 0))[0]


def keep_case(rank: int, world: int, eval_live: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_eval_live_parameters": eval_live,
        },
    }
    torch.manual_seed(0)
    engine = fzero.shard(Net(), stage=3, config=config)
    x, y = global_batch(0, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    out: dict = {"gathers": []}
    engine.eval()
    for _ in range(2):  # two evaluations before training, three forwards each
        with torch.no_grad():
            start = _gathers()
            outputs = [engine(x[rows]) for _ in range(3)]
            out["gathers"].append(_gathers() - start)
    out["before"] = outputs[-1]
    engine.train()
    engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
    engine.step()
    engine.eval()
    with torch.no_grad():
        start = _gathers()
        out["after"] = engine(x[rows])
        out["gathers"].append(_gathers() - start)
    weights = engine.state_dict(dtype=torch.float32)  # collective: every rank calls it
    if rank == 0:
        reference = Net()
        reference.load_state_dict(weights)
        with torch.no_grad():
            out["reference_after"] = reference(x[rows])
    out["units"] = len(engine.units)
    out["unit_numel"] = sum(rt.unit.numel for rt in engine.units)
    out["planned_kept"] = engine.memory_planned().params_kept
    engine.destroy()
    return out


def test_eval_forwards_keep_units_gathered_within_the_bound_and_a_step_refreshes_them():
    kept = run_world(keep_case, 2, 1_000_000_000)
    units = kept["units"]
    # the first evaluation gathers each unit once, the second none; after a step, again
    assert kept["gathers"] == [units, 0, units]
    torch.testing.assert_close(kept["after"], kept["reference_after"], rtol=0, atol=0)
    released = run_world(keep_case, 2, 0)
    assert released["gathers"] == [3 * units, 3 * units, units]  # the default: per forward
    # the memory estimate counts the bound where it is paid: the gathered units, fp32
    assert kept["planned_kept"] == 4 * kept["unit_numel"] and released["planned_kept"] == 0
    assert torch.equal(released["before"], kept["before"])
    assert torch.equal(released["after"], kept["after"])


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def generate_case(rank: int, world: int, eval_live: int) -> dict:
    """Transformers' `generate(synced_gpus=True)` on a stage-3 engine: ranks decode
    different prompts (and stop at different lengths) in lockstep."""
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_eval_live_parameters": eval_live,
        },
    }
    engine = fzero.shard(_gpt2(), stage=3, config=config)
    prompt = torch.tensor([[5 + rank, 17, 33 + rank]])
    start = _gathers()
    with torch.no_grad():
        tokens = engine.module.generate(
            prompt, max_new_tokens=12 + 4 * rank, do_sample=False, synced_gpus=True, pad_token_id=0
        )
    gathers = _gathers() - start
    reference = _gpt2().generate(
        prompt, max_new_tokens=12 + 4 * rank, do_sample=False, pad_token_id=0
    )
    engine.destroy()
    return {"same": torch.equal(tokens, reference), "gathers": gathers, "units": len(engine.units)}


def test_transformers_generate_at_zero3_gathers_each_unit_once_and_decodes_the_same_tokens():
    kept = run_world(generate_case, 2, 1_000_000_000)
    assert kept["same"]
    assert 0 < kept["gathers"] <= kept["units"]  # not once per token
    released = run_world(generate_case, 2, 0)
    assert released["same"]
    assert released["gathers"] > 10 * kept["units"]


def eval_door_case(rank: int, world: int, keep: int) -> dict:
    """`fzero.eval_step` at stage 3: calls on one state reuse the kept units; a state a
    step returned is gathered afresh, and its outputs are the consolidated model's."""
    torch.manual_seed(0)
    model = Net()
    plan = fzero.partition.plan(
        fzero.partition.describe(model), world_size=world, stage=3, persistence_threshold=0
    )
    optimizer = fzero.optim.adamw(lr=1e-2)
    config = {"zero_optimization": {"stage3_eval_live_parameters": keep}}
    state = fzero.init(model, plan, optimizer, config=config)

    def forward(params, x):
        return torch.func.functional_call(model, params, (x,))

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(forward(params, x), y)

    evaluate = fzero.eval_step(forward, plan, config=config)
    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    x, y = global_batch(0, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    counts, outputs = [], []
    for _ in range(3):
        start = _gathers()
        outputs.append(evaluate(state, x[rows]))
        counts.append(_gathers() - start)
    state, _ = step(state, (x[rows], y[rows]))
    start = _gathers()
    after = evaluate(state, x[rows])
    counts.append(_gathers() - start)
    weights = fzero.state_dict(state)
    reference = None
    if rank == 0:
        fresh = Net()
        fresh.load_state_dict(weights)
        with torch.no_grad():
            reference = fresh(x[rows])
    return {
        "counts": counts,
        "units": len(plan.units),
        "same": outputs[0].equal(outputs[2]),
        "after": after,
        "reference": reference,
    }


def test_eval_step_keeps_units_between_calls_on_one_state():
    kept = run_world(eval_door_case, 2, 1_000_000_000)
    units = kept["units"]
    assert kept["counts"] == [units, 0, 0, units] and kept["same"]
    assert torch.equal(kept["after"], kept["reference"])
    released = run_world(eval_door_case, 2, 0)
    assert released["counts"] == [units] * 4
    assert torch.equal(released["after"], kept["after"])
