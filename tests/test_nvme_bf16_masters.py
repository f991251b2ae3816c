"""bf16 masters and gradient sums in the NVMe swap file (`bf16.bf16_master_weights_and_grads`,
`data_types.grad_accum_dtype` "bf16", with `offload_optimizer.device` "nvme"): the file
keeps each in 2 bytes per element, and a run trains bit for bit as the same plan with
them in host memory (the step rounds each updated master stochastically from the same
seed; each micro-step's sum is rounded to nearest as a bf16 accumulator's `add_` rounds
it), whole units or in sub-group pieces, at stages 2 and 3; its checkpoints keep them
in bf16, resume exactly and load into the in-memory run."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import safetensors
import torch

import fzero
from tests._dist import run_world
from tests.test_sub_groups import MICRO, Wide, _micro_step

STEPS, SAVE_AFTER = 5, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(
    where: str, stage: int, sub_group: int, bf16_states: bool, swap: str, grads: str = "fp32"
) -> dict:
    """`grads`: "fp32", "bf16" (in the file) or "bf16 in memory" (beside it:
    `offload_optimizer.swap_gradients` false)."""
    offload = {"device": where, "nvme_path": swap, "commit": "in_place"}
    if grads == "bf16 in memory":
        grads, offload["swap_gradients"] = "bf16", False
    zero = {
        "stage": stage,
        "sub_group_size": sub_group,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": offload if where == "nvme" else {"device": where},
    }
    if stage == 3 and where == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.05,
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": bf16_states,
        },
        "aio": {"block_size": 8192, "thread_count": 2},
        "zero_optimization": zero,
        "data_types": {"grad_accum_dtype": grads},
        "gradient_accumulation_steps": 2 if grads == "bf16" else 1,
    }


def _engine(config: dict, optim: str = "adamw"):
    torch.manual_seed(0)
    return fzero.shard(Wide(), optimizer=getattr(fzero.optim, optim)(lr=1e-2), config=config)


def train(rank, world, where, stage, sub_group, bf16_states, swap, root, grads="fp32", pure=False):
    """`STEPS` steps with a checkpoint after step `SAVE_AFTER`; then a new engine (the
    same config) and one keeping the masters in host memory each load it and take the
    last steps again. Also whether every master at rest is a bf16 value, the swap file's
    bytes and the dtype the checkpoint keeps the masters in. With bf16 gradient sums, two
    micro-steps per step: `STEPS` micro-steps, the checkpoint mid-window. `pure`: the
    update without native kernels (none writes the parameters' copy)."""
    patch = mock.patch.object(fzero.native, "available", lambda device=None: False)
    with patch if pure else contextlib.nullcontext():
        return _train(rank, world, where, stage, sub_group, bf16_states, swap, root, grads)


def _train(rank, world, where, stage, sub_group, bf16_states, swap, root, grads):
    config = _config(where, stage, sub_group, bf16_states, swap, grads)
    engine = _engine(config)
    losses = []
    for step in range(STEPS):
        losses.append(_micro_step(engine, rank, world, step))
        if step == SAVE_AFTER:
            engine.save_checkpoint(root, tag="t")
            saved = engine.state_dict(dtype=torch.float32)
    state = engine.state_dict(dtype=torch.float32)
    consolidated = dict(fzero.checkpoint.iter_consolidated(root, "t"))  # bf16 masters widened
    consolidated_equal = all(torch.equal(consolidated[k], v) for k, v in saved.items())
    masters_bf16, swap_bytes = True, 0
    if where == "nvme":
        residency = engine.runtime.residency
        file_dtypes = (residency.master_dtype, residency.grad_dtype, len(engine.units))
        swap_bytes = engine.nvme.nbytes, *file_dtypes
        for index in range(len(engine.units)):
            with engine.train_state.residence.resident(index) as unit:
                masters_bf16 &= torch.equal(unit.master.to(torch.bfloat16).float(), unit.master)
    with safetensors.safe_open(f"{root}/t/rank{rank:05d}.safetensors", "pt") as f:
        kinds = ("master/", "grad/")  # the accumulators mid-window only
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if k.startswith(kinds)}  # noqa: SIM118
    resumed = {}
    for again in (where, "cpu"):
        engine = _engine(_config(again, stage, sub_group, bf16_states, swap, grads))
        engine.load_checkpoint(root, tag="t")
        steps = range(SAVE_AFTER + 1, STEPS)
        resumed[again] = [_micro_step(engine, rank, world, step) for step in steps]
    return losses, state, masters_bf16, swap_bytes, (dtypes, consolidated_equal), resumed


