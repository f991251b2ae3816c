"""Ranks that take different paths (issue: ranks that disagree never hang). Parameters
one rank leaves unused get zero contributions from it, as DDP with
`find_unused_parameters` (below). A stage-3 module one rank skips is named on every
rank before any collective pairs wrong (the last tests)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from tests._dist import run_world


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 4, generator=gen)


def unused_case(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine = fzero.shard(Branches(), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    x, y = _data()
    rows = slice(rank * 2, rank * 2 + 2)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x[rows], rank == 0), y[rows]))  # rank 1: no b
        engine.step()
    return engine.state_dict(dtype=torch.float32)


def reference() -> dict:
    """One process: the mean of the two ranks' losses, each over its own path."""
    torch.manual_seed(0)
    model = Branches()
    x, y = _data()
    for _ in range(2):
        model.zero_grad()
        loss = F.mse_loss(model(x[:2], True), y[:2]) + F.mse_loss(model(x[2:], False), y[2:])
        (loss / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_one_rank_leaves_unused_get_zero_contributions(stage):
    got = run_world(unused_case, 2, stage)
    for name, value in reference().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


# ---- a rank that raises: the others end within seconds, naming it ---------------------------


class Boom(RuntimeError):
    pass


def _raises_on_rank_1(rank: int, where: str) -> None:
    if rank == 1:
        raise Boom(f"bad batch on rank 1 ({where})")


def _run_and_time(rank: int, action) -> dict:
    import time

    start = time.monotonic()
    try:
        action()
        return {"rank": rank, "error": "no error", "seconds": time.monotonic() - start}
    except Exception as error:  # every rank reports what it got
        return {
            "rank": rank,
            "type": type(error).__name__,
            "error": str(error),
            "seconds": time.monotonic() - start,
        }


def _both(rank: int, result: dict, directory: str) -> dict:
    """Rank 1 leaves its result in a file; rank 0 returns both."""
    import json
    import pathlib
    import time

    path = pathlib.Path(directory) / f"rank{rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.rename(path)  # whole when it appears: rank 0 may read it at once
    if rank != 0:
        return result
    other = pathlib.Path(directory) / "rank1.json"
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"0": result, "1": json.loads(other.read_text()) if other.exists() else None}


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                _raises_on_rank_1(rank, "inside layers.1's forward")
        return x


def engine_raise_case(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = fzero.shard(Deep(), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    x = torch.randn(2, 16)

    def train() -> None:
        engine.backward(engine(x, rank).square().mean())
        engine.step()

    return _both(rank, _run_and_time(rank, train), directory)


def train_step_raise_case(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Deep()
    plan = fzero.partition.plan(
        fzero.partition.describe(model), world_size=world, stage=3, persistence_threshold=0
    )
    state = fzero.init(model, plan, optimizer=fzero.optim.sgd(lr=0.1))

    def loss_fn(params: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x, rank)).square().mean()

    step = fzero.train_step(loss_fn, plan=plan, optimizer=fzero.optim.sgd(lr=0.1))
    return _both(rank, _run_and_time(rank, lambda: step(state, torch.randn(2, 16))), directory)


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int) -> torch.Tensor:
        ctx.rank = rank
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _raises_on_rank_1(ctx.rank, "in backward")
        return grad, None


def backward_raise_case(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    engine = fzero.shard(model, optimizer=fzero.optim.sgd(lr=0.1), config=config)
    x = torch.randn(2, 16)

    def train() -> None:
        loss = _FailsInBackward.apply(engine(x), rank).square().mean()
        engine.backward(loss)
        engine.step()

    return _both(rank, _run_and_time(rank, train), directory)


@pytest.mark.parametrize("case", [engine_raise_case, train_step_raise_case, backward_raise_case])
def test_a_rank_that_raises_is_named_on_the_others_within_seconds(case, tmp_path):
    got = run_world(case, 2, str(tmp_path))
    raiser, waiter = got["1"], got["0"]
    assert raiser["type"] == "Boom"
    assert waiter["type"] == "RankDisagreement", waiter
    assert "rank 1 raised in" in waiter["error"] and "Boom: bad batch on rank 1" in waiter["error"]
    assert "rank 0 was waiting in " in waiter["error"]
    assert waiter["seconds"] < 20, waiter  # the collective timeout here is 120 s


# ---- uneven inputs: engine.join() -------------------------------------------------------------

BATCHES = {0: 4, 1: 1}  # rank -> micro-batches it has


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(2, 6, generator=gen), torch.randn(2, 4, generator=gen))
        for _ in range(BATCHES[rank])
    ]


