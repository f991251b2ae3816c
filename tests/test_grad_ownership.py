"""Whose gradient is it: the patterns real DeepSpeed scripts use, against plain torch.

- two engines in a GAN (the generator's backward runs through the discriminator's
  module; the script clears D's gradients with `netD.zero_grad()`);
- a plain `loss.backward()` instead of `engine.backward(loss)` (accumulation included);
- a forward through the raw module instead of the engine (stage 3 gathers on the
  module's own hooks).
Every case matches a single-process torch run at stages 0-3, world 1 and 2.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import fzero
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, STEPS, LR = 2, 3, 1e-2
NOISE, FEATURES = 5, 7


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(NOISE, 9), nn.Tanh(), nn.Linear(9, FEATURES))
    net_d = nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, 1))
    return net_g, net_d


def _gan_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(size, FEATURES, generator=gen) + 1.0, torch.randn(size, NOISE, generator=gen)


def gan_reference(world: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's DCGAN example loop in plain torch, on the global batch."""
    net_g, net_d = _gan_models()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=LR)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=LR)
    bce = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        real, noise = _gan_batch(step, MICRO * world)
        net_d.zero_grad()
        bce(net_d(real), torch.ones(len(real), 1)).backward()
        fake = net_g(noise)
        bce(net_d(fake.detach()), torch.zeros(len(real), 1)).backward()
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), torch.ones(len(real), 1)).backward()
        opt_g.step()
    return {
        **{f"g.{k}": v.detach().clone() for k, v in net_g.state_dict().items()},
        **{f"d.{k}": v.detach().clone() for k, v in net_d.state_dict().items()},
    }


def _backward(style: str, engine: fzero.Engine, loss: torch.Tensor) -> None:
    if style == "engine":
        engine.backward(loss)
    else:
        loss.backward()


def gan_cases(rank: int, world: int, cases: list[tuple[int, str, str]]) -> dict:
    """`style`: "engine" calls engine.backward(loss) (the DeepSpeed example);
    "torch" calls loss.backward(). `call`: forward through the engine or the raw module."""
    results = {}
    for stage, style, call in cases:
        net_g, net_d = _gan_models()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 0,
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
        }
        engine_g = fzero.shard(net_g, stage=stage, optimizer=fzero.optim.adam(lr=LR), config=config)
        engine_d = fzero.shard(net_d, stage=stage, optimizer=fzero.optim.adam(lr=LR), config=config)
        d = engine_d if call == "engine" else net_d
        bce = nn.BCEWithLogitsLoss()

        for step in range(STEPS):
            real, noise = _gan_batch(step, MICRO * world)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            real, noise = real[rows], noise[rows]
            net_d.zero_grad()
            _backward(style, engine_d, bce(d(real), torch.ones(MICRO, 1)))
            fake = engine_g(noise)
            _backward(style, engine_d, bce(d(fake.detach()), torch.zeros(MICRO, 1)))
            engine_d.step()
            net_g.zero_grad()
            _backward(style, engine_g, bce(d(fake), torch.ones(MICRO, 1)))
            engine_g.step()
        g_state, d_state = engine_g.state_dict(), engine_d.state_dict()
        results[(stage, style, call)] = {
            **{f"g.{k}": v for k, v in g_state.items()},
            **{f"d.{k}": v for k, v in d_state.items()},
        }
    return results


GAN_CASES = [
    *itertools.product(range(4), ["engine"], ["engine", "module"]),
    *itertools.product(range(4), ["torch"], ["module"]),
]


@pytest.mark.parametrize("world", [1, 2])
def test_two_engines_gan_matches_torch(world):
    results = run_world(gan_cases, world, GAN_CASES)
    expected = gan_reference(world)
    for case in GAN_CASES:
        state = results[case]
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=str(case))


def plain_reference(accum: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * accum * world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    """`how`: "engine" engine.backward(loss); "torch" loss.backward() of engine(x);
    "scale" engine.scale(loss).backward(); "raw" loss.backward() of module(x)."""
    results = {}
    for stage, accum, how, overlap, precision in cases:
        torch.manual_seed(0)
        model = Net()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": accum,
            "steps_per_print": 0,
            "zero_optimization": {
                "reduce_bucket_size": 300,
                "overlap_comm": overlap,
                "stage3_param_persistence_threshold": 0,
            },
        }
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        engine = fzero.shard(model, stage=stage, optimizer=fzero.optim.adamw(lr=LR), config=config)
        call = model if how == "raw" else engine
        for step in range(STEPS):
            x, y = global_batch(step, MICRO * accum * world)
            for i in range(accum):
                rows = slice((i * world + rank) * MICRO, (i * world + rank + 1) * MICRO)
                loss = nn.functional.mse_loss(call(x[rows]).float(), y[rows])
                if how == "engine":
                    engine.backward(loss)
                elif how == "scale":
                    engine.scale(loss).backward()
                else:
                    (loss / accum if how == "raw" else loss).backward()
                engine.step()
        results[(stage, accum, how, overlap, precision)] = engine.state_dict(torch.float32)
    return results


