"""Every stuck collective explained within a minute, and no mismatched collective
reaching gloo: scripts written as a user writes them, one process per rank (as a
launcher starts them), fzero's default timeouts (600 s). Each pattern names the rank on
every surviving rank within seconds (`fzero._watch`, `fzero._waits`, `fzero._whereabouts`).

Every test here launches fresh processes (ranks exit, are killed or end in an error)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
GLOO_ABORT = "EnforceNotMet"  # what gloo throws (and aborts with) on mismatched collectives
# Each surviving rank names the rank within this many seconds of reaching the point where
# the ranks part (the bound; 2-5 s on a quiet machine, the peer's own lag included).
WITHIN_S = 60

HEADER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    import fzero

    STAGE = int(os.environ.get("STAGE", "3"))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)


    fzero.comm.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": STAGE, "stage3_param_persistence_threshold": 0},
    }
    engine = fzero.shard(Net(), optimizer=fzero.optim.sgd(lr=0.1), config=config)


    def batch(step):
        gen = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(2, 16, generator=gen), torch.randn(2, 4, generator=gen)


    def train(step):
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


    def report(start, **fields):
        seconds = time.monotonic() - start if start is not None else None
        print("RESULT " + json.dumps({"rank": rank, "seconds": seconds, **fields}), flush=True)


    def failed(start, error):
        report(start, error=type(error).__name__, message=str(error))


    def run_steps(diverge=lambda: None, action=train):
        # action(step) for four steps; at the third the clock starts and diverge() runs
        # first. Reports how it ended (seconds from the third step).
        start = None
        try:
            for step in range(4):
                if step == 2:
                    start = time.monotonic()
                    diverge()
                action(step)
            report(start, error="no error")
        except Exception as error:
            failed(start, error)
            sys.exit(1)
    """
)


@dataclass
class Ran:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self) -> dict:
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {self.rank} printed no result:\n{self.stderr[-4000:]}"
        return json.loads(lines[-1][len("RESULT ") :])

    def check_no_gloo_abort(self) -> None:
        assert GLOO_ABORT not in self.stderr, self.stderr[-4000:]
        assert self.returncode != -signal.SIGABRT, self.stderr[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    tmp_path: Path, body: str, world: int = 2, timeout: float = 240, **env: str
) -> list[Ran]:
    """Run HEADER + `body` on `world` ranks (one process each, as a launcher starts
    them), fzero's default timeouts; every rank's exit code and output."""
    script = tmp_path / "script.py"
    script.write_text(HEADER + textwrap.dedent(body))
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith("FZERO_")}
    base.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    ran = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            raise AssertionError(f"rank {r} still ran after {timeout} s:\n{err[-4000:]}") from None
        ran.append(Ran(r, p.returncode, out, err))
    return ran


# ---- step() without backward() on one rank --------------------------------------------------


@pytest.mark.parametrize("stage", [3, 2])
def test_a_step_without_backward_on_one_rank_is_named_on_both(tmp_path, stage):
    """Rank 1 skips `backward` at its third micro-step and calls `step`: each rank would
    repeat its own last run of its operation, so before the order check covered the
    sequence of operations both issued without agreeing and gloo aborted the process
    ("Received data size doesn't match expected size"). Now `step` after `forward`
    differs from last time on rank 1, which agrees first, while rank 0 waits in
    backward's collective: both are named on both ranks."""
    ranks = launch(
        tmp_path,
        """
        def train_skipping(step):
            x, y = batch(step)
            loss = F.mse_loss(engine(x), y)
            if not (rank == 1 and step == 2):
                engine.backward(loss)
            engine.step()

        run_steps(action=train_skipping)
        """,
        STAGE=str(stage),
    )
    for ran in ranks:
        ran.check_no_gloo_abort()
        got = ran.result
        assert got["error"] == "RankDisagreement", got
        assert "backward of engine Net (micro-step 2)" in got["message"], got
        assert "step of engine Net (micro-step 2)" in got["message"], got
        assert "rank 0" in got["message"] and "rank 1" in got["message"], got
        assert got["seconds"] < WITHIN_S, got


# ---- a rank that skips an entry point and goes on to its own barrier ------------------------

SKIPPED = {
    "engine.state_dict": "engine.state_dict()",
    "fzero.state_dict": "fzero.state_dict(engine.train_state)",
    "save_checkpoint": "engine.save_checkpoint(os.path.join(os.getcwd(), 'ckpt'))",
    "save_16bit_model": "engine.save_16bit_model(os.path.join(os.getcwd(), 'model'))",
}