def join_case(rank: int, world: int, stage: int, accumulation: int) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = fzero.shard(model, optimizer=fzero.optim.sgd(lr=0.1), config=config)
    batches = _batches(rank)
    replay = (lambda: F.mse_loss(engine(batches[-1][0]), batches[-1][1])) if stage == 3 else None
    with engine.join(replay=replay):
        for x, y in batches:
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    return {"steps": engine.global_steps, "state": engine.state_dict(dtype=torch.float32)}


def join_reference(world: int, accumulation: int) -> dict:
    """One process: each window's gradient is the sum of every micro-batch any rank had in
    it, over world x accumulation (a rank out of data adds zeros)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    data = {r: _batches(r) for r in range(world)}
    micro = max(len(d) for d in data.values())
    for start in range(0, micro, accumulation):
        model.zero_grad()
        for i in range(start, min(start + accumulation, micro)):
            for r in range(world):
                if i < len(data[r]):
                    x, y = data[r][i]
                    (F.mse_loss(model(x), y) / (world * accumulation)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return model.state_dict()


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_join_serves_a_rank_with_more_batches_and_equals_the_reference(stage, accumulation):
    """Stage 3: the rank out of data runs its last batch again, weighted 0 (`replay`)."""
    got = run_world(join_case, 2, stage, accumulation)
    assert got["steps"] == max(BATCHES.values()) // accumulation
    for name, value in join_reference(2, accumulation).items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-6, atol=1e-6)


def join_stage3_case(rank: int, world: int) -> str:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine = fzero.shard(nn.Linear(6, 4), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    try:
        with engine.join():
            pass
    except NotImplementedError as error:
        return str(error)
    return "no error"


def test_join_at_stage_3_without_replay_is_refused_by_name():
    assert "engine.join() at ZeRO stage 3 needs replay=" in run_world(join_stage3_case, 2)


def train_step_join_case(rank: int, world: int, stage: int, accumulation: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation}
    plan = fzero.partition.plan(fzero.partition.describe(model), world_size=world, stage=stage)
    optimizer = fzero.optim.sgd(lr=0.1)
    state = fzero.init(model, plan, optimizer=optimizer, config=config)

    def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, plan=plan, optimizer=optimizer, config=config, join=True)
    for batch in _batches(rank):
        state, _ = step(state, batch)
    state = step.join(state)
    return {"steps": state.step, "state": fzero.state_dict(state, module=model)}


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 2), (3, 1), (3, 2)])
def test_train_step_join_equals_the_reference(stage, accumulation):
    """Stage 3: `step.join` runs `loss_fn` on the rank's last batch again, weighted 0."""
    got = run_world(train_step_join_case, 2, stage, accumulation)
    assert got["steps"] == max(BATCHES.values()) // accumulation
    for name, value in join_reference(2, accumulation).items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-6, atol=1e-6)


# ---- a stage-3 module one rank skips: named on every rank before anything pairs wrong --------
#
# Every collective inside a named operation is checked against the one the rank issued
# there last time (`fzero._order_check.Track`); where one differs the ranks agree through the
# store first. `history`: steps every rank runs alike before rank 1 takes another path
# (0: the first step, where every collective is agreed; 3: the steady state, where none
# is until one rank differs).


