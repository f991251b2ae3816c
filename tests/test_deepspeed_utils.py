"""`deepspeed.utils`, `deepspeed.zero` and `deepspeed.moe.utils` as clients call them:
the `safe_get/set_full_*` accessors against plain torch, ZeRO-3's parameter attributes,
`register_external_parameter`, `zero_to_fp32` on fzero checkpoints, the MoE helpers on
models without MoE layers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fzero
from fzero.compat.deepspeed.moe import utils as moe_utils
from fzero.compat.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    zero_to_fp32,
)
from fzero.compat.zero import ZeroParamStatus, register_external_parameter
from tests._dist import run_world
from tests.models import Awkward, Net, global_batch

MICRO, LR = 2, 1e-2


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def accessors_case(rank, world, stage, zero):
    torch.manual_seed(0)
    engine, *_ = fzero.initialize(model=Net(), config=_config(stage, **zero))
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in range(3):
        x, y = global_batch(step, MICRO * world)
        engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        if step == 2:  # between the boundary's backward and the step
            grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        engine.step()
    named = dict(engine.module.named_parameters())
    params = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
    moments = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named.items()}
    with pytest.raises(KeyError, match="'momentum_buffer' is not held"):
        safe_get_full_optimizer_state(named["head.bias"], "momentum_buffer")
    safe_set_full_fp32_param(named["head.bias"], torch.full((3,), 0.25))
    after = engine.state_dict()
    return grads, params, moments, after


@pytest.mark.parametrize(
    ("stage", "world", "zero"),
    [(1, 2, {}), (3, 2, {}), (3, 4, {"mics_shard_size": 2})],  # MiCS: shards over 2 of 4
    ids=["stage1", "stage3", "mics"],
)
def test_safe_get_full_accessors_equal_plain_torch(stage, world, zero):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(3):
        x, y = global_batch(step, MICRO * world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 2:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    got_grads, params, moments, after = run_world(accessors_case, world, stage, zero)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moments[name], opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
    assert torch.equal(after["head.bias"], torch.full((3,), 0.25))
    assert safe_get_full_fp32_param(nn.Parameter(torch.ones(2))) is None  # no engine


class Tied(nn.Module):
    """Uses a weight another module holds (as Transformers' weight-norm convolutions
    do), registered as external so ZeRO-3 gathers it whenever this module runs."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self._weight = [weight]  # not a parameter of this module
        register_external_parameter(self, weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self._weight[0]


class External(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 7)
        self.head = Tied(self.embed.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def zero3_params_case(rank, world):
    torch.manual_seed(0)
    model = External()
    engine, *_ = fzero.initialize(model=model, config=_config(3))
    weight = model.embed.weight
    seen = {
        "shape": (weight.ds_shape, weight.ds_numel, weight.ds_persist),
        "released": weight.ds_status,
        "data": tuple(weight.shape),
    }
    with fzero.zero.GatheredParameters([weight]):
        seen["gathered"] = weight.ds_status
    seen["ids"] = len({p.ds_id for p in model.parameters()})
    with pytest.raises(RuntimeError, match="after the ZeRO-3 engine was built"):
        register_external_parameter(model.head, weight)
    x = global_batch(0, 2 * world)[0][rank * 2 : rank * 2 + 2, :5]
    out = model.head(torch.tanh(x @ torch.ones(5, 7)))  # run alone: gathers embed.weight
    seen["head_alone"] = tuple(out.shape)
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE  # released after it
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return seen, engine.state_dict()


def test_zero3_parameters_carry_deepspeeds_attributes_and_external_ones_are_gathered():
    seen, state = run_world(zero3_params_case, 2)
    assert seen["shape"] == (torch.Size([7, 5]), 35, False)
    assert seen["released"] is ZeroParamStatus.NOT_AVAILABLE and seen["data"] == (0,)
    assert seen["gathered"] is ZeroParamStatus.AVAILABLE
    assert seen["ids"] == 2 and seen["head_alone"] == (2, 5)
    assert set(state) == {"embed.weight", "embed.bias"}


class _SavesWeight(torch.autograd.Function):
    """`h @ w.T` saving the weight itself, reading `ds_status` in backward and gathering
    by it, as TRL's chunked log-prob Function does."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        status = getattr(w, "ds_status", None)  # None below stage 3
        with fzero.zero.GatheredParameters([w] if status is ZeroParamStatus.NOT_AVAILABLE else []):
            _SavesWeight.seen.append((status, getattr(w, "ds_shape", None), tuple(w.shape)))
            return grad @ w, grad.t() @ h


class HeadByFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        with fzero.zero.GatheredParameters([self.head.weight]):
            return _SavesWeight.apply(h, self.head.weight)


def saved_weight_case(rank, world, stage):
    torch.manual_seed(0)
    _SavesWeight.seen = []
    engine, *_ = fzero.initialize(model=HeadByFunction(), config=_config(stage))
    x = global_batch(0, 2 * world)[0][rank * 2 : rank * 2 + 2, :5]
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    plain = torch.ones(3)
    with pytest.raises(AttributeError, match="'Tensor' object has no attribute 'ds_status'"):
        plain.ds_status  # noqa: B018 - a tensor that is no parameter's has none
    return _SavesWeight.seen, engine.state_dict()


def test_a_function_that_saved_a_zero3_weight_reads_its_attributes_in_backward():
    """fzero's stage-3 saved-tensor hook gathers a saved weight again in backward, and
    torch hands the Function a new tensor over it (DeepSpeed hands the parameter): it
    answers `ds_status` and `ds_shape` as the parameter, and training matches stage 0."""
    seen, state = run_world(saved_weight_case, 2, 3)
    _, reference = run_world(saved_weight_case, 2, 0)
    assert seen == [(ZeroParamStatus.AVAILABLE, torch.Size([3, 7]), (3, 7))]
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)


def checkpoint_case(rank, world, tmp, stage=2):
    torch.manual_seed(0)
    engine, *_ = fzero.initialize(model=Awkward(), config=_config(stage))
    x = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(tmp, tag="t1")
    return engine.state_dict(dtype=torch.float32)


def test_zero_to_fp32_reads_fzero_checkpoints(tmp_path):
    state = run_world(checkpoint_case, 2, str(tmp_path))
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert got.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(got[name], value), name
    without = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        tmp_path, "t1", exclude_frozen_parameters=True
    )
    assert set(got) - set(without) == {"frozen.weight", "frozen.bias"}
    out = tmp_path / "fp32"
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path, out, max_shard_size=None)
    written = load_file(out / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in got.items())
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(Awkward(), tmp_path)
    assert torch.equal(model.head.weight, got["head.weight"])
    with pytest.raises(ValueError, match="Unable to find 'latest'"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "fp32")
    with pytest.raises(NotImplementedError, match="hold no pickle"):
        zero_to_fp32.get_optim_files(str(tmp_path))
    half = tmp_path / "fp16"
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(tmp_path, half, "torch.float16")
    written = load_file(half / "model.safetensors")
    assert all(torch.equal(written[k], v.half()) for k, v in got.items() if v.is_floating_point())
    with pytest.raises(ValueError, match=r"output dtype 'int8' is not supported; allowed: "):
        zero_to_fp32.convert_zero_checkpoint_to_state_dict(tmp_path, half, "int8")


def test_save_checkpoint_writes_deepspeeds_conversion_scripts_that_run(tmp_path):
    """A ZeRO checkpoint's directory holds `zero_to_fp32.py` and `zero_to_torch.py`, as
    DeepSpeed's does: run from anywhere they write the model (fp32; `--dtype bf16`), and
    `import zero_to_fp32` in the directory gives the converter's functions. A stage-0
    fp32 run's has none (DeepSpeed writes them with ZeRO or bf16 checkpoints)."""
    import subprocess
    import sys

    state = run_world(checkpoint_case, 2, str(tmp_path))
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (tmp_path / name).stat().st_mode & 0o100, name  # executable
    runs = (
        [str(tmp_path / "zero_to_fp32.py"), str(tmp_path), str(tmp_path / "fp32")],
        [str(tmp_path / "zero_to_torch.py"), str(tmp_path), str(tmp_path / "bf16"), "--dtype",
         "bf16", "-t", "t1"],
        ["-c", "import zero_to_fp32; zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict("
         "'.', 'imported', safe_serialization=True)"],
    )  # fmt: skip
    for argv in runs:
        done = subprocess.run(
            [sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    for out, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("imported", None)):
        written = load_file(tmp_path / out / "model.safetensors")
        assert written.keys() == state.keys()
        for key, value in state.items():
            expected = value.to(dtype) if dtype and value.is_floating_point() else value
            assert torch.equal(written[key], expected), (out, key)
    plain = tmp_path / "stage0"
    run_world(checkpoint_case, 2, str(plain), 0)
    assert sorted(p.name for p in plain.iterdir()) == ["latest", "t1"]


def test_moe_helpers_leave_groups_of_a_model_without_experts_as_they_are():
    model = Net()
    groups = [{"params": model.embed.parameters(), "weight_decay": 0.1}]
    same = moe_utils.split_params_into_different_moe_groups_for_optimizer(groups)
    assert same is groups and same[0]["params"] == list(model.embed.parameters())
    assert moe_utils.split_params_into_different_moe_groups_for_optimizer({"params": []}) == [
        {"params": []}
    ]
    expert = nn.Parameter(torch.ones(4, 2))
    expert.allreduce = False
    assert moe_utils.is_moe_param(expert) and not moe_utils.is_moe_param(model.head.weight)
    with pytest.raises(NotImplementedError, match=r"1 expert \(MoE\) parameters.*shape \(4, 2\)"):
        moe_utils.split_params_into_different_moe_groups_for_optimizer([{"params": [expert]}])
