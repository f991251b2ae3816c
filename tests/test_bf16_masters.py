"""bf16 master weights and bf16 optimizer states in memory (DeepSpeed's
`bf16.bf16_master_weights_and_grads` / `bf16.bf16_optimizer_states`, fzero's
`Precision(..., master="bf16", states="bf16")`): the masters are the bf16 parameters
themselves, the update runs in fp32 and rounds back stochastically; the same numbers at
every stage, through both doors, against a plain-PyTorch reference, across checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

import fzero
from fzero.optim import bf16_stochastic, rounding_seed
from tests._dist import run_world
from tests.models import Net, global_batch
from tests.test_functional import _assert_same, _plan

MICRO, LR, DECAY = 2, 1e-2, 0.01
BOTH = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _config(stage: int, accum: int = 1, clip: float = 0.0, bf16: dict | None = None, **zero):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "bf16": bf16 or BOTH,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 300,
            **zero,
        },
    }


def _micro(engine, rank, world, step, accum=1):
    x, y = global_batch(step, MICRO * accum * world)
    losses = []
    for a in range(accum):
        rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
        loss = F.mse_loss(engine(x[rows]).float(), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def build_doors(make, world, stage, optimizer, config, precision=None, cast=None):
    """The engine over `make()` and, from the same weights, `train_step`'s state and step
    (its loss: mean squared error of the model's output on `x` cast to `cast`)."""
    torch.manual_seed(0)
    engine = fzero.shard(make(), optimizer=optimizer, config=config)
    torch.manual_seed(0)
    model = make()
    plan = _plan(model, world, stage)
    state = fzero.init(model, plan, optimizer, precision=precision or "fp32", config=config)

    def loss_fn(params, batch):
        x, y = batch
        x = x.to(cast) if cast is not None else x
        out = torch.func.functional_call(model, params, (x,))
        return F.mse_loss(out.float(), y)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    return engine, model, state, step


def both_doors(engine, step, state, rank, world, accum, steps=3):
    """`steps` steps of the engine and of train_step on the same micro-batches: both
    losses per micro-step, and the final state."""
    engine_losses, step_losses = [], []
    for i in range(steps):
        x, y = global_batch(i, MICRO * accum * world)
        for a in range(accum):
            rows = slice((a * world + rank) * MICRO, (a * world + rank + 1) * MICRO)
            loss = F.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            engine.step()
            state, metrics = step(state, (x[rows], y[rows]))
            engine_losses.append(loss.item())
            step_losses.append(metrics["loss"].item())
    return engine_losses, step_losses, state


def doors_case(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per (stage, accum, clip, offload, optimizer): the engine and train_step on the
    same micro-batches, with bf16 masters and states, and what the engine holds."""
    results = {}
    for stage, accum, clip, offload, name in cases:
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        config = _config(stage, accum, clip, **zero)
        optimizer = getattr(fzero.optim, name)(lr=LR, weight_decay=DECAY)
        precision = fzero.Precision("bf16", master="bf16", states="bf16")
        engine, model, state, step = build_doors(
            Net, world, stage, optimizer, config, precision, cast=torch.bfloat16
        )
        engine_losses, step_losses, state = both_doors(engine, step, state, rank, world, accum)
        rt = engine.units[0]
        held = {
            "master": str(rt.master.dtype),
            "moments": sorted(
                {
                    str(getattr(u.optim, k).dtype)
                    for u in state.units
                    for k in ("exp_avg", "exp_avg_sq")
                    if hasattr(u.optim, k)
                }
            ),
            # in memory, a whole unit's master is a view of its bf16 parameters
            "held_once": rt.full is None
            or rt.master.data_ptr() == rt.full[engine.partition(rt.unit)].data_ptr(),
        }
        held["planned"] = engine.memory_held() == engine.memory_planned()
        results[(stage, accum, clip, offload, name)] = {
            "losses": (engine_losses, step_losses),
            "skipped": [],
            "engine": engine.state_dict(dtype=torch.float32),
            "step": fzero.state_dict(state, module=model),
            "held": held,
        }
        engine.destroy()
    return results


def test_bf16_masters_and_states_train_alike_at_every_stage_through_both_doors():
    """World 2: stages 0-3 (accumulation and clipping), CPU offload and LAMB — the
    engine and train_step bitwise equal, and every stage the same numbers as stage 0 (the
    rounding draws by position in the unit, not by rank). Masters and moments are bf16;
    in memory the masters are the parameters themselves."""
    cases = [(stage, 2, 0.05, False, "adamw") for stage in range(4)]
    cases += [(2, 1, 0.0, True, "adamw"), (3, 1, 0.0, True, "adamw")]
    cases += [(1, 1, 0.0, False, "lamb"), (3, 1, 0.0, False, "lamb"), (2, 1, 0.0, False, "sgd")]
    results = run_world(doors_case, 2, cases)
    _assert_same(results)
    for case, result in results.items():
        assert result["held"]["master"] == "torch.bfloat16", case
        if case[-1] != "sgd":
            assert result["held"]["moments"] == ["torch.bfloat16"], case
        assert result["held"]["held_once"] or case[3], case  # offload: the master is on the host
        assert result["held"]["planned"] or case[-1] == "sgd", case  # held = the plan's bytes
    base = results[cases[0]]
    for case in cases[1:4]:
        assert results[case]["losses"] == base["losses"], case
        for name, value in base["engine"].items():
            assert torch.equal(results[case]["engine"][name], value), (case, name)
    offload, memory = (
        results[(2, 1, 0.0, True, "adamw")],
        run_world(doors_case, 2, [(2, 1, 0.0, False, "adamw")])[(2, 1, 0.0, False, "adamw")],
    )
    assert offload["losses"] == memory["losses"]  # the host runs the same update


def engine_case(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    optimizer = fzero.optim.adamw(lr=LR, weight_decay=DECAY)
    engine = fzero.shard(Net(), optimizer=optimizer, config=_config(0))
    losses = [_micro(engine, rank, world, s)[0] for s in range(steps)]
    return {"losses": losses, "weights": engine.state_dict(dtype=torch.float32)}


def reference(steps: int) -> dict:
    """Plain PyTorch: a bf16 model; each step torch.optim.AdamW runs over fp32 copies of
    each bf16 weight and its moments, and the results are rounded to bf16 stochastically
    with the seeds fzero documents (`fzero.optim.rounding_seed`: step, tensor, kind; each
    element at its position in the tensor) — no plan, unit or rank in sight."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    named = dict(model.named_parameters())
    moments = {fqn: (torch.zeros_like(p), torch.zeros_like(p)) for fqn, p in named.items()}
    losses = []
    for step in range(1, steps + 1):
        x, y = global_batch(step - 1, MICRO)
        loss = F.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        for fqn, param in named.items():
            weight = param.detach().float().requires_grad_()
            weight.grad = param.grad.float()
            adamw = torch.optim.AdamW([weight], lr=LR, weight_decay=DECAY)
            if step > 1:
                adamw.state[weight] = {
                    "step": torch.tensor(float(step - 1)),
                    "exp_avg": moments[fqn][0].float(),
                    "exp_avg_sq": moments[fqn][1].float(),
                }
            adamw.step()
            new = (
                weight.detach(),
                adamw.state[weight]["exp_avg"],
                adamw.state[weight]["exp_avg_sq"],
            )
            with torch.no_grad():
                for kind, (value, into) in enumerate(zip(new, (param, *moments[fqn]))):
                    flat = value.reshape(-1).contiguous()
                    into.copy_(
                        bf16_stochastic(flat, rounding_seed(step, fqn, kind)).view(into.shape)
                    )
    return {"losses": losses, "weights": {k: v.float() for k, v in model.state_dict().items()}}


def test_bf16_masters_and_states_match_a_plain_pytorch_reference():
    """World 1: torch.optim.AdamW over fp32 copies, rounded with the documented seeds.
    fzero's native Adam kernel and torch's may differ in the last fp32 bit, which can
    send a stochastic rounding the other way, and a moment rounded the other way moves
    the later steps (by up to the learning rate where a moment is near zero): under 5%
    of the weights differ at all after 5 steps (2.8% here; seeds drawn any other way
    move about three quarters of them)."""
    steps = 5
    ours = run_world(engine_case, 1, steps)
    theirs = reference(steps)
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-2, atol=0
    )
    assert ours["losses"][0] == theirs["losses"][0]
    differ = sum(int((ours["weights"][k] != v).sum()) for k, v in theirs["weights"].items())
    total = sum(v.numel() for v in theirs["weights"].values())
    assert differ < total * 0.05, (differ, total)


def strategies_case(rank: int, world: int, cases: list[tuple]) -> dict:
    from fzero.core import apply

    results = {}
    whole = apply.WIDENED_PIECE
    for stage, strategy, *piece in cases:
        apply.WIDENED_PIECE = piece[0] if piece else whole
        torch.manual_seed(0)
        optimizer = fzero.optim.adamw(lr=LR, weight_decay=DECAY)
        engine = fzero.shard(
            Net(), optimizer=optimizer, config=_config(stage),
            strategy=getattr(fzero.partition, strategy),
        )  # fmt: skip
        losses = [_micro(engine, rank, world, s)[0] for s in range(3)]
        weights = engine.state_dict(dtype=torch.float32)
        results[(stage, strategy, *piece)] = {"losses": losses, "weights": weights}
        engine.destroy()
    apply.WIDENED_PIECE = whole
    return results


def test_bf16_rounding_is_the_same_whatever_the_plan():
    """The seeds follow each tensor, not the unit layout: tensors cut into rows and
    interleaved (`per_tensor_dim0`), whole on owners (`whole_tensors`) or flat
    (`flat_even`), at stages 1 and 3, give the same bf16 weights and losses, bit for bit;
    so do updates widened to fp32 a few elements at a time (`WIDENED_PIECE`), which
    large units take."""
    cases = [(3, "flat_even"), (3, "per_tensor_dim0"), (3, "whole_tensors"), (1, "flat_even"),
             (3, "flat_even", 7), (1, "flat_even", 64)]  # fmt: skip
    results = run_world(strategies_case, 2, cases)
    base = results[cases[0]]
    for case in cases[1:]:
        assert results[case]["losses"] == base["losses"], case
        for name, value in base["weights"].items():
            assert torch.equal(results[case]["weights"][name], value), (case, name)


def small_updates_case(rank: int, world: int, master: str) -> list[float]:
    """SGD on a constant gradient (2^-6 everywhere) at lr 2^-5: each step is 2^-11."""
    model = nn.Linear(64, 64, bias=False)
    nn.init.ones_(model.weight)
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": master == "bf16"}
    engine = fzero.shard(model, optimizer=fzero.optim.sgd(lr=2**-5), config=_config(2, bf16=bf16))
    for _ in range(64):
        out = engine(torch.ones(MICRO, 64))
        engine.backward(out.float().sum() / (MICRO * 64))
        engine.step()
    weights = engine.state_dict(dtype=torch.float32)  # on rank 0
    return weights["weight"].reshape(-1).tolist() if rank == 0 else []


def test_bf16_masters_keep_updates_smaller_than_half_a_bf16_step():
    """Each step moves every weight by 2^-11 below 1.0, an eighth of bf16's spacing there
    (2^-8): round-to-nearest would keep 1.0 for ever; stochastic rounding moves the
    weights by the right amount on average (fp32 masters: exactly)."""
    expected = 1.0 - 64 * 2**-11
    fp32 = torch.tensor(run_world(small_updates_case, 2, "fp32"))
    assert torch.equal(fp32, torch.full_like(fp32, expected))
    bf16 = torch.tensor(run_world(small_updates_case, 2, "bf16"))
    assert (bf16 < 1.0).float().mean() > 0.99 and (bf16 > 0.9).all()
    assert abs(bf16.mean().item() - expected) < 0.05 * (1.0 - expected)


def checkpoint_case(rank: int, world: int, root: str, masters: str, load_from: str | None):
    """3 steps (then a save) and 2 more; or a new engine loading `load_from` and 2 steps."""
    torch.manual_seed(0)
    bf16 = BOTH if masters == "bf16" else {"enabled": True}
    config = _config(2, bf16=bf16)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    saved = None
    if load_from is None:
        for s in range(3):
            _micro(engine, rank, world, s)
        engine.save_checkpoint(root, tag="t")
    else:
        engine.load_checkpoint(load_from, tag="t")
    saved = engine.state_dict(dtype=torch.float32)
    losses = [_micro(engine, rank, world, s)[0] for s in range(3, 5)]
    dtypes = {}
    if load_from is None and rank == 0:
        path = os.path.join(root, "t")
        name = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
        with safe_open(os.path.join(path, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle)
                dtypes.setdefault(key.split("/")[0], set()).add(str(f.get_slice(key).get_dtype()))
    return {"saved": saved, "losses": losses, "dtypes": dtypes}


def test_bf16_states_checkpoint_in_their_own_dtype_resume_bitwise_and_load_across():
    """A bf16 run's checkpoint holds its masters and moments as bf16 (8 bytes per element
    with Adam, not 12); it resumes bitwise; an fp32-master run loads it exactly (every
    bf16 value is an fp32 one), and a bf16 run loads an fp32 checkpoint rounded to
    nearest."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "bf16"), os.path.join(tmp, "fp32")
        first = run_world(checkpoint_case, 2, a, "bf16", None)
        bf16 = {"BF16"}
        assert first["dtypes"] == {"master": bf16, "optim.exp_avg": bf16, "optim.exp_avg_sq": bf16}
        resumed = run_world(checkpoint_case, 2, tmp + "/unused", "bf16", a)
        assert resumed["losses"] == first["losses"]
        into_fp32 = run_world(checkpoint_case, 2, tmp + "/unused", "fp32", a)
        for name, value in first["saved"].items():
            assert torch.equal(into_fp32["saved"][name], value), name
        fp32 = run_world(checkpoint_case, 2, b, "fp32", None)
        into_bf16 = run_world(checkpoint_case, 2, tmp + "/unused", "bf16", b)
        for name, value in fp32["saved"].items():
            assert torch.equal(into_bf16["saved"][name], value.to(torch.bfloat16).float()), name


def test_bf16_precision_errors_name_the_value():
    with pytest.raises(ValueError, match=r"precision master is 'bf16' but compute is 'fp16'"):
        fzero.Precision("fp16", master="bf16").check()
    with pytest.raises(ValueError, match=r"precision states is 'fp8'; allowed: \['bf16', 'fp32'\]"):
        fzero.Precision("bf16", states="fp8").check()


def returned_state_case(rank: int, world: int) -> dict:
    from fzero.core import apply

    whole, results = apply.WIDENED_PIECE, {}
    masters_only = {"enabled": True, "bf16_master_weights_and_grads": True}
    sgd = fzero.optim.sgd(lr=LR, momentum=0.9)

    def update_(grad, state, param, **overrides):  # the momentum returned anew, not in place
        return sgd.update_(grad, state._replace(momentum_buffer=state.momentum_buffer.clone()),
                           param, **overrides)  # fmt: skip

    for name, optimizer in (
        ("in place", sgd),
        ("returned", sgd._replace(update_=update_, native=None)),
    ):
        apply.WIDENED_PIECE = 7
        torch.manual_seed(0)
        engine = fzero.shard(Net(), optimizer=optimizer, config=_config(3, bf16=masters_only))
        losses = [_micro(engine, rank, world, s)[0] for s in range(3)]
        results[name] = (losses, engine.state_dict(dtype=torch.float32))
        engine.destroy()
    apply.WIDENED_PIECE = whole
    return results


def test_a_state_the_update_returns_anew_is_kept_in_pieces():
    """A bf16 master beside fp32 momentum, updated in pieces: an optimizer whose `update_`
    returns its state's tensors anew (not in place) trains as the in-place one does."""
    got = run_world(returned_state_case, 1)
    assert got["returned"][0] == got["in place"][0]
    for name, value in got["in place"][1].items():
        assert torch.equal(got["returned"][1][name], value), name