def skipped_module_case(
    rank: int, world: int, directory: str, door: str, history: int, prefetch: int
) -> dict:
    torch.manual_seed(0)
    x, y = _data()
    rows = slice(rank * 2, rank * 2 + 2)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": prefetch,
    }
    if door == "engine":
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
        engine = fzero.shard(Branches(), optimizer=fzero.optim.sgd(lr=0.1), config=config)

        def train(use_b: bool) -> None:
            engine.backward(F.mse_loss(engine(x[rows], use_b), y[rows]))
            engine.step()

        def weights() -> dict:
            return engine.state_dict(dtype=torch.float32)

    else:
        model = Branches()
        plan = fzero.partition.plan(
            fzero.partition.describe(model), world_size=world, stage=3, persistence_threshold=0
        )
        states = [fzero.init(model, plan, optimizer=fzero.optim.sgd(lr=0.1))]
        path = [True]

        def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
            out = torch.func.functional_call(model, params, (batch[0], path[0]))
            return F.mse_loss(out, batch[1])

        config = {"zero_optimization": zero}
        step = fzero.train_step(
            loss_fn, plan=plan, optimizer=fzero.optim.sgd(lr=0.1), config=config
        )

        def train(use_b: bool) -> None:
            path[0] = use_b
            states[0] = step(states[0], (x[rows], y[rows]))[0]

        def weights() -> dict:
            return fzero.state_dict(states[0])

    for _ in range(history):
        train(True)
    result = _run_and_time(rank, lambda: train(rank == 0))  # rank 1 skips b
    if result["error"] == "no error":
        got = weights()  # on rank 0
        if got:
            result["max_error"] = max((got[k] - v).abs().max().item() for k, v in _paths().items())
    return _both(rank, result, directory)


