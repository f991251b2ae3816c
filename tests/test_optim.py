"""Functional optimizers against torch.optim and a float64 LAMB reference."""

from __future__ import annotations

import math

import pytest
import torch

import fzero.optim as fo

STEPS = 50


def _trajectory(make_torch, fz_opt, *, shape=(37, 13), seed=0):
    """Run torch.optim and fzero's pure update side by side on the same gradients."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(STEPS)]
    ref = torch.nn.Parameter(start.clone())
    torch_opt = make_torch([ref])
    param, state = start.clone(), fz_opt.init(start)
    for grad in grads:
        ref.grad = grad.clone()
        torch_opt.step()
        param, state = fz_opt.update(grad, state, param)
    return ref.detach(), param


def _max_rel_error(a, b):
    return ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()


CASES = [
    (lambda p: torch.optim.Adam(p, lr=1e-2), fo.adam(lr=1e-2)),
    (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1), fo.adam(lr=1e-2, weight_decay=0.1)),
    (
        lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
        fo.adamw(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    ),
    (lambda p: torch.optim.SGD(p, lr=0.05), fo.sgd(lr=0.05)),
    (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
        fo.sgd(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ),
    (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        fo.sgd(lr=0.05, momentum=0.9, nesterov=True),
    ),
]


@pytest.mark.parametrize(("make_torch", "fz_opt"), CASES)
def test_matches_torch_optim(make_torch, fz_opt):
    expected, got = _trajectory(make_torch, fz_opt)
    assert _max_rel_error(got, expected) <= 1e-6


@pytest.mark.parametrize(
    "fz_opt",
    [
        fo.adam(lr=1e-2, weight_decay=0.1),
        fo.adamw(lr=1e-2, weight_decay=0.1, bias_correction=False),
        fo.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        fo.lamb(lr=1e-2, weight_decay=0.01, max_coeff=0.3, min_coeff=0.01),
    ],
)
def test_in_place_equals_pure_bitwise(fz_opt):
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(1001, generator=gen)
    pure_param, pure_state = start.clone(), fz_opt.init(start)
    param, state = start.clone(), fz_opt.init(start)
    for _ in range(20):
        grad = torch.randn(1001, generator=gen)
        grad_copy = grad.clone()
        pure_param, pure_state = fz_opt.update(grad, pure_state, pure_param)
        state = fz_opt.update_(grad, state, param)
        assert torch.equal(grad, grad_copy), "in-place update wrote its gradient"
    assert torch.equal(param, pure_param)
    for a, b in zip(state, pure_state):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_pure_update_leaves_inputs_untouched():
    opt = fo.adamw(lr=0.1, weight_decay=0.1)
    param, grad = torch.ones(5), torch.full((5,), 0.5)
    state = opt.init(param)
    opt.update(grad, state, param)
    assert torch.equal(param, torch.ones(5))
    assert torch.count_nonzero(state.exp_avg) == 0


def test_adam_without_bias_correction():
    opt = fo.adam(lr=0.1, bias_correction=False)
    param, grad = torch.tensor([1.0]), torch.tensor([2.0])
    new, state = opt.update(grad, opt.init(param), param)
    m, v = 0.1 * 2.0, 0.001 * 4.0
    assert new.item() == pytest.approx(1.0 - 0.1 * m / (math.sqrt(v) + 1e-8), rel=1e-6)
    assert state.step == 1


def _lamb_reference(start, grads, lr, betas, eps, wd, min_coeff, max_coeff):
    """LAMB as DeepSpeed's FusedLamb kernel computes it (csrc/lamb, eps outside the
    square root, bias correction in the step size), in float64."""
    p = start.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        step_size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
        r = m / (v.sqrt() + eps) + wd * p
        w_norm, r_norm = p.norm().item(), r.norm().item()
        trust = min(max(w_norm / r_norm, min_coeff), max_coeff) if w_norm and r_norm else 1.0
        p = p - step_size * trust * r
    return p


def test_lamb_matches_float64_reference():
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(64, 32, generator=gen)
    grads = [torch.randn(64, 32, generator=gen) for _ in range(STEPS)]
    opt = fo.lamb(lr=1e-2, weight_decay=0.01, max_coeff=0.3, min_coeff=0.01)
    param, state = start.clone(), opt.init(start)
    for g in grads:
        param, state = opt.update(g, state, param)
    expected = _lamb_reference(start, grads, 1e-2, (0.9, 0.999), 1e-8, 0.01, 0.01, 0.3)
    # fp32 against fp64: judge the error against the tensor's scale, not element by element
    # (elements near zero have no meaningful relative error).
    error = (param.double() - expected).abs().max() / expected.abs().max()
    assert error <= 1e-6


def test_lamb_segments_have_their_own_trust_ratio():
    opt = fo.lamb(lr=0.1)
    a, b = torch.randn(10), 100 * torch.randn(7)
    ga, gb = torch.randn(10), torch.randn(7)
    flat = torch.cat([a, b])
    state = opt.update_(torch.cat([ga, gb]), opt.init(flat), flat, segments=[(0, 10), (10, 17)])
    new_a, _ = opt.update(ga, opt.init(a), a)
    new_b, _ = opt.update(gb, opt.init(b), b)
    torch.testing.assert_close(flat, torch.cat([new_a, new_b]), rtol=1e-6, atol=1e-7)
    assert state.step == 1


def test_trust_ratio_clamps_and_defaults_to_one():
    hp = fo.LambHParams(min_coeff=0.01, max_coeff=0.3)
    assert fo.trust_ratio(10.0, 1.0, hp) == 0.3
    assert fo.trust_ratio(1e-6, 1.0, hp) == 0.01
    assert fo.trust_ratio(0.0, 1.0, hp) == 1.0


def test_overrides_and_errors_name_the_hyper_parameter():
    opt = fo.adamw(lr=1.0)
    param = torch.ones(3)
    new, _ = opt.update(torch.ones(3), opt.init(param), param, lr=0.0, weight_decay=0.0)
    assert torch.equal(new, param)
    with pytest.raises(TypeError, match="no hyper-parameter \\['momentum'\\]"):
        opt.update(torch.ones(3), opt.init(param), param, momentum=0.9)
    with pytest.raises(ValueError, match="betas"):
        fo.adam(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="nesterov"):
        fo.sgd(nesterov=True)


def test_optimizer_from_name_follows_deepspeed():
    adam = fo.optimizer_from_name("Adam", {"lr": 1e-3, "weight_decay": 0.01})
    assert adam.name == "adamw" and adam.hparams.decoupled  # adam_w_mode defaults to true
    l2 = fo.optimizer_from_name("ADAM", {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True})
    assert l2.name == "adam" and not l2.hparams.decoupled
    assert fo.optimizer_from_name("lamb", {"max_coeff": 0.3}).hparams.max_coeff == 0.3
    assert fo.optimizer_from_name("sgd", {"momentum": 0.9}).state_slots == 1
    assert fo.optimizer_from_name("Adagrad", {"lr_decay": 0.1}).hparams.lr_decay == 0.1
    assert fo.optimizer_from_name("LION", {"betas": [0.9, 0.99]}).hparams.betas == (0.9, 0.99)
    with pytest.raises(ValueError, match="allowed: Adam, AdamW, Lamb, SGD, Muon, Adagrad, Lion"):
        fo.optimizer_from_name("adafactor", {})


def test_clip_math_matches_torch():
    grads = [torch.randn(10) * 3, torch.randn(4, 4)]
    expected = [g.clone() for g in grads]
    norm = torch.nn.utils.clip_grad_norm_(
        [torch.nn.Parameter(torch.zeros_like(g)) for g in grads], 1.0
    )  # zero-grad params: returns 0
    assert norm.item() == 0.0
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, expected):
        p.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
    partial = [(g.double() ** 2).sum().item() for g in grads]  # one "rank" per tensor
    assert fo.global_norm(partial) == pytest.approx(torch_norm, rel=1e-6)
    coef = fo.clip_coefficient(fo.global_norm(partial), 1.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coef)
    assert fo.clip_coefficient(0.5, 1.0) == 1.0
    with pytest.raises(ValueError, match="max_norm"):
        fo.clip_coefficient(1.0, 0.0)


# ---- pytrees of tensors (optax / torchopt style) ------------------------------------------


def _tree(gen: torch.Generator) -> dict:
    """A nested structure: dict, list, tuple; tensors of different shapes."""
    return {
        "w": torch.randn(5, 3, generator=gen),
        "blocks": [torch.randn(4, generator=gen), (torch.randn(2, 2, generator=gen),)],
    }


@pytest.mark.parametrize(("make_torch", "fz_opt"), CASES)
def test_a_pytree_of_tensors_matches_torch_optim_over_20_steps(make_torch, fz_opt):
    from torch.utils import _pytree as pytree

    gen = torch.Generator().manual_seed(3)
    params = _tree(gen)
    leaves, spec = pytree.tree_flatten(params)
    refs = [torch.nn.Parameter(t.clone()) for t in leaves]
    torch_opt = make_torch(refs)
    state = fz_opt.init(params)
    in_place = pytree.tree_map(torch.clone, params)
    state_ = fz_opt.init(in_place)
    for _ in range(20):
        grads = pytree.tree_map(lambda t: torch.randn(t.shape, generator=gen), params)
        for ref, grad in zip(refs, pytree.tree_leaves(grads)):
            ref.grad = grad.clone()
        torch_opt.step()
        params, state = fz_opt.update(grads, state, params)
        state_ = fz_opt.update_(grads, state_, in_place)
    assert pytree.tree_structure(params) == spec == pytree.tree_structure(in_place)
    for got, same, expected in zip(pytree.tree_leaves(params), pytree.tree_leaves(in_place), refs):
        assert _max_rel_error(got, expected.detach()) <= 1e-6
        assert torch.equal(got, same)  # in place == pure, bitwise


def test_lamb_over_a_pytree_equals_lamb_per_tensor():
    from torch.utils import _pytree as pytree

    opt = fo.lamb(lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(4)
    params = _tree(gen)
    state = opt.init(params)
    singles = [(t, opt.init(t)) for t in pytree.tree_leaves(params)]
    for _ in range(5):
        grads = pytree.tree_map(lambda t: torch.randn(t.shape, generator=gen), params)
        params, state = opt.update(grads, state, params)
        singles = [
            opt.update(grad, single, param)
            for grad, (param, single) in zip(pytree.tree_leaves(grads), singles)
        ]
    for got, (expected, _) in zip(pytree.tree_leaves(params), singles):
        assert torch.equal(got, expected)


def test_pytree_structures_must_agree_and_hold_tensors():
    opt = fo.adamw()
    params = {"w": torch.ones(2), "b": torch.zeros(1)}
    state = opt.init(params)
    with pytest.raises(ValueError, match="grads has structure"):
        opt.update({"w": torch.ones(2)}, state, params)
    with pytest.raises(ValueError, match="state has structure"):
        opt.update(params, opt.init({"w": torch.ones(2)}), params)
    with pytest.raises(TypeError, match="params leaf 1 is a float; expected a tree of tensors"):
        opt.init({"a": torch.ones(1), "b": 1.0})
