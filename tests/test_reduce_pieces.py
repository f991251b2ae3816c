"""A unit whose gradient part is larger than `reduce_bucket_size` allows is reduced in
pieces ([Note: gradients reduced in pieces]): its bucket holds the gradients in their
dtype, each piece is widened, reduced and kept at its offset (in memory or in the NVMe
swap file), and training is bit for bit that of whole-unit reductions."""

from __future__ import annotations

import hashlib
from unittest import mock

import pytest
import torch
from torch import nn

import fzero
import fzero.core.reduce
from fzero import partition
from fzero.core.reduce_pieces import PIECE_ALIGN, Pieces, reduction_piece
from fzero.partition import UnitSharding, describe, plan
from tests._dist import run_world

WIDE = 2304  # the head's weight: 2048 x 2304 = 4.7M elements, 2.36M per rank at world 2
WHOLE = 500_000_000  # DeepSpeed's default reduce_bucket_size: no unit is pieced
PIECED = 1  # every unit larger than 2^20 elements per rank is pieced
_FOUR_RANKS = pytest.mark.slow  # four ranks on two cores: `make test-slow`


class Model(nn.Module):
    """Small units, and two whose parts span two and a quarter pieces: `wide` one tensor
    (reduced from its gradient as autograd made it), `back` two (through a bucket)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 2048)
        self.wide = nn.Linear(2048, WIDE, bias=False)
        self.back = nn.Linear(WIDE, 2048)
        self.head = nn.Linear(2048, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.wide(torch.tanh(self.inner(x))))
        return self.head(torch.tanh(self.back(h)))


def _config(stage, bucket, *, nvme=None, precision="bf16", accumulation=2, **more):
    zero = {
        "stage": stage,
        "reduce_bucket_size": bucket,
        "stage3_param_persistence_threshold": 0,
        **more,
    }
    if nvme is not None:
        where = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = where
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.01,  # the clip coefficient is below 1: the norm matters
        "zero_optimization": zero,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _batch(step, rank, world):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(2 * world, 16, generator=generator)
    y = torch.randn(2 * world, 4, generator=generator)
    return x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]


def _digest(tensors):
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _finer(mesh, unit):
    """Optimizer state over every rank, gradients and parameters within `local`."""
    local = mesh.sharding("local")
    return UnitSharding(params=local, grads=local, optimizer=mesh.sharding("local", "node"))


def _node_first(mesh, unit):
    """`_finer` with the optimizer's quarters along ("node", "local"): each rank's in
    another rank's gradient half (the boundary's blocks exchanged)."""
    local = mesh.sharding("local")
    return UnitSharding(params=local, grads=local, optimizer=mesh.sharding("node", "local"))


def engine_case(rank, world, stage, bucket, nvme, precision, zero=None, top=None, finer=False):
    """Two steps of two micro-steps: the losses, the norms, a digest of the weights, and
    which units were pieced with the largest bucket bytes held in backward."""
    torch.manual_seed(0)
    config = _config(stage, bucket, nvme=nvme, precision=precision, **(zero or {}))
    config |= top or {}
    made: list[int] = []  # the bucket buffers' sizes
    new_buffer = fzero.core.reduce.Reduction._new_buffer

    def recorded(self, numel, *args):
        made.append(numel)
        return new_buffer(self, numel, *args)

    with mock.patch.object(fzero.core.reduce.Reduction, "_new_buffer", recorded):
        return _engine_run(rank, world, config, finer) | {"made": sorted(set(made))}


def _engine_run(rank, world, config, finer):
    strategy = None
    if finer:
        rule = _node_first if finer == "node first" else _finer
        preset = partition.Custom("finer optimizer", rule, stage=3)
        strategy = partition.on_mesh(partition.Mesh({"node": 2, "local": 2}), preset)
    optimizer = fzero.optim.adamw(lr=1e-3)
    engine = fzero.shard(Model(), optimizer=optimizer, config=config, strategy=strategy)
    held = []
    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(lambda _: held.append(engine.reduction.held_bytes()))
    losses, norms = [], []
    for step in range(4):
        x, y = _batch(step, rank, world)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % 2 == 1:  # a boundary
            norms.append(float(engine.get_global_grad_norm()))
    state = engine.state_dict(dtype=torch.float32)
    return {
        "losses": losses,
        "norms": norms,
        "weights": _digest(state),
        "pieced": engine.reduction.core.pieced,
        "direct": engine.reduction.core.direct,
        "held": max(held),
        "grad_pool": engine.residency.grad_pool.numel,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_pieces_train_as_whole_units(stage):
    whole = run_world(engine_case, 2, stage, WHOLE, None, "bf16")
    pieced = run_world(engine_case, 2, stage, PIECED, None, "bf16")
    assert pieced["pieced"] == [False, True, True, False]
    assert pieced["direct"] == [False, True, False, False]
    assert whole["pieced"] == whole["direct"] == [False] * 4
    assert pieced["losses"] == whole["losses"]
    assert pieced["norms"] == whole["norms"]
    assert pieced["weights"] == whole["weights"]
    # backward held the large units' gradients in bf16, not in fp32 buckets (two, with
    # overlap_comm at stage 3), and the one-tensor unit's with no bucket of its own
    wide = 2048 * WIDE
    assert whole["held"] >= 4 * wide
    assert pieced["held"] <= 2 * (2 * wide + 2048) + 4 * 4 * PIECE_ALIGN
    assert max(whole["made"]) > 2 * wide and wide not in pieced["made"]
    assert wide + 2048 in pieced["made"]


def test_pieces_train_as_whole_units_with_gradients_on_nvme(tmp_path):
    nvme = str(tmp_path)
    whole = run_world(engine_case, 2, 3, WHOLE, nvme, "bf16")
    pieced = run_world(engine_case, 2, 3, PIECED, nvme, "bf16")
    assert pieced["pieced"] == [False, True, True, False]
    assert (pieced["losses"], pieced["norms"]) == (whole["losses"], whole["norms"])
    assert pieced["weights"] == whole["weights"]
    # backward's gradient writes take piece-sized buffers, not the wide unit's part
    assert pieced["grad_pool"] < whole["grad_pool"] / 2


@pytest.mark.parametrize(
    ("world", "zero", "top", "finer"),
    [
        pytest.param(4, {"mics_shard_size": 2}, {}, False, marks=_FOUR_RANKS),
        pytest.param(4, {}, {}, True, marks=_FOUR_RANKS),
        pytest.param(4, {}, {}, "node first", marks=_FOUR_RANKS),
        (2, {}, {"communication_data_type": "bf16"}, False),
    ],
    ids=["mics-replicas", "optimizer-finer", "optimizer-finer-node-first", "bf16-wire"],
)
def test_pieces_over_groups_with_replicas_and_in_the_wire_dtype(world, zero, top, finer):
    """World 4 as MiCS groups of 2 with replicas (each piece averaged over the group,
    then over its replicas), world 4 with the optimizer split over every rank and the
    gradients within groups of 2 (pieces within the group; the boundary's re-split over
    the other axis; in either order of the optimizer's axes), and at world 2 with the
    gradients on the wire in bf16."""
    whole = run_world(engine_case, world, 3, WHOLE, None, "fp32", zero, top, finer)
    pieced = run_world(engine_case, world, 3, PIECED, None, "fp32", zero, top, finer)
    assert pieced["pieced"] == [False, True, True, False]
    assert (pieced["losses"], pieced["norms"]) == (whole["losses"], whole["norms"])
    assert pieced["weights"] == whole["weights"]


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=_FOUR_RANKS)])
def test_pieces_at_other_world_sizes(world):
    """World 1: pieces with no collective; world 4: each piece reduced over four ranks
    (fp32, whose sums of four may round in another order than the whole unit's)."""
    whole = run_world(engine_case, world, 3, WHOLE, None, "fp32")
    pieced = run_world(engine_case, world, 3, PIECED, None, "fp32")
    parts = 2048 * WIDE // world
    assert pieced["pieced"] == [False, *[parts > PIECE_ALIGN] * 2, False]
    if world == 1:
        assert (pieced["losses"], pieced["weights"]) == (whole["losses"], whole["weights"])
    else:
        assert pieced["losses"] == pytest.approx(whole["losses"], rel=1e-6)
        assert pieced["norms"] == pytest.approx(whole["norms"], rel=1e-6)


def functional_case(rank, world, bucket):
    """`fzero.train_step` at stage 3, two micro-steps a step: losses, norms and a digest
    of the masters."""
    torch.manual_seed(0)
    model = Model()
    config = _config(3, bucket, precision="fp32")
    the_plan = plan(describe(model), world_size=world, stage=3, persistence_threshold=0)
    optimizer = fzero.optim.adamw(lr=1e-3)
    state = fzero.init(model, the_plan, optimizer, config=config)

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = fzero.train_step(loss_fn, the_plan, optimizer, config=config)
    losses, norms, made = [], [], []

    class Counted(Pieces):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    for i in range(4):
        with mock.patch.object(fzero.core.reduce, "Pieces", Counted):
            state, metrics = step(state, _batch(i, rank, world))
        losses.append(metrics["loss"].item())
        if i % 2 == 1:  # a boundary
            norms.append(float(metrics["grad_norm"]))
    masters = {str(i): unit.master for i, unit in enumerate(state.units)}
    return losses, norms, _digest(masters), len(made)


def test_the_functional_door_reduces_in_pieces_as_whole_units():
    *pieced, chains = run_world(functional_case, 2, PIECED)
    *whole, none = run_world(functional_case, 2, WHOLE)
    assert (chains, none) == (8, 0)  # two pieced units, each micro-step
    assert pieced == whole


def test_the_piece_size():
    """reduce_bucket_size over the gradients' ranks, rounded down to 2^20, at least 2^20."""
    the_plan = plan(describe(Model()), world_size=2, stage=3)
    assert reduction_piece(the_plan, 1) == PIECE_ALIGN
    assert reduction_piece(the_plan, 5_000_000) == 2 * PIECE_ALIGN
    assert reduction_piece(the_plan, WHOLE) == WHOLE // 2 // PIECE_ALIGN * PIECE_ALIGN


def failing_pieces_case(rank, world, nvme, fail):
    """Gradients on NVMe, pieced: with `fail`, rank 1's third gradient write (a piece of
    a unit) of micro-step 3 fails, and the dropped window is run again."""
    from tests._dist import failing_at_write

    torch.manual_seed(0)
    config = _config(3, PIECED, nvme=nvme)
    engine = fzero.shard(Model(), optimizer=fzero.optim.adamw(lr=1e-3), config=config)

    def micro(step):
        x, y = _batch(step, rank, world)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = [micro(step) for step in range(3)]  # micro-step 2 opens a window
    if not fail:
        losses += [micro(step) for step in range(3, 6)]
        return "not failed", losses, _digest(engine.state_dict(dtype=torch.float32))
    message = failing_at_write(engine, 3 if rank == 1 else -1, lambda: micro(3))
    losses += [micro(step) for step in range(2, 6)]  # the dropped window again, then on
    return message, losses, _digest(engine.state_dict(dtype=torch.float32))


def test_a_failed_piece_write_drops_the_window_on_every_rank(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    message, losses, weights = run_world(failing_pieces_case, 2, str(tmp_path / "a"), True)
    assert "gradients of this accumulation window were dropped" in message
    assert "rank 1: " in message and "No space left on device" in message
    _, reference, expected = run_world(failing_pieces_case, 2, str(tmp_path / "b"), False)
    assert losses[:3] == reference[:3]  # micro-step 2's first run, dropped, as it was
    assert losses[3:] == reference[2:]
    assert weights == expected


def scattered_case(rank, world, bucket):
    """`engine_case` at stage 3 on the reduce-scatter path NCCL takes (gloo's
    reduce-scatter collective instead of its all-reduce: `tests/test_scatter_path.py`)."""
    from tests.test_scatter_path import reduce_scattered

    with reduce_scattered():
        return engine_case(rank, world, 3, bucket, None, "fp32")


def test_pieces_on_the_reduce_scatter_path_train_as_whole_units():
    whole = run_world(scattered_case, 2, WHOLE)
    pieced = run_world(scattered_case, 2, PIECED)
    assert pieced["pieced"] == [False, True, True, False]
    assert (pieced["losses"], pieced["norms"]) == (whole["losses"], whole["norms"])
    assert pieced["weights"] == whole["weights"]