@pytest.mark.parametrize(
    ("stage", "sub_group", "pure"),
    [(3, 10**9, False), (3, 10**9, True), (3, 4096, False), (2, 4096, True)],
    ids=["stage3-whole-units", "stage3-whole-units-pure", "stage3-pieces", "stage2-pieces-pure"],
)
def test_bf16_masters_in_the_swap_file_train_as_bf16_masters_in_memory(
    stage, sub_group, pure, tmp_path
):
    swap_bytes = _as_in_memory(tmp_path, stage, sub_group, "fp32", pure)
    # in place: master 2 + two fp32 moments 4 + 4, and the fp32 gradient 4 bytes per element
    _check_file(swap_bytes, (torch.bfloat16, torch.float32), 2 + 4 + 4 + 4)


def _as_in_memory(
    tmp_path, stage: int, sub_group: int, grads: str, pure: bool = False, states: bool = False
) -> tuple:
    """The run with the swap file against the one keeping masters (and sums) in host
    memory: the same losses and weights bit for bit; each checkpoint keeps them in bf16;
    the resumed runs (the file's checkpoint into the file and into memory, the in-memory
    run's into memory) take the uninterrupted run's last steps. The file's bytes.
    `states`: bf16 moments too."""
    (tmp_path / "swap").mkdir()
    swap = str(tmp_path / "swap")
    args = (stage, sub_group, states, swap)
    nvme = run_world(train, 2, "nvme", *args, str(tmp_path / "a"), grads, pure)
    host = run_world(train, 2, "cpu", *args, str(tmp_path / "b"), grads, pure)
    losses, state, masters_bf16, swap_bytes, dtypes, resumed = nvme
    assert losses == host[0]
    assert all(torch.equal(state[k], v) for k, v in host[1].items())
    assert masters_bf16 and dtypes == ({"BF16"}, True) == host[4]
    assert resumed["nvme"] == resumed["cpu"] == host[5]["cpu"] == losses[SAVE_AFTER + 1 :]
    return swap_bytes


@pytest.mark.parametrize("grads", ["fp32", "bf16"])
def test_bf16_masters_states_and_sums_in_the_swap_file_train_as_in_memory(grads, tmp_path):
    """bf16 moments too: the file rounds them from the seeds in-memory bf16 moments draw
    (the step, the unit, the moment, the element; not the rank), so everything in bf16
    in the file trains bit for bit as everything in bf16 in host memory."""
    swap_bytes = _as_in_memory(tmp_path, 3, 4096, grads, states=True)
    _check_file(swap_bytes, (torch.bfloat16, DTYPES[grads]), 2 + 2 + 2 + DTYPES[grads].itemsize)


