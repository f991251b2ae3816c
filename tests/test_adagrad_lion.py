"""Adagrad and Lion (`fzero.optim.adagrad`, `fzero.optim.lion`): pure against
`torch.optim.Adagrad` and the paper's Lion; every stage at world sizes 1, 2 and 4 against
one process running those references; both doors bitwise alike (bf16 masters and states,
CPU offload); from a DeepSpeed config (`Adagrad`, `Lion`) and DeepSpeed's op names
(`DeepSpeedCPUAdagrad`, `DeepSpeedCPULion`, `FusedLion`).

`python -m tests.test_adagrad_lion` prints the parity tables (max abs error per stage).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero.compat.deepspeed.ops import adagrad as ds_adagrad
from fzero.compat.deepspeed.ops import lion as ds_lion
from tests._dist import run_world
from tests.models import (
    Net,
    global_batch,
    param_groups,
    parity_config,
    torch_reference,
    train_engine,
)
from tests.test_bf16_masters import doors_case
from tests.test_functional import _assert_same

MICRO, STEPS = 2, 4
ADAGRAD = {"lr": 1e-2, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10}
LION = {"lr": 1e-3, "betas": (0.9, 0.99)}


class ReferenceLion(torch.optim.Optimizer):
    """Lion as Chen et al. 2023 (Program 1) write it, in lucidrains/lion-pytorch's
    operations: decay, the sign of the interpolation, then the momentum."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                exp_avg = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def _reference_optimizer(name: str, groups: Any) -> torch.optim.Optimizer:
    if name == "adagrad":
        return torch.optim.Adagrad(groups, **ADAGRAD)
    return ReferenceLion(groups, **LION)


def _functional(name: str) -> fzero.optim.Optimizer:
    return fzero.optim.adagrad(**ADAGRAD) if name == "adagrad" else fzero.optim.lion(**LION)


