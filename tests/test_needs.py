"""Optimizers say what they need (`fzero.optim.Optimizer.needs` and `.native`) and the
core dispatches on that, never on a name: LAMB written by a user from fzero's public
pieces trains bitwise as the built-in one at stages 1-3 through both doors, with its
native kernels or without; a user's trust-ratio optimizer (per-tensor norms) and a
user's whole-matrix optimizer train under ZeRO-3 / ZeRO-2 as a single process does; and
`fzero/core` compares no optimizer name with a literal (a guard rail, with a mutation
check that it catches one)."""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fzero
from fzero import partition
from fzero.optim import (
    LambHParams,
    NativeKernel,
    Optimizer,
    TensorNorms,
    WholeTensors,
    lamb_apply_,
    lamb_direction_,
    lamb_init,
    lamb_step_hparams,
    lamb_update,
    lamb_update_,
    trust_ratio,
    with_overrides,
)
from tests._dist import run_world
from tests.models import Net, global_batch
from tests.test_bf16_masters import both_doors, build_doors
from tests.test_functional import _config, _plan

ROOT = Path(__file__).resolve().parent.parent
MICRO, STEPS, LR = 2, 3, 1e-2


# ---- the guard rail: no name dispatch in the core ------------------------------------------

BUILT_IN_NAMES = {name.lower() for name in fzero.optim.OPTIMIZERS}
# What the core may take from fzero.optim: the declarations and the generic machinery
# (loss scaling, clipping, rounding, schedules, building from a config), never one
# optimizer's pieces; `adamw` is the documented default of `train_step`.
CORE_MAY_IMPORT = {
    "DynamicLossScale", "LossScaleError", "LossScaleState", "NativeKernel", "Needs",
    "Optimizer", "ROUNDING_STRIDE", "Schedule", "StaticLossScale", "TensorNorms",
    "WholeTensors",
    "adamw", "bf16_stochastic", "clip_coefficient", "optimizer_from_name", "rounding_seed",
    "schedule_from_name", "segment_sq_sums", "with_overrides",
}  # fmt: skip


def _is_name_of_optimizer(node: ast.AST) -> bool:
    """`<optimizer>.name`, `getattr(<optimizer>, "name", ...)`, or a type's `__name__`."""
    if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__"):
        return True
    if isinstance(node, ast.Attribute) and node.attr == "name":
        return "opt" in ast.unparse(node.value).lower()
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
        args = node.args
        return (
            len(args) >= 2
            and "opt" in ast.unparse(args[0]).lower()
            and isinstance(args[1], ast.Constant)
            and args[1].value == "name"
        )
    return False


