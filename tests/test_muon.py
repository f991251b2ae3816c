"""Muon (`fzero.optim.muon`): the reference `MuonWithAuxAdam`'s math, pure over pytrees
and under every ZeRO stage through both doors (each hidden matrix's momentum direction
made whole before Newton-Schulz), from a DeepSpeed config, with CPU offload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero.config import ConfigError
from fzero.optim import OPTIMIZER_PARAMS, optimizer_from_name
from tests._dist import run_world
from tests.models import Net, global_batch
from tests.test_bf16_masters import both_doors, build_doors
from tests.test_functional import _assert_same

MICRO, STEPS = 2, 3
HP = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 3e-3}


# ---- the reference: KellerJordan/Muon's formulas, written out in plain torch ----------------


def _newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.to(dtype)
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    if g.size(-2) > g.size(-1):
        x = x.mT
    return x


def reference_step(named, grads, state, step, *, lr, momentum, weight_decay, adam_lr, dtype):
    """One step of the reference over `named` tensors (in place); `state` per name."""
    betas, eps = (0.9, 0.95), 1e-10
    for name, p in named.items():
        g = grads[name].clone()
        if p.ndim >= 2 and "embed" not in name and "lm_head" not in name:
            buf = state.setdefault(name, torch.zeros_like(p))
            buf.lerp_(g, 1 - momentum)
            update = g.lerp_(buf, momentum)
            update = _newton_schulz(update.reshape(len(update), -1), 5, dtype).float()
            update *= max(1, g.size(-2) / g.size(-1)) ** 0.5
            p.mul_(1 - lr * weight_decay).add_(update.reshape(p.shape), alpha=-lr)
        else:
            buf1, buf2 = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
            buf1.lerp_(g, 1 - betas[0])
            buf2.lerp_(g.square(), 1 - betas[1])
            buf1c = buf1 / (1 - betas[0] ** step)
            buf2c = buf2 / (1 - betas[1] ** step)
            p.mul_(1 - adam_lr * weight_decay).add_(buf1c / (buf2c.sqrt() + eps), alpha=-adam_lr)


def reference_run(world: int, steps: int = STEPS, dtype=torch.float32) -> dict:
    """A single process on the global batch (the mean of the ranks' micro-batch losses)."""
    torch.manual_seed(0)
    model = Net()
    named = dict(model.named_parameters())
    state: dict = {}
    for step in range(1, steps + 1):
        x, y = global_batch(step - 1, MICRO * world)
        loss = F.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        grads = {k: p.grad for k, p in named.items()}
        with torch.no_grad():
            reference_step(named, grads, state, step, dtype=dtype, **HP)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- pure ------------------------------------------------------------------------------------


def test_muon_over_a_pytree_is_the_reference():
    """Over a dict of tensors (names are paths): hidden matrices take Muon, the
    embedding, biases and norms AdamW — the reference's numbers to fp32 rounding; `update`
    leaves its inputs untouched and equals `update_`."""
    torch.manual_seed(0)
    params = {
        "embed": {"weight": torch.randn(11, 6)},
        "block": {"weight": torch.randn(8, 6), "bias": torch.randn(8)},
        "conv": {"weight": torch.randn(4, 3, 2, 2)},
    }
    opt = fzero.optim.muon(ns_dtype="fp32", **HP)
    flat = {f"{m}.{k}": v for m, d in params.items() for k, v in d.items()}
    reference = {k: v.clone() for k, v in flat.items()}
    ref_state: dict = {}
    state = opt.init(params)
    for step in range(1, 4):
        grads = {m: {k: torch.randn_like(v) for k, v in d.items()} for m, d in params.items()}
        before = {m: {k: v.clone() for k, v in d.items()} for m, d in params.items()}
        new, _new_state = opt.update(grads, state, params)
        for m, d in params.items():
            for k, v in d.items():
                assert torch.equal(v, before[m][k])  # pure
        state = opt.update_(grads, state, params)
        for m, d in params.items():
            for k, v in d.items():
                assert torch.equal(v, new[m][k])
        flat_grads = {f"{m}.{k}": v for m, d in grads.items() for k, v in d.items()}
        reference_step(reference, flat_grads, ref_state, step, dtype=torch.float32, **HP)
    for m, d in params.items():
        for k, v in d.items():
            torch.testing.assert_close(v, reference[f"{m}.{k}"], rtol=1e-6, atol=1e-7)
    assert state["block"]["weight"].step == 3
    assert not state["block"]["weight"].exp_avg_sq.any()  # Muon's tensors use one moment


# ---- the doors -----------------------------------------------------------------------------


def doors_case(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per (stage, ns_dtype, offload, accum): the engine and train_step with Muon."""
    results = {}
    for stage, ns_dtype, offload, accum in cases:
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": accum,
            "steps_per_print": 0,
            "zero_optimization": zero,
        }
        optimizer = fzero.optim.muon(ns_dtype=ns_dtype, **HP)
        engine, model, state, step = build_doors(Net, world, stage, optimizer, config)
        engine_losses, step_losses, state = both_doors(
            engine, step, state, rank, world, accum, STEPS
        )
        results[(stage, ns_dtype, offload, accum)] = {
            "losses": (engine_losses, step_losses),
            "skipped": [],
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "state_bytes": engine.memory_held().optimizer_state,
        }
        engine.destroy()
    return results


def test_muon_at_every_stage_matches_the_reference_through_both_doors():
    """World 2, fp32 Newton-Schulz: stages 0-3 and CPU offload, engine and train_step
    bitwise equal, every stage the single-process reference to fp32 rounding. bf16
    Newton-Schulz (the default): every stage and both doors bitwise alike."""
    fp32 = [(stage, "fp32", False, 1) for stage in range(4)] + [(2, "fp32", True, 1)]
    bf16 = [(stage, "bf16", False, 1) for stage in range(4)]
    results = run_world(doors_case, 2, fp32 + bf16)
    _assert_same(results)
    reference = reference_run(2)
    for case in fp32:
        for name, value in reference.items():
            torch.testing.assert_close(
                results[case]["engine"][name], value, rtol=1e-5, atol=1e-6, msg=str((case, name))
            )
    first = results[bf16[0]]
    for case in bf16[1:]:
        assert results[case]["losses"] == first["losses"], case
        for name, value in first["engine"].items():
            assert torch.equal(results[case]["engine"][name], value), (case, name)


def adamw_state_bytes(rank: int, world: int) -> tuple[int, int]:
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}
    held = []
    for optimizer in (fzero.optim.adamw(), fzero.optim.muon()):
        engine = fzero.shard(Net(), optimizer=optimizer, config=config)
        held.append(engine.memory_held().optimizer_state)
        engine.destroy()
    return tuple(held)


def test_muon_state_is_no_larger_than_adamws():
    adamw, muon = run_world(adamw_state_bytes, 2)
    assert muon <= adamw


def deepspeed_config_case(rank: int, world: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    torch.manual_seed(0)
    engine, _optimizer, _, _ = fzero.initialize(model=Net(), config=config)
    losses = []
    for _ in range(6):  # one batch again and again: its loss falls
        x, y = global_batch(0, MICRO * world)
        loss = F.mse_loss(
            engine(x[rank * MICRO : (rank + 1) * MICRO]), y[rank * MICRO : (rank + 1) * MICRO]
        )
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    hp = engine.functional_optimizer.hparams
    return {"losses": losses, "hp": (hp.lr, hp.adam_lr, hp.momentum, hp.weight_decay)}


def test_a_deepspeed_muon_block_trains():
    """`"optimizer": {"type": "Muon", ...}` as DeepSpeed reads it: `lr` for both groups."""
    result = run_world(deepspeed_config_case, 2)
    assert result["hp"] == (1e-2, 1e-2, 0.9, 0.1)
    assert result["losses"][-1] < result["losses"][0]


def test_muon_config_errors_name_the_key():
    muon = optimizer_from_name("muon", {"muon_lr": 0.05, "adam_lr": 1e-3})
    assert (muon.hparams.lr, muon.hparams.adam_lr) == (0.05, 1e-3)
    default = optimizer_from_name("Muon", {})
    assert (default.hparams.lr, default.hparams.adam_lr) == (0.02, 3e-4)
    with pytest.raises(ValueError, match=r"ns_method is 'gram'.*allowed: 'standard'"):
        optimizer_from_name("muon", {"ns_method": "gram"})
    with pytest.raises(ConfigError, match="did you mean 'momentum'"):
        fzero.load_config({"optimizer": {"type": "Muon", "params": {"momentun": 0.9}}})
    with pytest.raises(ValueError, match=r"ns_dtype is 'fp16'; allowed: \['bf16', 'fp32'\]"):
        fzero.optim.muon(ns_dtype="fp16")
    assert {"lr", "momentum", "weight_decay", "betas", "eps", "muon_lr", "adam_lr"} <= set(
        OPTIMIZER_PARAMS["muon"]
    )


def nvme_case(rank: int, world: int, path: str) -> str:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": path},
        },
    }
    try:
        fzero.shard(Net(), optimizer=fzero.optim.muon(), config=config)
    except ValueError as error:
        return str(error)
    return "no error"


def test_muon_refuses_nvme_offload_by_name(tmp_path):
    message = run_world(nvme_case, 1, str(tmp_path))
    assert "Muon with 'zero_optimization.offload_optimizer.device' 'nvme'" in message


def groups_case(rank: int, world: int, embed_muon: bool) -> dict:
    """DeepSpeed's `use_muon` group key: the rule's own split given as groups, or the
    embedding moved to Muon."""
    torch.manual_seed(0)
    model = Net()
    hidden = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    if embed_muon:
        hidden.append(model.embed.weight)
        rest = [p for p in rest if p is not model.embed.weight]
    groups = [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}]
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}
    optimizer = fzero.optim.muon(ns_dtype="fp32", **HP)
    engine = fzero.shard(model, optimizer=optimizer, config=config, param_groups=groups)
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    return engine.state_dict(dtype=torch.float32)


def test_param_groups_choose_muon_with_deepspeeds_use_muon_key():
    reference = reference_run(2)
    by_groups = run_world(groups_case, 2, False)
    for name, value in reference.items():
        torch.testing.assert_close(by_groups[name], value, rtol=1e-5, atol=1e-6, msg=name)
    embed_on_muon = run_world(groups_case, 2, True)
    moved = (embed_on_muon["embed.weight"] - reference["embed.weight"]).abs().max()
    assert moved > 1e-3