@pytest.mark.parametrize("call", list(SKIPPED))
def test_a_rank_that_skips_an_entry_point_for_its_own_barrier_is_named(tmp_path, call):
    """Rank 1 skips the call and waits in its own `dist.barrier()`; before, rank 0 waited
    silently for the collective timeout (600 s). Now rank 0's entry agreement sees rank 1
    in a torch.distributed collective that needs rank 0 and raises within seconds; rank 1
    says that rank 0 left, and why, while it sits in its barrier."""
    ranks = launch(
        tmp_path,
        f"""
        for step in range(2):
            train(step)
        start = time.monotonic()
        try:
            if rank == 0:
                {SKIPPED[call]}
            dist.barrier()
            report(start, error="no error")
        except Exception as error:
            failed(start, error)
            sys.exit(1)
        """,
    )
    for ran in ranks:
        ran.check_no_gloo_abort()
    waiter, skipper = ranks[0].result, ranks[1]
    assert waiter["error"] == "RankDisagreement", waiter
    assert "rank 1 is in its own torch.distributed.barrier (called at" in waiter["message"]
    assert "outside fzero, while rank 0 waits in an agreement" in waiter["message"], waiter
    assert waiter["seconds"] < WITHIN_S, waiter
    assert "fzero: rank 0 raised in" in skipper.stderr, skipper.stderr[-4000:]
    assert "rank 1 is in its own torch.distributed.barrier" in skipper.stderr
    assert skipper.result["seconds"] < WITHIN_S, skipper.result  # its barrier fails as 0 exits


# ---- a rank slow in its data loader: reported, then the run completes ------------------------

LOADER = """
class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, step):
        if rank == 1 and step == 2:
            time.sleep(float(os.environ["SLEEP_S"]))  # a slow read
        return batch(step)


start = time.monotonic()
for x, y in torch.utils.data.DataLoader(Batches(), batch_size=None):
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
weights = engine.state_dict(dtype=torch.float32)
if rank == 0:
    torch.save(weights, "weights.pt")
report(start, error="no error")
"""


def _loader_reference() -> dict:
    """One process: each step's gradient is the mean of both ranks' losses."""
    torch.manual_seed(0)
    model = _Net()
    for step in range(4):
        model.zero_grad()
        loss = 0.0
        for r in range(2):
            gen = torch.Generator().manual_seed(100 * step + r)
            x, y = torch.randn(2, 16, generator=gen), torch.randn(2, 4, generator=gen)
            loss = loss + F.mse_loss(model(x), y) / 2
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return model.state_dict()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _check_loader_run(tmp_path: Path, ranks: list[Ran], reports: int) -> str:
    for ran in ranks:
        ran.check_no_gloo_abort()
        assert ran.returncode == 0, ran.stderr[-4000:]
        assert ran.result["error"] == "no error"
    waiting = [line for line in ranks[0].stderr.splitlines() if "Who is where" in line]
    assert len(waiting) == reports, ranks[0].stderr[-4000:]
    assert "Who is where" not in ranks[1].stderr
    got = torch.load(tmp_path / "weights.pt")
    for name, value in _loader_reference().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    return waiting[0]


def test_a_rank_slow_in_its_data_loader_is_reported_and_the_run_completes(tmp_path):
    """`FZERO_REPORT_S=3` and an 8 s read: reports after 3 and 6 s (twice as long)."""
    ranks = launch(tmp_path, LOADER, SLEEP_S="8", FZERO_REPORT_S="3")
    line = _check_loader_run(tmp_path, ranks, reports=2)
    assert "fzero: rank 0 has waited 3 s. Who is where: rank 0 waits in collective #" in line
    assert "in forward of engine Net (micro-step 2)" in line
    assert "rank 1 is in a data loader (" in line and "in __getitem__)" in line
    assert "its last fzero collective was collective #" in line
    assert "in step of engine Net (micro-step 1)" in line


@pytest.mark.slow  # 45 s of sleep
def test_a_rank_sleeping_45_s_in_its_data_loader_is_reported_after_30_s(tmp_path):
    """The issue's case, with the default report interval."""
    ranks = launch(tmp_path, LOADER, SLEEP_S="45")
    line = _check_loader_run(tmp_path, ranks, reports=1)
    assert "fzero: rank 0 has waited 30 s. Who is where:" in line
    assert "rank 1 is in a data loader (" in line


# ---- ranks that leave --------------------------------------------------------------------


def test_a_rank_that_calls_sys_exit_is_named_at_once(tmp_path):
    ranks = launch(
        tmp_path,
        """
        def leave():
            if rank == 1:
                sys.exit(0)  # mid-run

        run_steps(leave)
        """,
    )
    for ran in ranks:
        ran.check_no_gloo_abort()
    got = ranks[0].result
    assert got["error"] == "RankDisagreement", got
    assert (
        "rank 1 left the program (its script ended or called sys.exit, after step of engine "
        "Net (micro-step 1), collective #"
    ) in got["message"], got
    assert "rank 0 waits in collective #" in got["message"], got
    assert got["seconds"] < WITHIN_S, got
    assert ranks[1].returncode == 0