def _literals(node: ast.AST) -> list[str]:
    """The string literals `node` is (a constant, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [v for e in node.elts for v in _literals(e)]
    return []


def _name_dispatches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of each comparison of an optimizer's name with a literal, each
    comparison of anything with a built-in optimizer's name, and each lookup or `match`
    by an optimizer's name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [v for o in operands for v in _literals(o)]
            named = any(_is_name_of_optimizer(o) for o in operands)
            if (named and literals) or BUILT_IN_NAMES & {v.lower() for v in literals}:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and _is_name_of_optimizer(node.slice):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and _is_name_of_optimizer(node.subject):
            found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
        elif isinstance(node, ast.Dict) and any(
            BUILT_IN_NAMES & set(_literals(k)) for k in node.keys if k is not None
        ):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def _optimizer_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each import from `fzero.optim` (or its private modules) that is not
    in `CORE_MAY_IMPORT`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fzero.optim"):
            private = node.module not in ("fzero.optim", "fzero.optim._schedules")
            for alias in node.names:
                if private or alias.name not in CORE_MAY_IMPORT:
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    return found


def core_violations(root: Path = ROOT) -> list[str]:
    """`path:line source` of each name dispatch or optimizer-specific import in fzero/core."""
    found = []
    for path in sorted((root / "fzero" / "core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for line, source in _name_dispatches(tree) + _optimizer_imports(tree):
            found.append(f"{path.relative_to(root)}:{line} {source}")
    return found


def test_the_core_never_dispatches_on_an_optimizers_name():
    violations = core_violations()
    assert not violations, "the core dispatches on optimizer names:\n" + "\n".join(violations)


PLANTED = [
    "if self.optimizer.name == 'lamb':\n        pass",
    "if getattr(optimizer, 'name', '') in ('adam', 'adamw'):\n        pass",
    "kind = {'muon': 1}.get(self.optimizer.name)",
    "kind = KINDS[self.optimizer.name]",
    "if type(hp).__name__ == 'LambHParams':\n        pass",
    "if name == 'lion':\n        pass",
    "match optimizer.name:\n        case 'sgd':\n            pass",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_the_guard_rail_catches_planted_name_dispatch(tmp_path, planted):
    """Mutation check: each planted dispatch in a copy of the core is reported."""
    shutil.copytree(ROOT / "fzero" / "core", tmp_path / "fzero" / "core")
    assert core_violations(tmp_path) == []
    apply = tmp_path / "fzero" / "core" / "apply.py"
    planted_function = f"\n\ndef _planted(self, optimizer, hp, name):\n    {planted}\n"
    apply.write_text(apply.read_text() + planted_function)
    assert any("apply.py" in v for v in core_violations(tmp_path)), planted


def test_the_guard_rail_catches_an_optimizer_specific_import(tmp_path):
    shutil.copytree(ROOT / "fzero" / "core", tmp_path / "fzero" / "core")
    update = tmp_path / "fzero" / "core" / "update.py"
    update.write_text(update.read_text() + "\nfrom fzero.optim import lamb_direction_\n")
    assert core_violations(tmp_path) == [
        f"fzero/core/update.py:{len(update.read_text().splitlines())} fzero.optim.lamb_direction_"
    ]


# ---- LAMB as a user writes it ----------------------------------------------------------------


def user_lamb(calls: list[str], **hparams: Any) -> Optimizer:
    """LAMB from fzero's public pieces, under another name: the pure halves
    (`lamb_direction_`, `lamb_apply_`, `lamb_step_hparams`), native twins calling
    `fzero.native`'s kernels (counted in `calls`), and `lamb_update`/`lamb_update_` for
    whole tensors."""
    hp = LambHParams(**hparams)

    def native_direction_(kernels, param, grad, state, h, grad_scale, out):
        calls.append("direction")
        kernels.lamb_direction_(
            param, grad, state.exp_avg, state.exp_avg_sq, out, step=state.step + 1,
            betas=h.betas, eps=h.eps, weight_decay=h.weight_decay,
            bias_correction=False, grad_scale=grad_scale,  # in the step size
        )  # fmt: skip

    def native_apply_(kernels, param, direction, segments, p_norms, d_norms, h):
        calls.append("apply")
        scales = [-h.lr * trust_ratio(p, d, h) for p, d in zip(p_norms, d_norms)]
        kernels.lamb_apply_(param, direction, segments, scales)

    def update(grad, state, param, **overrides):
        return lamb_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad, state, param, **overrides):
        return lamb_update_(grad, state, param, with_overrides(hp, overrides))

    return Optimizer(
        "my_lamb",
        hp,
        lamb_init,
        update,
        update_,
        state_slots=2,
        needs=TensorNorms(
            direction_=lamb_direction_, apply_=lamb_apply_, step_hparams=lamb_step_hparams
        ),
        native=NativeKernel(direction_=native_direction_, apply_=native_apply_),
    )


def _train_both_doors(rank: int, world: int, optimizer: Optimizer, stage: int) -> dict:
    """The engine and train_step from the same weights on the same micro-batches."""
    config = _config(stage, 1, 0.0, "fp32", False)
    config["zero_optimization"]["stage"] = stage
    engine, model, state, step = build_doors(Net, world, stage, optimizer, config)
    engine_losses, step_losses, state = both_doors(engine, step, state, rank, world, 1, STEPS)
    losses = list(zip(engine_losses, step_losses))
    volume = engine.comm_volume()
    result = {
        "losses": losses,
        "engine": engine.state_dict(dtype=torch.float32),
        "step": fzero.state_dict(state, module=model),
        "volume": [(row.operation, row.what, row.calls, row.bytes) for row in volume],
    }
    engine.destroy()
    return result


def lamb_case(rank: int, world: int, stages: list[int]) -> dict:
    results = {}
    hparams = {"lr": LR, "weight_decay": 0.01, "max_coeff": 0.3}
    for stage in stages:
        calls: list[str] = []
        built_in = _train_both_doors(rank, world, fzero.optim.lamb(**hparams), stage)
        mine = _train_both_doors(rank, world, user_lamb(calls, **hparams), stage)
        results[stage] = {"built_in": built_in, "mine": mine, "calls": sorted(set(calls))}
    return results


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_lamb_written_by_a_user_trains_bitwise_as_the_built_in(monkeypatch, kernels):
    """World 2, stages 1-3, both doors: every loss and weight bitwise equal to the
    built-in LAMB's, through the native halves (`native`) or the pure ones
    (`FZERO_NATIVE=0`); the engine's comm_volume counts the norms' all-reduce for both."""
    if kernels == "torch":
        monkeypatch.setenv("FZERO_NATIVE", "0")
    elif not fzero.native.available():
        pytest.skip(fzero.native.why())
    results = run_world(lamb_case, 2, [1, 2, 3])
    for stage, result in results.items():
        built_in, mine = result["built_in"], result["mine"]
        assert mine["losses"] == built_in["losses"], stage
        for door in ("engine", "step"):
            for name, value in built_in[door].items():
                assert torch.equal(mine[door][name], value), (stage, door, name)
        assert mine["volume"] == built_in["volume"], stage
        assert any("tensor norms" in row[1] for row in mine["volume"]), stage
        assert result["calls"] == (["apply", "direction"] if kernels == "native" else []), stage


# ---- a user's trust-ratio optimizer under ZeRO-3 ----------------------------------------------


@dataclass(frozen=True)
class TrustHParams:
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    trust: float = 0.02


class TrustState(NamedTuple):
    step: int
    momentum_buffer: Tensor


def _trust_direction_(grad, state, param, hp):
    """d = buf = momentum x buf + (g + wd x p)."""
    state.momentum_buffer.mul_(hp.momentum).add_(grad.add(param, alpha=hp.weight_decay))
    return state.momentum_buffer.clone()


def _trust_apply_(param, direction, segments, p_norms, d_norms, hp):
    """p -= lr x trust x ‖p‖ / ‖d‖ x d per tensor (1 where a norm is zero)."""
    for (a, b), p_norm, d_norm in zip(segments, p_norms, d_norms):
        ratio = hp.trust * p_norm / d_norm if p_norm > 0 and d_norm > 0 else 1.0
        param[a:b].add_(direction[a:b], alpha=-hp.lr * ratio)


def trust_sgd(**hparams: Any) -> Optimizer:
    """SGD with momentum whose step is scaled per tensor by trust x ‖p‖ / ‖d‖ (LARS-style,
    You et al. 2017), declared as needing tensor norms; no native kernel."""
    return norm_scaled_sgd("trust_sgd", TrustHParams(**hparams), _trust_apply_)


def norm_scaled_sgd(name: str, hp: TrustHParams, apply_: Any) -> Optimizer:
    """SGD with momentum whose step `apply_(param, direction, segments, p_norms, d_norms,
    hp)` scales per tensor from the whole tensors' norms, declared as `TensorNorms`."""

    def update_(grad, state, param, **overrides):
        h = with_overrides(hp, overrides)
        direction = _trust_direction_(grad, state, param, h)
        p_norm, d_norm = param.double().norm().item(), direction.double().norm().item()
        apply_(param, direction, [(0, param.numel())], [p_norm], [d_norm], h)
        return TrustState(state.step + 1, state.momentum_buffer)

    def update(grad, state, param, **overrides):
        param, state = param.clone(), TrustState(state.step, state.momentum_buffer.clone())
        return param, update_(grad, state, param, **overrides)

    def init(param):
        return TrustState(0, torch.zeros_like(param))

    needs = TensorNorms(direction_=_trust_direction_, apply_=apply_)
    return Optimizer(name, hp, init, update, update_, state_slots=1, needs=needs)