# ---- pure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adagrad", "lion"])
def test_pure_update_over_a_pytree_is_the_reference_bit_for_bit(name):
    """A dict of tensors, three steps, weight decay on one of them: `update` leaves its
    inputs untouched and equals `update_`; both equal the reference's numbers exactly
    (the same operations in the same order)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 3), "nested": {"b": torch.randn(3), "c": torch.randn(70)}}
    leaves = [params["w"], params["nested"]["b"], params["nested"]["c"]]
    reference = [torch.nn.Parameter(p.clone()) for p in leaves]
    decayed = {"params": reference[:1], "weight_decay": 0.1}
    ref_opt = _reference_optimizer(name, [decayed, {"params": reference[1:]}])
    opt = _functional(name)
    state = opt.init(params)
    for _ in range(3):
        grads = {"w": torch.randn(5, 3), "nested": {"b": torch.randn(3), "c": torch.randn(70)}}
        before = [p.clone() for p in leaves]
        new, _ = opt.update(grads, state, params, weight_decay=0.0)
        assert all(torch.equal(p, q) for p, q in zip(leaves, before))  # pure
        w_state = opt.update_(grads["w"], state["w"], params["w"], weight_decay=0.1)
        rest = opt.update_(grads["nested"], state["nested"], params["nested"], weight_decay=0.0)
        assert torch.equal(new["nested"]["c"], params["nested"]["c"])
        state = {"w": w_state, "nested": rest}
        flat = [grads["w"], grads["nested"]["b"], grads["nested"]["c"]]
        for p, g in zip(reference, flat):
            p.grad = g.clone()
        ref_opt.step()
    for ours, theirs in zip(leaves, reference):
        assert torch.equal(ours, theirs.detach())
    assert state["w"].step == 3


def test_bad_hyper_parameters_are_named():
    with pytest.raises(ValueError, match="lr_decay is -1; it must be >= 0"):
        fzero.optim.adagrad(lr_decay=-1)
    with pytest.raises(ValueError, match=r"initial_accumulator_value is -0\.5"):
        fzero.optim.adagrad(initial_accumulator_value=-0.5)
    with pytest.raises(ValueError, match=r"betas is \(0.9, 1.5\); expected two values in \[0, 1\]"):
        fzero.optim.lion(betas=(0.9, 1.5))
    with pytest.raises(TypeError, match=r"LionHParams has no hyper-parameter \['eps'\]"):
        fzero.optim.lion().update_(torch.ones(2), fzero.optim.lion_init(torch.ones(2)),
                                   torch.ones(2), eps=1e-8)  # fmt: skip


# ---- every stage against one process ----------------------------------------------------------

CASES = [
    (name, stage, accum, clip)
    for name, stage in itertools.product(("adagrad", "lion"), range(4))
    for accum, clip in ((1, 0.0), (2, 0.05))
]


def reference(name: str, accum: int, world: int, clip: float) -> tuple[list[float], dict]:
    """One process on the global batches, torch.optim.Adagrad or the reference Lion, the
    two groups of `param_groups` (no decay for biases and norms)."""
    return torch_reference(
        lambda groups: _reference_optimizer(name, groups),
        steps=STEPS, micro=MICRO, accum=accum, world=world, clip=clip,
    )  # fmt: skip


def parity_case(rank: int, world: int, cases: list[tuple]) -> dict:
    results = {}
    for name, stage, accum, clip in cases:
        torch.manual_seed(0)
        model = Net()
        config = parity_config(MICRO, accum, clip)
        engine = fzero.shard(
            model,
            stage=stage,
            optimizer=_functional(name),
            config=config,
            param_groups=param_groups(model),
        )
        losses = train_engine(engine, rank, world, steps=STEPS, micro=MICRO)
        results[(name, stage, accum, clip)] = (losses, engine.state_dict(dtype=torch.float32))
        engine.destroy()
    return results


def parity(world: int) -> dict[tuple, dict[str, float]]:
    """Per case: the largest absolute and scale-relative error of any weight against the
    reference, and of the losses."""
    results = run_world(parity_case, world, CASES)
    errors = {}
    for case in CASES:
        name, _, accum, clip = case
        ref_losses, ref_state = reference(name, accum, world, clip)
        losses, state = results[case]
        assert state.keys() == ref_state.keys(), case
        errors[case] = {
            "abs": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
            "rel": max(
                ((state[k] - v).abs().max() / v.abs().max()).item() for k, v in ref_state.items()
            ),
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        }
    return errors


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_stage_matches_torch_adagrad_and_the_reference_lion(world):
    """fp32, stages 0-3, with and without accumulation and clipping: every weight within
    1e-5 of its tensor's scale of the single-process reference (reduction order is all
    that differs), the losses within 1e-5."""
    for case, error in parity(world).items():
        assert error["rel"] <= 1e-5, (case, error)
        assert error["loss"] <= 1e-5, (case, error)


# ---- both doors, bf16 masters and states, offload ---------------------------------------------


@pytest.mark.parametrize("name", ["adagrad", "lion"])
def test_both_doors_train_alike_with_bf16_states_and_offload(name):
    """World 2: the engine and train_step bitwise equal at every stage with bf16 masters
    and states (the native kernel writing the bf16 copy), and with CPU offload; the
    state is held in bf16 and at the plan's size."""
    cases = [(stage, 2, 0.05, False, name) for stage in range(4)]
    cases += [(2, 1, 0.0, True, name), (3, 1, 0.0, True, name)]
    results = run_world(doors_case, 2, cases)
    _assert_same(results)
    for case, result in results.items():
        assert result["held"]["master"] == "torch.bfloat16", case
        assert result["held"]["held_once"] or case[3], case
        assert result["held"]["planned"], case
    base = results[cases[0]]
    for case in cases[1:4]:  # the rounding draws by position in the unit, not by rank
        assert results[case]["losses"] == base["losses"], case


# ---- DeepSpeed's names -------------------------------------------------------------------------

DS_PARAMS = {
    "Adagrad": {**ADAGRAD, "weight_decay": 0.01},
    "Lion": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01},
}


def deepspeed_case(rank: int, world: int, how: str, kind: str, offload: bool) -> dict:
    """`fzero.initialize` with the config's `optimizer` block (`how` "config") or with
    DeepSpeed's op (`how` the op's name) over `model.parameters()`."""
    torch.manual_seed(0)
    model = Net()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 0,
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    params = dict(DS_PARAMS[kind])
    optimizer = None
    if how == "config":
        config["optimizer"] = {"type": kind, "params": params}
    else:  # deepspeed.ops.adagrad / deepspeed.ops.lion as fzero serves them
        params.pop("lr_decay", None), params.pop("initial_accumulator_value", None)
        module = ds_adagrad if kind == "Adagrad" else ds_lion
        optimizer = getattr(module, how)(model.parameters(), **params)
    engine, _, _, _ = fzero.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config
    )
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    name = engine.functional_optimizer.name
    return {"name": name, "state": engine.state_dict(dtype=torch.float32)}


