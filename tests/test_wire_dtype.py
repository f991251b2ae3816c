"""DeepSpeed's `communication_data_type`: gradients reduced in bf16 or fp16 on the wire
(half the bytes, counted as `comm_volume` predicts), both doors alike and within the
wire dtype's rounding of a single-process torch.optim run; `data_types.grad_accum_dtype`
read (its half dtypes: tests/test_grad_accum_dtype.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import partition
from fzero.config import ConfigError, load_config
from tests._dist import run_world
from tests.models import Net, global_batch

MICRO, STEPS, LR = 2, 3, 1e-2


def _config(stage: int, wire: str | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
        },
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    if wire is not None:
        config["communication_data_type"] = wire
    return config


def _case(rank: int, world: int, stage: int, wire: str | None) -> dict:
    from fzero import comm

    config = _config(stage, wire)
    torch.manual_seed(0)
    engine = fzero.shard(Net(), optimizer=fzero.optim.adamw(lr=LR), config=config)
    torch.manual_seed(0)
    model = Net()
    plan = partition.plan(
        partition.describe(model), world_size=world, stage=stage, persistence_threshold=0
    )
    optimizer = fzero.optim.adamw(lr=LR)
    state = fzero.init(model, plan, optimizer, config=config)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    sent = {}
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        before = comm.traffic()
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        after = comm.traffic()
        sent = {op: after[op][1] - before.get(op, (0, 0))[1] for op in after}
        state, _ = step(state, (x[rows], y[rows]))
    predicted = {}
    for row in engine.comm_volume():
        predicted[row.operation] = predicted.get(row.operation, 0) + row.bytes
    return {
        "engine": engine.state_dict(dtype=torch.float32),
        "functional": fzero.state_dict(state),
        "sent": {op: size for op, size in sent.items() if size},
        "predicted": predicted,
    }


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for i in range(STEPS):
        x, y = global_batch(i, MICRO * 2)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_travel_in_bf16_at_half_the_bytes(stage):
    bf16 = run_world(_case, 2, stage, "bf16")
    fp32 = run_world(_case, 2, stage, None)
    assert bf16["sent"] == bf16["predicted"] and fp32["sent"] == fp32["predicted"]
    gradient_op = "all_reduce"  # gloo reduces every bucket by all-reduce
    # the gradients' share halves; norms, flags and parameters are unchanged
    halved = fp32["predicted"][gradient_op] - bf16["predicted"][gradient_op]
    grads_fp32 = sum(
        r.bytes
        for r in partition.comm_volume(
            partition.plan(
                partition.describe(Net()), world_size=2, stage=stage, persistence_threshold=0
            ),
            bucket_numel=300,
            scatter_as_all_reduce=True,
        )
        if r.what == "gradients"
    )
    assert halved == grads_fp32 // 2
    reference = _reference()
    for name, expected in reference.items():
        assert torch.equal(bf16["engine"][name], bf16["functional"][name]), name
        error = ((bf16["engine"][name] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 2e-2, (name, error)  # bf16's rounding of each rank's gradient
        exact = ((fp32["engine"][name] - expected).abs().max() / expected.abs().max()).item()
        assert exact <= 1e-6, (name, exact)


def test_the_dtype_keys_are_read_and_refused_by_name():
    assert load_config({"communication_data_type": "fp16"}).communication_data_type == "fp16"
    assert (
        load_config({"data_types": {"grad_accum_dtype": None}}).data_types.grad_accum_dtype is None
    )
    with pytest.raises(ConfigError, match=r"'data_types\.grad_accum_dtype' is 'bf16' but 'bf16"):
        load_config({"data_types": {"grad_accum_dtype": "bf16"}})  # with bf16 off
    with pytest.raises(ConfigError, match="'communication_data_type' is 'fp8'; allowed"):
        load_config({"communication_data_type": "fp8"})
    with pytest.raises(ConfigError, match="qgZ sends its own int8 or int4 codes"):
        load_config(
            {
                "communication_data_type": "bf16",
                "zero_optimization": {"stage": 2, "zero_quantized_gradients": True},
            }
        )