PLAIN_CASES = [
    *itertools.product(range(4), [1, 2], ["engine", "torch", "raw"], [False], ["fp32"]),
    *itertools.product([1, 2], [2], ["torch"], [True], ["fp32"]),
    *itertools.product(range(4), [2], ["engine", "scale"], [False], ["fp16"]),
]


@pytest.mark.parametrize("world", [1, 2])
def test_plain_backward_and_raw_module_match_engine_backward(world):
    results = run_world(plain_cases, world, PLAIN_CASES)
    for case in PLAIN_CASES:
        stage, accum, _, overlap, precision = case
        if precision == "fp16":  # engine.scale(loss).backward() == engine.backward(loss)
            expected = results[(stage, accum, "engine", overlap, precision)]
            for name, value in expected.items():
                torch.testing.assert_close(results[case][name], value, rtol=0, atol=0)
            continue
        expected = plain_reference(accum, world)
        for name, value in expected.items():
            torch.testing.assert_close(
                results[case][name], value, rtol=1e-5, atol=1e-6, msg=str(case)
            )
    # engine.backward and plain backward of engine(x) reduce in the same order: bitwise
    for stage, accum in itertools.product(range(4), [1, 2]):
        ours = results[(stage, accum, "engine", False, "fp32")]
        for name, value in results[(stage, accum, "torch", False, "fp32")].items():
            torch.testing.assert_close(value, ours[name], rtol=0, atol=0)


def unscaled_fp16(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": MICRO, "fp16": {"enabled": True}}
    engine = fzero.shard(model, stage=2, optimizer=fzero.optim.adamw(lr=LR), config=config)
    x, y = global_batch(0, MICRO)
    try:
        nn.functional.mse_loss(engine(x).float(), y).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_plain_backward_without_fp16_scale_is_an_error():
    message = run_world(unscaled_fp16, 1)
    assert "engine.backward(loss) or engine.scale(loss).backward()" in message


def autograd_grad_case(rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2}
    engine = fzero.shard(model, stage=2, optimizer=fzero.optim.adamw(lr=LR), config=config)
    x, _ = global_batch(0, MICRO)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(engine(x).sum(), x)
    (expected,) = torch.autograd.grad(model(x).sum(), x)
    return [grad, expected]


def test_autograd_grad_through_engine_output_is_untouched():
    """torch.autograd.grad (a GAN's gradient penalty) is not a training backward: the
    output hooks neither scale its gradients nor start a reduction."""
    grad, expected = run_world(autograd_grad_case, 1)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


class _Recomputed(nn.Module):
    """Two layers under reentrant activation checkpointing (a nested autograd pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.b(torch.tanh(self.a(t))))

        return self.c(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True))


def reentrant_cases(rank: int, world: int) -> dict:
    results = {}
    for stage, how in itertools.product(range(4), ["engine", "torch"]):
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "steps_per_print": 0,
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
        }
        engine = fzero.shard(
            _Recomputed(), stage=stage, optimizer=fzero.optim.adamw(lr=LR), config=config
        )
        for step in range(3 * 2):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(4, 6, generator=gen, requires_grad=True)
            loss = nn.functional.mse_loss(engine(x), torch.randn(4, 2, generator=gen))
            _backward(how, engine, loss)
            engine.step()
        results[(stage, how)] = engine.state_dict()
    return results


def test_plain_backward_through_reentrant_checkpointing_equals_engine_backward():
    """The recomputation's parameter gradients arrive in a nested autograd pass (another
    graph task); already scaled through the engine's output, they are taken at the end."""
    results = run_world(reentrant_cases, 1)
    for stage in range(4):
        for name, value in results[(stage, "engine")].items():
            torch.testing.assert_close(results[(stage, "torch")][name], value, rtol=1e-6, atol=1e-7)