def _single(kind: str, **params: Any) -> dict:
    torch.manual_seed(0)
    model = Net()
    if kind == "Adagrad":
        opt = torch.optim.Adagrad(model.parameters(), **params)
    else:
        opt = ReferenceLion(model.parameters(), **params)
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * 2)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("how", "kind", "offload"),
    [
        ("config", "Adagrad", False),
        ("config", "Lion", True),
        ("DeepSpeedCPUAdagrad", "Adagrad", True),
        ("DeepSpeedCPULion", "Lion", True),
        ("FusedLion", "Lion", False),
    ],
)
def test_deepspeed_config_types_and_ops_train_as_the_reference(how, kind, offload):
    """World 2, stage 2: DeepSpeed's config `type`s with its params names, and its op
    classes handed to `initialize`, train as torch.optim.Adagrad / the reference Lion."""
    result = run_world(deepspeed_case, 2, how, kind, offload)
    assert result["name"] == kind.lower()
    params = dict(DS_PARAMS[kind])
    if how != "config":  # not among the ops' arguments
        params.pop("lr_decay", None), params.pop("initial_accumulator_value", None)
    for name, expected in _single(kind, **params).items():
        error = ((result["state"][name] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 1e-5, (name, error)


def test_deepspeed_lion_ops_step_alone_as_the_reference():
    """Outside `initialize` (a script's own loop), DeepSpeedCPULion and FusedLion are
    torch optimizers whose step is fzero's Lion: the reference's numbers."""
    for cls in (ds_lion.DeepSpeedCPULion, ds_lion.FusedLion):
        torch.manual_seed(0)
        ours, theirs = Net(), Net()
        theirs.load_state_dict(ours.state_dict())
        opt = cls(ours.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
        ref = ReferenceLion(theirs.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
        for step in range(3):
            x, y = global_batch(step, 4)
            for model, o in ((ours, opt), (theirs, ref)):
                o.zero_grad()
                F.mse_loss(model(x), y).backward()
                o.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b), cls.__name__
        assert opt.state[next(ours.parameters())]["step"] == 3


def test_deepspeed_cpu_adagrad_is_torch_adagrad_with_deepspeeds_defaults():
    adagrad = ds_adagrad.DeepSpeedCPUAdagrad(Net().parameters(), weight_decay=0.1, amsgrad=True)
    assert isinstance(adagrad, torch.optim.Adagrad)
    expected = {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.1, "lr_decay": 0}
    assert {k: adagrad.defaults[k] for k in expected} == expected


def test_client_adagrad_groups_must_share_their_initial_accumulator():
    from fzero.compat.initialize import _from_client

    model = Net()
    params = list(model.parameters())
    opt = torch.optim.Adagrad(
        [{"params": params[:2], "initial_accumulator_value": 0.5}, {"params": params[2:]}]
    )
    with pytest.raises(ValueError, match=r"different initial_accumulator_value \[0.5, 0\]"):
        _from_client(opt)
    same = torch.optim.Adagrad(
        [{"params": params[:2], "lr_decay": 0.5}, {"params": params[2:]}],
        initial_accumulator_value=0.25,
    )
    functional, groups = _from_client(same)
    assert functional.hparams.initial_accumulator_value == 0.25
    assert [g["lr_decay"] for g in groups] == [0.5, 0]


def _table(world: int) -> str:
    errors = parity(world)
    lines = [
        f"world {world}",
        "| optimizer | stage | accum | clip | max abs error | max rel | loss |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for (name, stage, accum, clip), e in errors.items():
        lines.append(
            f"| {name} | {stage} | {accum} | {clip} | {e['abs']:.2e} | {e['rel']:.2e} "
            f"| {e['loss']:.2e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for size in (1, 2, 4):
        print(_table(size), flush=True)