TRUST = {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01, "trust": 0.02}


def trust_reference(world: int) -> dict[str, Tensor]:
    """One process, whole tensors: the same rule written out per parameter."""
    torch.manual_seed(0)
    model = Net()
    buffers = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                d = buffers[name].mul_(TRUST["momentum"]).add_(p.grad + TRUST["weight_decay"] * p)
                p_norm, d_norm = p.double().norm().item(), d.double().norm().item()
                ratio = TRUST["trust"] * p_norm / d_norm if p_norm > 0 and d_norm > 0 else 1.0
                p.add_(d, alpha=-TRUST["lr"] * ratio)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trust_case(rank: int, world: int, stage: int) -> dict:
    result = _train_both_doors(rank, world, trust_sgd(**TRUST), stage)
    plan = _plan(Net(), world, stage)
    held = [s.fqn for r in range(world) for s in partition.local_slices(plan, r) if s.numel]
    result["spanning"] = sorted({fqn for fqn in held if held.count(fqn) > 1})
    return result


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_user_optimizer_with_a_tensor_norm_need_trains_under_zero3(world):
    """Stage 3, flat even shards (tensors split across ranks): both doors bitwise alike
    and equal to the single-process rule, whose norms are over whole tensors."""
    result = run_world(trust_case, world, 3)
    if world > 1:
        assert result["spanning"], "no tensor spans ranks: the test would prove nothing"
    engine_losses, step_losses = zip(*result["losses"])
    assert engine_losses == step_losses
    reference = trust_reference(world)
    for name, expected in reference.items():
        assert torch.equal(result["engine"][name], result["step"][name]), name
        torch.testing.assert_close(result["engine"][name], expected, rtol=1e-5, atol=1e-6)
    assert any("tensor norms" in row[1] for row in result["volume"]) == (world > 1)