KILLED = """
def kill():
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)


run_steps(kill, train if WHERE == "step" else lambda step: engine.state_dict())
"""


@pytest.mark.parametrize(
    ("victim", "where"), [(1, "step"), (1, "state_dict"), (0, "step")], ids=str
)
def test_a_rank_killed_by_sigkill_is_named_on_the_survivor(tmp_path, victim, where):
    """Rank 1 killed while rank 0 waits in a collective (gloo closes the connection) or
    in an agreement (its process is seen gone); rank 0 killed: the store it hosts is
    gone with it."""
    body = f"VICTIM, WHERE = {victim}, {where!r}\n" + KILLED
    ranks = launch(tmp_path, body)
    victim_run, survivor = ranks[victim], ranks[1 - victim]
    assert victim_run.returncode == -signal.SIGKILL
    survivor.check_no_gloo_abort()
    got = survivor.result
    assert got["error"] == "RankDisagreement", got
    if victim == 1:
        assert "rank 1's process has ended without a word" in got["message"], got
    else:
        assert "the process that hosts it (rank 0" in got["message"], got
    assert got["seconds"] < WITHIN_S, got


def test_a_rank_terminated_by_sigterm_says_so_and_dies_of_it(tmp_path):
    """SIGTERM while rank 1's main thread is blocked in native code (a store wait that
    never ends): its answering thread posts that it left, then it dies of the signal as
    without fzero."""
    ranks = launch(
        tmp_path,
        """
        import datetime, threading

        def terminated_in_native_code():
            if rank == 1:
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
                store = dist.distributed_c10d._get_default_store()
                store.wait(["never"], datetime.timedelta(seconds=60))

        run_steps(terminated_in_native_code)
        """,
    )
    assert ranks[1].returncode == -signal.SIGTERM, ranks[1].stderr[-4000:]
    got = ranks[0].result
    assert got["error"] == "RankDisagreement", got
    assert (
        "rank 1 left the program (terminated by SIGTERM while in its own code at"
        in (got["message"])
    ), got
    assert got["seconds"] < WITHIN_S, got


# ---- waits that are not sliced (as NCCL's) ---------------------------------------------------


@pytest.mark.parametrize("recorder", ["flight recorder", "store"])
def test_an_unsliced_wait_is_reported_from_its_progress(tmp_path, recorder):
    """`FZERO_WATCH_S=0` on gloo behaves as NCCL does for the watch: the main thread
    blocks in torch's wait, and the answering thread reports from the collective's
    progress (torch's flight recorder, or the ranks' collective counts in the store)."""
    env = {"FZERO_WATCH_S": "0", "FZERO_REPORT_S": "2", "SLEEP_S": "7"}
    if recorder == "store":
        env["TORCH_FR_BUFFER_SIZE"] = "0"  # torch records nothing
    ranks = launch(tmp_path, LOADER, **env)
    for ran in ranks:
        assert ran.returncode == 0, ran.stderr[-4000:]
    lines = [line for line in ranks[0].stderr.splitlines() if "has not completed after" in line]
    assert lines, ranks[0].stderr[-4000:]
    assert "rank 0 waits in collective #" in lines[0]
    # the first report can come before rank 1's answer says where it is when the machine
    # is loaded (seen once: "outside fzero's operations"); the next, 4 s on, names it
    assert any("rank 1 is in a data loader (" in line for line in lines), lines


def test_a_rank_late_to_a_large_gather_is_named_at_the_collective_timeout(tmp_path):
    """Over gloo a gather of 1 MiB or more is one broadcast from each rank
    (`comm.all_gather_into`). A rank that does not come, here the first broadcast's
    source, is named as for one all-gather: at the collective timeout, with where it
    is, on the ranks that wait for it."""
    ranks = launch(
        tmp_path,
        """
        def late(step):
            if rank == 0 and step == 2:
                time.sleep(12)
            whole = torch.empty(4 * 2**18)
            fzero.comm.all_gather_into(whole, torch.ones(2**18), what="a large gather")

        run_steps(action=late)
        """,
        world=4,
        FZERO_CHECK_COLLECTIVES="0",
        FZERO_TIMEOUT_S="4",
    )
    got = ranks[1].result
    assert got["error"] == "RankDisagreement", got
    assert "rank(s) [0] did not arrive in collective" in got["message"], got
    assert "(a large gather) within the collective timeout (4 s" in got["message"], got
    assert "rank 0 is in its own code" in got["message"], got
    assert got["seconds"] < WITHIN_S, got
