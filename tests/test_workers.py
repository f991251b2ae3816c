"""The persistent test ranks of `run_world` (tests/_workers.py): a case sees what a new
process would (environment, RNG, dtype, grad mode, no process group, no `deepspeed`
module, loggers as they were), a failing, dying or hanging case is named with its rank
and leaves the next case a working group, and a case gives the same result on the
shared ranks as on new processes."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist

import fzero
from tests import _workers
from tests._dist import run_world


def dirty_case(rank: int, world: int) -> dict:
    """Leave behind everything a case could: the next case must not see any of it."""
    seen = observe_case(rank, world)
    engine = fzero.shard(torch.nn.Linear(4, 4), stage=3)  # a process group, hooks
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    fzero.comm.mesh_group((("a", world),), ("a",))
    os.environ["FZERO_LEFT_BEHIND"] = "1"
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    fzero.compat.install()
    import deepspeed  # noqa: F401  (served by fzero)

    logging.getLogger("fzero").addHandler(logging.NullHandler())
    logging.getLogger("fzero").setLevel(logging.ERROR)
    sys.argv[:] = ["left", "behind"]
    return seen


def observe_case(rank: int, world: int) -> dict:
    fzero_log = logging.getLogger("fzero")
    return {
        "left": os.environ.get("FZERO_LEFT_BEHIND"),
        "asked": os.environ.get("FZERO_ASKED"),
        "rank": os.environ["RANK"],
        "random": torch.rand(3),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "group": dist.is_initialized(),
        "deepspeed": "deepspeed" in sys.modules or fzero.compat.installed(),
        "handlers": len(fzero_log.handlers),
        "level": fzero_log.level,
        "argv": list(sys.argv),
        "traffic": fzero.comm.traffic(),
        "cwd": os.getcwd(),
    }


def test_a_case_sees_what_a_new_process_sees(monkeypatch, tmp_path):
    monkeypatch.setenv("FZERO_ASKED", "yes")  # the caller's environment at the call
    monkeypatch.chdir(tmp_path)
    fresh = run_world(observe_case, 2, fresh=True)
    first = run_world(dirty_case, 2)
    after = run_world(observe_case, 2)
    for seen in (first, after):
        assert seen.keys() == fresh.keys()
        for key, value in fresh.items():
            if key != "random":  # torch seeds a new process's generator at random
                assert seen[key] == value, (key, seen[key], value)
    assert torch.equal(first["random"], after["random"])  # the same state at every start
    assert fresh["asked"] == "yes" and fresh["left"] is None and fresh["rank"] == "0"
    assert fresh["cwd"] == str(tmp_path) and not fresh["group"] and not fresh["deepspeed"]


def raising_case(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def dying_case(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def sleeping_case(rank: int, world: int) -> int:
    import time

    if rank == 1:
        time.sleep(60)
    return rank


def sum_case(rank: int, world: int) -> int:
    fzero.comm.init_distributed()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return int(total.item())


def test_a_failing_case_names_its_test_and_rank_and_the_next_case_runs():
    with pytest.raises(AssertionError) as failed:
        run_world(raising_case, 2)
    text = str(failed.value)
    assert "test_workers.py::test_a_failing_case_names_its_test_and_rank" in text
    assert "rank 1:" in text and "ValueError: rank 1 fails on purpose" in text
    assert run_world(sum_case, 2) == 3  # a new group


def test_a_rank_that_dies_is_named_and_the_next_case_runs():
    with pytest.raises(AssertionError, match=r"rank 1: the process ended \(exit 3\)"):
        run_world(dying_case, 2)
    assert run_world(sum_case, 2) == 3


def test_a_hanging_rank_is_named_with_its_stack(monkeypatch, capsys):
    assert run_world(sum_case, 2) == 3  # the group started: its start is not the case's time
    monkeypatch.setattr(_workers, "CASE_TIMEOUT_S", 5.0)
    with pytest.raises(AssertionError, match=r"rank 1: no answer within 5 s \(hung\?\)"):
        run_world(sleeping_case, 2)
    assert "in sleeping_case" in capsys.readouterr().err  # the rank's stack (faulthandler)
    monkeypatch.undo()
    assert run_world(sum_case, 2) == 3


def pending_case(rank: int, world: int) -> str:
    fzero.comm.init_distributed()
    if rank == 0:  # a collective rank 1 never joins, left pending
        dist.all_reduce(torch.ones(1), async_op=True)
    return "returned"


def test_a_collective_left_pending_gets_the_next_case_a_new_group():
    restarts = len(_workers.restarts)
    assert run_world(pending_case, 2) == "returned"
    assert "a collective of the case was still pending" in _workers.restarts[restarts][1]
    assert run_world(sum_case, 2) == 3


def train_case(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    engine = fzero.shard(torch.nn.Linear(8, 4), stage=3)
    for step in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine.state_dict(dtype=torch.float32)


def test_the_same_case_gives_the_same_result_shared_and_fresh():
    shared = [run_world(train_case, 4) for _ in range(2)]
    fresh = run_world(train_case, 4, fresh=True)
    for name, value in fresh.items():
        assert torch.equal(shared[0][name], value) and torch.equal(shared[1][name], value)