def _check_file(swap: tuple, dtypes: tuple, per_element: int) -> None:
    """The swap file keeps masters and gradient sums in `dtypes` and takes `per_element`
    bytes per element of a rank's half, each of its 4 regions per unit rounded up to 4 KiB."""
    nbytes, master, grad, units = swap
    assert (master, grad) == dtypes
    expected = per_element * -(-sum(p.numel() for p in Wide().parameters()) // 2)
    assert 0 <= nbytes - expected < 4096 * 4 * units, (nbytes, expected)


def lamb(rank, world, swap):
    """LAMB over bf16 masters in the file: the engine, and `train_step` over a state
    `fzero.init` built for AdamW (the step brings its own optimizer)."""
    config = _config("nvme", 3, 10**9, False, swap)
    config["zero_optimization"]["offload_optimizer"]["commit"] = "two_slots"
    messages = []
    try:
        _engine(config, optim="lamb")
    except ValueError as error:
        messages.append(str(error))
    config["zero_optimization"].pop("offload_param")
    model = Wide()
    plan = fzero.partition.plan(fzero.partition.describe(model), world_size=world, stage=3)
    state = fzero.init(model, plan, fzero.optim.adamw(lr=1e-2), precision="bf16", config=config)
    step = fzero.train_step(
        lambda p, b: p["head.bias"].sum(), plan, fzero.optim.lamb(lr=1e-2), config=config
    )
    try:
        step(state, None)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_an_optimizer_that_needs_tensor_norms_is_refused_with_bf16_masters_in_the_file(tmp_path):
    messages = run_world(lamb, 1, str(tmp_path))
    assert len(messages) == 2
    for message in messages:
        assert "memory.master is 'bf16' (DeepSpeed's bf16.bf16_master_weights_and_grads)" in message
        assert "optimizer 'lamb' needs tensor norms" in message
        assert "use fp32 masters, or the optimizer on 'cpu' or the device" in message


def functional(rank, world, where, swap, grads):
    """`fzero.init` + `fzero.train_step` with bf16 masters where `where` says (the
    gradients and stage 3's parameter shards in memory): the losses and the weights."""
    config = _config(where, 3, 4096, False, swap, grads)
    config["zero_optimization"].pop("offload_param", None)
    torch.manual_seed(0)
    model = Wide()
    plan = fzero.partition.plan(
        fzero.partition.describe(model), world_size=world, stage=3, persistence_threshold=0
    )
    optimizer = fzero.optim.adamw(lr=1e-2)
    state = fzero.init(model, plan, optimizer, precision="bf16", config=config)

    def loss_fn(params, batch):
        x, y = batch
        out = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.mse_loss(out.float(), y)

    step = fzero.train_step(loss_fn, plan, optimizer, config=config)
    losses = []
    for i in range(STEPS):
        generator = torch.Generator().manual_seed(i)
        x = torch.randn(MICRO * world, 29, generator=generator)
        y = torch.randn(MICRO * world, 5, generator=generator)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        state, metrics = step(state, (x[rows].bfloat16(), y[rows]))
        losses.append(metrics["loss"].item())
    return (state.residence is not None), losses, fzero.state_dict(state, module=model)


@pytest.mark.parametrize("grads", ["fp32", "bf16"])
def test_the_functional_door_keeps_bf16_masters_in_the_swap_file_as_the_engine_does(
    grads, tmp_path
):
    """`train_step` keeps its gradient sums in memory (bf16 ones too) beside the file."""
    swapped, losses, weights = run_world(functional, 2, "nvme", str(tmp_path), grads)
    in_memory, host_losses, host_weights = run_world(functional, 2, "cpu", str(tmp_path), grads)
    assert swapped and not in_memory
    assert losses == host_losses
    assert all(torch.equal(weights[k], v) for k, v in host_weights.items())


@pytest.mark.parametrize(
    ("stage", "sub_group"), [(3, 4096), (2, 10**9)], ids=["stage3-pieces", "stage2-whole-units"]
)
def test_bf16_gradient_sums_in_the_swap_file_add_up_as_bf16_sums_in_memory(
    stage, sub_group, tmp_path
):
    """Two micro-steps per step, the checkpoint mid-window (its accumulators saved): the
    losses and weights equal the host-memory run's bit for bit, resumes too, and the file
    keeps each accumulator in 2 bytes per element."""
    swap_bytes = _as_in_memory(tmp_path, stage, sub_group, "bf16")
    _check_file(swap_bytes, (torch.bfloat16, torch.bfloat16), 2 + 4 + 4 + 2)


def test_bf16_gradient_sums_kept_in_memory_beside_the_file_checkpoint_as_bf16(tmp_path):
    """`offload_optimizer.swap_gradients` false: the sums stay in memory in bf16 beside
    the file's masters and moments, and a checkpoint mid-window keeps them as they are."""
    swap_bytes = _as_in_memory(tmp_path, 3, 4096, "bf16 in memory")
    _check_file(swap_bytes, (torch.bfloat16, torch.float32), 2 + 4 + 4)