def _paths() -> dict:
    """One process: three steps where both ranks' halves use `b`, then one where only
    rank 0's does."""
    torch.manual_seed(0)
    model = Branches()
    x, y = _data()
    for second in (True, True, True, False):
        model.zero_grad()
        loss = F.mse_loss(model(x[:2], True), y[:2]) + F.mse_loss(model(x[2:], second), y[2:])
        (loss / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return model.state_dict()


@pytest.mark.parametrize(
    "history, prefetch", [(0, 50_000_000), (3, 0)], ids=["first-step", "steady-no-prefetch"]
)
@pytest.mark.parametrize("door", ["engine", "train_step"])
def test_a_stage3_module_one_rank_skips_is_named_on_every_rank(door, history, prefetch, tmp_path):
    """Rank 0 is about to gather `b`; rank 1 skipped it and is about to do what comes
    after (or ends its operation): both get one error naming what each was about to
    issue, within seconds (before, gloo paired the next all-gathers by order: silently
    for units of one size, an abort inside gloo for others)."""
    # after steady steps rank 0's gather of `b` is issued and left pending: the process
    # group ends broken, so the case runs on processes of its own
    got = run_world(
        skipped_module_case, 2, str(tmp_path), door, history, prefetch, fresh=history > 0
    )
    for rank in ("0", "1"):
        result = got[rank]
        assert result["type"] == "RankDisagreement", result
        assert "all_gather of 32 elements (parameters of unit 1 'b')" in result["error"], result
        assert result["seconds"] < 20, result


@pytest.mark.parametrize("door", ["engine", "train_step"])
def test_a_stage3_module_one_rank_skips_within_the_prefetch_window_trains_correctly(door, tmp_path):
    """After steps every rank ran alike, the trace prefetches `b` on every rank, rank 1
    too: it serves rank 0's gather of `b` and contributes zero gradients to it, so the
    collectives pair as the check says and the weights equal one process's."""
    got = run_world(skipped_module_case, 2, str(tmp_path), door, 3, 50_000_000)
    assert got["0"]["error"] == got["1"]["error"] == "no error", got
    assert got["0"]["max_error"] < 1e-6, got


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return (self.b if expert == 0 else self.c)(self.a(x))


def different_experts_case(rank: int, world: int, directory: str, history: int) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = fzero.shard(Experts(), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    x, y = _data()

    def train(expert: int) -> None:
        engine.backward(F.mse_loss(engine(x[:2], expert), y[:2]))  # equal-size experts b, c
        engine.step()

    for _ in range(history):
        train(0)
    return _both(rank, _run_and_time(rank, lambda: train(rank)), directory)


@pytest.mark.parametrize("history", [0, 3])
def test_ranks_routing_to_different_experts_of_equal_size_are_named(history, tmp_path):
    """Experts `b` and `c` have one size: unchecked, gloo would pair rank 0's gather of
    `b` with rank 1's of `c` and train on wrong weights without a word. On the first
    step both ranks agree through the store (each names its unit); later rank 0 follows
    its last step (`b` was prefetched) while rank 1 stops to agree on gathering `c`."""
    # after steady steps rank 0's gather of `b` is left pending: processes of its own
    got = run_world(different_experts_case, 2, str(tmp_path), history, fresh=history > 0)
    for rank in ("0", "1"):
        result = got[rank]
        assert result["type"] == "RankDisagreement", result
        assert "all_gather of 32 elements (parameters of unit 2 'c')" in result["error"], result
        if history == 0:
            assert (
                "rank 0: all_gather of 32 elements (parameters of unit 1 'b')" in (result["error"])
            ), result
        assert result["seconds"] < 20, result


# ---- experts inside a numbered layer share its unit: routing may differ per rank ----------


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return x + self.experts[expert](torch.tanh(self.gate(x)))


class MoE(nn.Module):
    """Transformers' MoE shape: `layers.N.experts.M` (units hang on `layers.N`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer() for _ in range(2))
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, expert)
        return self.head(x)


def _routes(step: int, rank: int) -> int:
    """The expert rank `rank` routes to at `step`: alike for two steps, then apart."""
    return 0 if step < 2 else rank


MODELS = {"MoE": MoE, "Experts": Experts}


def routed_case(rank: int, world: int, door: str, name: str, leaf: bool) -> dict:
    """Four steps at stage 3, rank r's half of the batch routed by `_routes` (`leaf`:
    the model flagged as a leaf with DeepSpeed's `set_z3_leaf_modules`)."""
    from fzero.compat.deepspeed.utils import set_z3_leaf_modules

    torch.manual_seed(0)
    model = MODELS[name]()
    if leaf:
        set_z3_leaf_modules(model, [MODELS[name]])  # as scripts flag MoE blocks
    x, y = _data()
    rows = slice(rank * 2, rank * 2 + 2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if door == "engine":
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
        engine = fzero.shard(model, optimizer=fzero.optim.sgd(lr=0.1), config=config)
        for step in range(4):
            engine.backward(F.mse_loss(engine(x[rows], _routes(step, rank)), y[rows]))
            engine.step()
        return {"units": [u.name for u in engine.plan.units], **engine.state_dict()}
    plan = fzero.partition.plan(
        fzero.partition.describe(model),
        world_size=world,
        stage=3,
        persistence_threshold=0,
        leaf_modules=fzero.partition.leaf_modules(model),
    )
    state = fzero.init(model, plan, optimizer=fzero.optim.sgd(lr=0.1))
    route = [0]

    def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (batch[0], route[0]))
        return F.mse_loss(out, batch[1])

    step_fn = fzero.train_step(loss_fn, plan=plan, optimizer=fzero.optim.sgd(lr=0.1))
    for step in range(4):
        route[0] = _routes(step, rank)
        state, _ = step_fn(state, (x[rows], y[rows]))
    return {"units": [u.name for u in plan.units], **fzero.state_dict(state)}


def _routed_reference(name: str) -> dict:
    """One process: the mean of both ranks' losses, each routed as `_routes` says."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _data()
    for step in range(4):
        model.zero_grad()
        first = F.mse_loss(model(x[:2], _routes(step, 0)), y[:2])
        second = F.mse_loss(model(x[2:], _routes(step, 1)), y[2:])
        ((first + second) / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:  # an expert no rank used yet
                    p -= 0.1 * p.grad
    return model.state_dict()


@pytest.mark.parametrize("door", ["engine", "train_step"])
def test_ranks_routing_to_different_experts_of_one_layer_train_correctly(door):
    """Each layer's experts are one stage-3 unit, gathered whole by every rank: a rank
    that leaves an expert unused contributes zero gradients to it (as DDP with
    `find_unused_parameters`), and the weights equal one process's."""
    got = run_world(routed_case, 2, door, "MoE", False)
    assert got["units"] == ["layers.0", "layers.1", "head"]
    for key, value in _routed_reference("MoE").items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)


# ---- DeepSpeed's leaf modules: experts outside a numbered block share one unit ------------


def test_leaf_modules_put_a_leafs_parameters_in_one_unit():
    """`leaf_modules` joins a leaf's tensors in one unit where their usual units are
    smaller, and leaves a leaf inside a larger unit (a numbered block) as it is."""
    from fzero.compat.deepspeed.utils import set_z3_leaf_modules

    experts = Experts()
    assert fzero.partition.leaf_modules(experts) == ()
    set_z3_leaf_modules(experts, [Experts])
    assert fzero.partition.leaf_modules(experts) == ("",)
    manifest = fzero.partition.describe(experts)
    plan = fzero.partition.plan(manifest, world_size=2, stage=3, leaf_modules=("",))
    assert [u.name for u in plan.units] == ["<root>"]
    split = fzero.partition.plan(manifest, world_size=2, stage=3, leaf_modules=("b",))
    assert [u.name for u in split.units] == ["a", "b", "c"]
    moe = MoE()
    usual = fzero.partition.plan(fzero.partition.describe(moe), world_size=2, stage=3)
    leaf = fzero.partition.plan(
        fzero.partition.describe(moe), world_size=2, stage=3, leaf_modules=("layers.0.experts",)
    )
    assert [u.name for u in usual.units] == [u.name for u in leaf.units]
    assert [u.name for u in usual.units] == ["layers.0", "layers.1", "head"]
    with pytest.raises(fzero.partition.PlanError, match="leaf_modules is 'b'"):
        fzero.partition.plan(manifest, world_size=2, stage=3, leaf_modules="b")
    with pytest.raises(fzero.partition.PlanError, match=r"leaf_modules \[''\] with unit_numel=8"):
        fzero.partition.plan(manifest, world_size=2, stage=3, leaf_modules=("",), unit_numel=8)


def _own_strategy(manifest, *, world_size, stage, persistence_threshold=0):
    return fzero.partition.per_tensor_dim0(manifest, world_size=world_size, stage=stage)


def own_strategy_case(rank: int, world: int) -> dict:
    from fzero.compat.deepspeed.utils import set_z3_leaf_modules

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    model = Experts()
    set_z3_leaf_modules(model, [Experts])
    own = fzero.shard(model, strategy=_own_strategy, config=config)
    model = Experts()
    set_z3_leaf_modules(model, [Experts])
    built_in = fzero.shard(model, config=config)  # flat_even takes them
    return {
        "own": [u.name for u in own.plan.units],
        "built_in": [u.name for u in built_in.plan.units],
    }


def test_a_strategy_that_takes_no_leaf_modules_keeps_its_units():
    """The engine passes the leaf flags only to a strategy that takes `leaf_modules`; a
    user's own strategy without it lays out its units as before (the flags recorded)."""
    got = run_world(own_strategy_case, 1)
    assert got == {"own": ["a", "b", "c"], "built_in": ["<root>"]}


@pytest.mark.parametrize("door", ["engine", "train_step"])
def test_experts_of_a_leaf_module_train_correctly_when_ranks_route_apart(door):
    """The experts `b`, `c` that `test_ranks_routing_to_different_experts_of_equal_size`
    sees named: flagged with DeepSpeed's `set_z3_leaf_modules`, the model is one unit
    that every rank gathers, and routing apart (from the third step) trains as one
    process does."""
    got = run_world(routed_case, 2, door, "Experts", True)
    assert got["units"] == ["<root>"]
    for key, value in _routed_reference("Experts").items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