# ---- a user's whole-matrix optimizer ---------------------------------------------------------


@dataclass(frozen=True)
class NormalizedHParams:
    lr: float = 0.05


class NormalizedState(NamedTuple):
    step: int


def _normalized_takes(name, shape, hp):
    return len(shape) == 2


def _normalized_direction_(grad, state, param, hp):
    return grad.clone()


def _normalized_whole(direction, hp):
    """A matrix's gradient scaled to unit spectral norm (its largest singular value)."""
    return direction / torch.linalg.matrix_norm(direction, ord=2)


def _normalized_apply_(param, update, hp):
    param.add_(update.to(param.device), alpha=-hp.lr)


def _normalized_rest_(grad, state, param, hp):
    param.add_(grad, alpha=-hp.lr)
    return state


def normalized(**hparams: Any) -> Optimizer:
    """Matrices step along their gradient over its spectral norm (needs whole matrices),
    vectors plain SGD."""
    hp = NormalizedHParams(**hparams)
    needs = WholeTensors(
        takes=_normalized_takes,
        direction_=_normalized_direction_,
        whole=_normalized_whole,
        apply_=_normalized_apply_,
        rest_=_normalized_rest_,
    )

    def update_(grad, state, param, **overrides):
        h = with_overrides(hp, overrides)
        if needs.takes("", tuple(param.shape), h):
            needs.apply_(param, needs.whole(grad, h), h)
        else:
            needs.rest_(grad, state, param, h)
        return NormalizedState(state.step + 1)

    def update(grad, state, param, **overrides):
        param = param.clone()
        return param, update_(grad, state, param, **overrides)

    return Optimizer(
        "normalized", hp, lambda p: NormalizedState(0), update, update_, 0, needs=needs
    )


def normalized_reference(world: int) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = normalized()
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                opt.update_(p.grad, NormalizedState(0), p)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def normalized_case(rank: int, world: int, stages: list[int]) -> dict:
    return {stage: _train_both_doors(rank, world, normalized(), stage) for stage in stages}


def test_a_user_optimizer_that_needs_whole_matrices_trains_sharded():
    """World 2, stages 2 and 3 (matrices split across ranks), both doors: a state with
    no tensors, the spectral norm of each whole matrix, as a single process computes it."""
    results = run_world(normalized_case, 2, [2, 3])
    reference = normalized_reference(2)
    for stage, result in results.items():
        engine_losses, step_losses = zip(*result["losses"])
        assert engine_losses == step_losses, stage
        for name, expected in reference.items():
            assert torch.equal(result["engine"][name], result["step"][name]), (stage, name)
            torch.testing.assert_close(
                result["engine"][name], expected, rtol=1e-5, atol=1e-6, msg=f"{stage} {name}"
            )


# ---- declarations the core refuses -------------------------------------------------------------


def refused_case(rank: int, world: int) -> dict[str, str]:
    """What the engine and train_step say of an optimizer whose declarations are of no
    known kind."""
    base, messages = fzero.optim.adamw(), {}
    for field, value in [("needs", "norms"), ("native", object())]:
        bad = base._replace(name="odd", **{field: value})
        try:
            fzero.shard(Net(), optimizer=bad, config=_config(1, 1, 0.0, "fp32", False))
        except TypeError as error:
            messages[f"engine {field}"] = str(error)
        model = Net()
        plan = _plan(model, world, 1)
        state = fzero.init(model, plan, bad)

        def loss_fn(params, batch, model=model):
            return F.mse_loss(torch.func.functional_call(model, params, (batch[0],)), batch[1])

        try:
            fzero.train_step(loss_fn, plan, bad)(state, global_batch(0, MICRO))
        except TypeError as error:
            messages[f"train_step {field}"] = str(error)
    return messages


def test_declarations_of_unknown_kinds_are_refused_by_name():
    messages = run_world(refused_case, 1)
    assert sorted(messages) == ["engine native", "engine needs", "train_step native",
                                "train_step needs"]  # fmt: skip
    for door in ("engine", "train_step"):
        assert (
            "optimizer 'odd' declares needs='norms'; allowed: None, fzero.optim.TensorNorms"
            in (messages[f"{door} needs"])
        )
        assert "allowed: None or fzero.optim.NativeKernel" in messages[f"{door} native"]
