"""Stage 3 specifics (gathering ahead, bounded live parameters, reuse distance), models
built on the meta device, and gathered_parameters. (Models partitioned at construction,
`fzero.init_context`: tests/test_construction.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fzero
from fzero import comm
from tests._dist import run_world
from tests.models import Awkward, Net, param_groups

WIDTH, DEPTH, MICRO = 16, 6, 4


def _chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)])


def _chain_engine(model: nn.Module, **zero: object) -> fzero.Engine:
    """Stage 3 with AdamW, every tensor sharded, and `zero` in `zero_optimization`."""
    config = {"zero_optimization": {"stage3_param_persistence_threshold": 0, **zero}}
    return fzero.shard(model, stage=3, optimizer=fzero.optim.adamw(lr=1e-2), config=config)


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(
        MICRO, WIDTH, generator=gen
    ).requires_grad_()  # every block has an input grad


def gather_trace_case(rank, world, reuse_distance):
    model = _chain()
    engine = _chain_engine(
        model,
        stage3_prefetch_bucket_size=1,  # one unit ahead
        stage3_max_reuse_distance=reuse_distance,
    )
    gathers: list[str] = []
    live: list[int] = []
    ahead: list[bool] = []
    all_gather_into = comm.all_gather_into

    def spy(output, shard, *, async_op=False, what="", group=None):
        gathers.append(engine.gatherer.phase)
        return all_gather_into(output, shard, async_op=async_op, what=what, group=group)

    def watch(index):
        def pre_forward(_module, _inputs):
            live.append(engine.gatherer.live_numel)
            if index + 1 < DEPTH:
                ahead.append(engine.gatherer.units[index + 1].full is not None)

        def pre_backward(_module, _grads):
            live.append(engine.gatherer.live_numel)

        return pre_forward, pre_backward

    for index, block in enumerate(model):
        pre_forward, pre_backward = watch(index)
        block.register_forward_pre_hook(pre_forward)
        block.register_full_backward_pre_hook(pre_backward)
    comm.all_gather_into = spy
    try:
        losses, per_step = [], []
        for step in range(3):
            gathers.clear()
            ahead.clear()
            loss = engine(_batch(step, rank)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            per_step.append((list(gathers), list(ahead)))
    finally:
        comm.all_gather_into = all_gather_into
    return {
        "losses": losses,
        "per_step": per_step,
        "max_live": max(live),
        "unit_numel": engine.units[0].unit.numel,
        "held": engine.memory_held().params,
        "planned": engine.memory_planned().params,
    }


def test_stage3_gathers_one_unit_ahead_and_releases_after_use():
    result = run_world(gather_trace_case, 2, 0)
    first, *later = result["per_step"]
    assert first[0].count("forward") == DEPTH  # first pass: every unit, no prefetch yet
    assert not any(first[1])
    for gathers, ahead in later:
        # every unit gathered once in forward; backward gathers all but the last one used
        # in forward (kept: it is needed first)
        assert gathers.count("forward") == DEPTH
        assert gathers.count("backward") == DEPTH - 1
        assert all(ahead)  # the next unit was in flight before its forward began
    # live parameters: the unit in use, one prefetched, at most one kept -- never the model
    assert result["max_live"] <= 3 * result["unit_numel"]
    assert result["held"] == result["planned"]  # between steps only shards are held


def test_stage3_reuse_distance_keeps_units_for_backward_with_same_results():
    strict = run_world(gather_trace_case, 2, 0)
    keep = run_world(gather_trace_case, 2, 10**9)
    for gathers, _ in keep["per_step"][1:]:
        assert gathers.count("backward") == 0  # all kept from forward into backward
    assert keep["max_live"] == DEPTH * keep["unit_numel"]
    assert keep["losses"] == strict["losses"]  # bitwise: the same numbers, gathered once
    assert keep["held"] == keep["planned"]


MODELS = {"Net": Net, "Awkward": Awkward}


def meta_case(rank, world, stage, name):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MODELS[name]()
    assert all(p.is_meta for p in model.parameters())
    engine = fzero.shard(
        model,
        stage=stage,
        param_groups=param_groups(model) if name == "Net" else None,
        config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if name == "Awkward":
        assert model.head.weight is model.embed.weight  # still tied
    return engine.state_dict(dtype=torch.float32)


@pytest.mark.parametrize(
    ("stage", "name"), [(1, "Net"), (3, "Net"), pytest.param(3, "Awkward", marks=pytest.mark.slow)]
)
def test_meta_model_gets_the_eager_weights_at_every_world_size(stage, name):
    torch.manual_seed(0)
    eager = MODELS[name]().state_dict()  # constructors use the RNG in module order, as fzero
    for world in (1, 2, 4):
        state = run_world(meta_case, world, stage, name)
        assert state.keys() == eager.keys()
        for key, value in eager.items():
            assert torch.equal(state[key], value), (world, key)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_meta_module_without_reset_parameters_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(ValueError, match=r"'1\.scale' is on the meta device.*NoReset"):
        fzero.shard(model, stage=3)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    engine = fzero.shard(model, stage=3, param_init_fn=_fill_halves)
    assert torch.equal(engine.state_dict()["1.scale"], torch.full((3,), 0.5))


def _fill_halves(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        p.fill_(0.5)


def gathered_case(rank, world, stage):
    torch.manual_seed(0)
    model = Net()
    engine = fzero.shard(
        model,
        stage=stage,
        precision="fp32",
        config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    weight = model.head.weight
    with fzero.gathered_parameters([weight, model.head.bias]):
        seen = weight.detach().clone()
    released = weight.numel()
    with fzero.gathered_parameters(weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                weight.mul_(0).add_(0.25)
    state = engine.state_dict(dtype=torch.float32)
    x = torch.randn(MICRO, 7, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())  # training goes on from the edited weights
    engine.step()
    return seen, released, state


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_gathered_parameters_reads_whole_and_broadcasts_edits(stage):
    torch.manual_seed(0)
    expected = Net().head.weight.detach()
    seen, released, state = run_world(gathered_case, 2, stage)
    assert torch.equal(seen, expected)
    assert released == (0 if stage == 3 else expected.numel())  # stage 3 releases after
    assert torch.equal(state["head.weight"], torch.full_like(expected, 0.25))


def submodule_alone_case(rank, world):
    """After a step, a submodule run on its own (as `generate` runs an encoder) gathers
    its units and releases them again, under no_grad and with grad."""
    model = _chain()
    config = {
        "zero_optimization": {
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        }
    }
    engine = fzero.shard(model, stage=3, optimizer=fzero.optim.adamw(lr=1e-2), config=config)
    engine.backward(engine(_batch(0, rank)).square().mean())
    engine.step()
    live = []
    with torch.no_grad():
        out = model[2](_batch(1, rank))
    live.append(engine.gatherer.live_numel)
    model[3](out).sum().backward()
    live.append(engine.gatherer.live_numel)
    return live


def test_a_submodule_run_alone_after_a_step_releases_its_units():
    assert run_world(submodule_alone_case, 2) == [0, 0]


def backward_holdings_case(rank, world, overlap):
    """What a stage-3 backward holds after each gradient is taken: bucket buffers (filling,
    in flight, kept for reuse), gathered units, `param.grad`s; and the losses."""
    model = _chain()
    engine = _chain_engine(
        model,
        reduce_bucket_size=1,  # a bucket per unit
        stage3_max_reuse_distance=0,
        overlap_comm=overlap,
    )
    unit_of = {id(p): rt.index for rt in engine.units for p, _, _ in rt.params}
    taken: dict[int, int] = {}
    held: list[int] = []
    problems: list[str] = []

    def after_engine(p):  # registered after the engine's hook: runs after it
        index = unit_of[id(p)]
        taken[index] = taken.get(index, 0) + 1
        held.append(engine.reduction.held_numel())
        if p.grad is not None:
            problems.append(f"unit {index} keeps a full-size gradient in param.grad")
        last = taken[index] == len(engine.units[index].params)
        if last and engine.gatherer.units[index].full is not None:
            problems.append(f"unit {index} is still gathered after its last gradient")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(after_engine)
    losses = []
    for step in range(2):
        taken.clear()
        loss = engine(_batch(step, rank)).square().mean()
        engine.backward(loss)
        assert engine.reduction.held_numel() == 0  # nothing after backward
        engine.step()
        losses.append(loss.item())
    return {
        "held": max(held),
        "unit_numel": max(rt.unit.numel for rt in engine.units),
        "problems": problems,
        "losses": losses,
    }


@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_backward_holds_two_buckets_with_overlap_one_without(overlap):
    """[regression] Every reduced bucket's buffer stayed alive (in flight) until backward
    ended: a model's worth of full-size gradients. Now, with overlap_comm, the bucket
    being filled beside the last one launched (its reduction runs on beside backward:
    waiting for it serialised backward with every reduction); without, one bucket at a
    time. No reduced unit keeps a gradient or stays gathered; the same losses."""
    result = run_world(backward_holdings_case, 2, overlap)
    assert result["problems"] == []
    assert result["held"] == (2 if overlap else 1) * result["unit_numel"]
    if overlap:
        assert result["losses"] == run_world(backward_holdings_case, 2, False)["losses"]
