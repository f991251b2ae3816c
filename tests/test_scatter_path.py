"""The reduce-scatter path NCCL runs, run on gloo.

On gloo a reduce-scatter is done as an all-reduce of which each rank keeps its part
(`fzero.core.reduce_bucket.scatter_by_all_reduce`: gloo's reduce-scatter measured slower), so the
path every other backend takes — one reduce-scatter per unit into the rank's shard — is
not what the CPU tests run. gloo has a reduce-scatter too: these cases turn the
all-reduce off in the rank processes and check the path against a single-process
torch.optim run, as the parity tests check the gloo path."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch

import fzero
from fzero import partition
from tests._dist import run_world
from tests.models import Net, param_groups, parity_config, torch_reference, train_engine

pytestmark = pytest.mark.slow  # launched runs: the slow job (make test stays under 10 minutes)

MICRO, STEPS, LR = 2, 4, 1e-2
STRATEGIES = {
    "flat_even": partition.flat_even,
    "per_tensor_dim0": partition.per_tensor_dim0,
    "whole_tensors": partition.whole_tensors,
}


@contextlib.contextmanager
def reduce_scattered() -> Iterator[None]:
    """Within: every door reduce-scatters as on NCCL (gloo's reduce-scatter collective)."""
    from fzero.core import reduce_bucket, reduce_pieces
    from fzero.engine import _views

    modules = (reduce_bucket, reduce_pieces, _views)
    saved = [module.scatter_by_all_reduce for module in modules]
    for module in modules:
        module.scatter_by_all_reduce = lambda: False
    try:
        yield
    finally:
        for module, function in zip(modules, saved):
            module.scatter_by_all_reduce = function


def train_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    results = {}
    with reduce_scattered():
        for stage, accum, clip, strategy in cases:
            torch.manual_seed(0)
            model = Net()
            engine = fzero.shard(
                model,
                stage=stage,
                optimizer=fzero.optim.adamw(lr=LR, weight_decay=0.01),
                config=parity_config(MICRO, accum, clip),
                param_groups=param_groups(model),
                strategy=STRATEGIES[strategy],
            )
            traffic = fzero.comm.traffic()
            losses = train_engine(engine, rank, world, steps=STEPS, micro=MICRO)
            sent = fzero.comm.traffic()
            scatters = (
                sent.get("reduce_scatter", (0, 0))[0] - traffic.get("reduce_scatter", (0, 0))[0]
            )
            state = engine.state_dict(dtype=torch.float32)
            engine.destroy()
            results[(stage, accum, clip, strategy)] = (losses, state, scatters)
    return results


def _check(results: dict, world: int) -> None:
    for (stage, accum, clip, strategy), (losses, state, scatters) in results.items():
        ref_losses, ref_state = torch_reference(
            lambda groups: torch.optim.AdamW(groups, lr=LR),
            steps=STEPS, micro=MICRO, accum=accum, world=world, clip=clip,
        )  # fmt: skip
        case = (stage, accum, clip, strategy)
        assert losses == pytest.approx(ref_losses, abs=1e-6), case
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=str(case))
        if strategy != "whole_tensors":
            assert scatters > 0, f"{case}: no reduce-scatter was issued"


def test_the_reduce_scatter_path_matches_torch_optim():
    world = 2  # world 4: the mesh presets below
    cases = list(itertools.product((1, 2, 3), (1, 3), (0.05,), ("flat_even",)))
    cases += [(3, 2, 0.0, "per_tensor_dim0"), (2, 2, 0.05, "whole_tensors")]
    cases += [(1, 2, 0.05, "whole_tensors")]  # ZeRO-1's owned parts reduced to their owners
    _check(run_world(train_cases, world, cases), world)


def measured_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    from tests.test_comm_volume import measured_case

    with reduce_scattered():
        return measured_case(rank, world, cases)


def test_a_step_sends_what_comm_volume_predicts_on_the_reduce_scatter_path():
    """ZeRO-1 reduces each whole gradient into the shards at the boundary (a
    reduce-scatter per unit: the ZeRO paper's traffic, half an all-reduce's), stages 2-3
    every micro-step; the engine's `comm_volume()` says so and the run sends it."""
    cases = [
        (1, "fp32", 0, "AdamW"),
        (1, "fp32", 0, "Lamb"),
        (2, "fp16", 0, "AdamW"),
        (3, "fp32", 0, "AdamW"),
        (1, "fp32", 0, "AdamW", "whole_tensors"),
    ]
    results = run_world(measured_cases, 2, cases)
    for case, result in results.items():
        assert result["sent"] == result["predicted"], case
        if case[-1] != "whole_tensors":
            assert result["sent"]["reduce_scatter"][0] > 0, case
        reduced = result["sent"].get("reduce_scatter", (0, 0))[1]
        control = result["sent"].get("all_reduce", (0, 0))[1]  # norms and flags only
        assert control < reduced / 4 or case[-1] == "whole_tensors", case


def every_mesh_case(rank: int, world: int, presets: list[str]) -> dict:
    from tests.test_mesh_run import STEPS as MESH_STEPS
    from tests.test_mesh_run import _engine, _train_engine, _train_step

    results = {}
    with reduce_scattered():
        for preset in presets:
            engine = _engine(preset)
            losses = _train_engine(engine, rank, range(MESH_STEPS))
            results[("engine", preset)] = (losses, engine.state_dict(dtype=torch.float32))
            engine.destroy()
            results[("train_step", preset)] = _train_step(rank, preset)
    return results


def test_every_preset_at_2x2_matches_torch_optim_on_the_reduce_scatter_path():
    """MiCS, HSDP at stages 1-2 and a mixed plan, both doors, on 2x2: each reduced
    within its shard group by reduce-scatters, then across the replicas (ZeRO-3, hpZ
    and the hierarchical gather reduce as the world-2 case does)."""
    from tests.test_mesh_run import MESH, reference

    results = run_world(every_mesh_case, MESH.size, ["mics", "hsdp1", "hsdp2", "mixed"])
    ref_losses, ref_state = reference()
    for case, value in results.items():
        losses, state = value
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7, msg=str(case))
        for name, expected in ref_state.items():
            error = ((state[name] - expected).abs().max() / expected.abs().max()).item()
            assert error <= 1e-6, (case, name, error)
