"""The collective watch (`fzero._watch` and its parts: `_watch_settings`, `_order_check`,
`_waits`, `_whereabouts`, `_process_hooks`): its settings, read once;
where a thread is; the rules that keep the watch an object of the process group (no raw
collectives outside `fzero.comm`, no module-level mutable state); and the order check
across operations and outside them, at world 2 (the patterns a user's script hits are
in `test_stuck_ranks.py`)."""

from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import _waits, _watch, _whereabouts
from fzero._watch_settings import WatchSettings
from tests._dist import run_world

FZERO = Path(fzero.__file__).resolve().parent


# ---- settings, read once ---------------------------------------------------------------------


def test_settings_come_from_the_environment_once_with_errors_that_name_the_variable():
    assert WatchSettings.from_environment({}) == WatchSettings()
    got = WatchSettings.from_environment(
        {
            "FZERO_TIMEOUT_S": "30",
            "FZERO_WATCH_S": "0",
            "FZERO_REPORT_S": "5",
            "FZERO_CHECK_COLLECTIVES": "0",
        }
    )
    assert got == WatchSettings(timeout_s=30, slice_s=0, report_s=5, check=False)
    assert WatchSettings.from_environment({"FZERO_TIMEOUT_S": "30"}, timeout_s=7).timeout_s == 7
    with pytest.raises(ValueError, match=r"FZERO_REPORT_S is 'soon'; expected a number"):
        WatchSettings.from_environment({"FZERO_REPORT_S": "soon"})
    with pytest.raises(
        ValueError, match="FZERO_TIMEOUT_S is '0'; expected a number of seconds > 0"
    ):
        WatchSettings.from_environment({"FZERO_TIMEOUT_S": "0"})
    with pytest.raises(ValueError, match="FZERO_WATCH_S is '-1'"):
        WatchSettings.from_environment({"FZERO_WATCH_S": "-1"})
    with pytest.raises(ValueError, match=r"WatchSettings\.report_s is -2"):
        WatchSettings(report_s=-2)


def test_the_config_sets_the_report_interval():
    assert fzero.load_config({}).collective_report_s is None
    assert fzero.load_config({"collective_report_s": 5}).collective_report_s == 5.0
    with pytest.raises(fzero.config.ConfigError, match=r"'collective_report_s' is -1\.0"):
        fzero.load_config({"collective_report_s": -1})


def test_two_ranks_in_different_agreements_never_wait_for_each_other():
    """Agreement numbers are part of where a rank waits: two ranks that have issued the
    same collectives but wait in different agreements cannot meet."""
    assert _waits.may_complete("a5.3", "a5.3")
    assert not _waits.may_complete("a5.3", "a5.4")
    assert _waits.may_complete("a5.3", "c5") and _waits.may_complete("c4", "a5.3")
    assert not _waits.may_complete("c6", "a5.3") and not _waits.may_complete("c6", "c6")


# ---- where a thread is -----------------------------------------------------------------------


def _here() -> _whereabouts.Whereabouts:
    return _whereabouts.whereabouts(sys._getframe())


class _Loads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        return _here().text


def test_whereabouts_tell_user_code_from_a_data_loader():
    mine = _here()
    assert mine.state == "outside" and mine.call == ""
    assert mine.text.startswith("in its own code at ") and "test_watch.py" in mine.text
    loaded = next(iter(torch.utils.data.DataLoader(_Loads(), batch_size=None)))
    assert loaded.startswith("in a data loader (") and "test_watch.py" in loaded


def test_whereabouts_of_another_thread_come_from_its_frames():
    ready, done = threading.Event(), threading.Event()

    def user_code() -> None:
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=user_code)
    thread.start()
    ready.wait(10)
    time.sleep(0.05)
    try:
        frame = sys._current_frames()[thread.ident]
        got = _whereabouts.whereabouts(frame)
        assert got.state == "outside"
        assert "test_watch.py" in got.text and "in user_code" in got.text, got
    finally:
        done.set()
        thread.join()


# ---- the rules that keep the watch an object of the process group ----------------------------

RAW_COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "all_gather_single",
    "reduce_scatter_single",
}  # fmt: skip
COLLECTIVES_ALLOWED_IN = {"comm.py", "_watch.py"}


def _distributed_aliases(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.names:
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _raw_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases = _distributed_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in RAW_COLLECTIVES:
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id in aliases) or (
            isinstance(base, ast.Attribute)
            and base.attr == "distributed"
            and isinstance(base.value, ast.Name)
            and base.value.id == "torch"
        ):
            found.append(f"{path.relative_to(FZERO.parent)}:{node.lineno}: .{node.attr}")
    return found


def test_no_raw_collective_outside_fzero_comm():
    """Every collective fzero issues goes through `fzero.comm` (numbered, checked,
    watched): a raw `torch.distributed` collective elsewhere fails this test."""
    found = [
        hit
        for path in sorted(FZERO.rglob("*.py"))
        if path.relative_to(FZERO).as_posix() not in COLLECTIVES_ALLOWED_IN
        for hit in _raw_collectives(path)
    ]
    assert found == [], found


def test_the_raw_collective_rule_sees_what_it_should(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "dist.barrier()\ntorch.distributed.all_reduce(x)\nd2.broadcast(x, 0)\n"
        "dist.get_rank()\n"
    )
    tree = ast.parse(sample.read_text())
    assert _distributed_aliases(tree) == {"dist", "d2"}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in RAW_COLLECTIVES:
            hits.append(node.attr)
    assert sorted(hits) == ["all_reduce", "barrier", "broadcast"]


# Module-level names of the watch's modules that hold state, with why.
MUTABLE_ALLOWED = {
    "_watch.py": {"_active": "the watch of the default process group (one at a time)"},
    "_watch_settings.py": {},
    "_order_check.py": {},
    "_waits.py": {},
    "_process_hooks.py": {},
    "_whereabouts.py": {},
    "comm.py": {},
}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "local", "Counter"}


def _module_state(path: Path) -> list[str]:
    """Module-level names bound to mutable values, and `global` statements."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(
            value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp
        ) or (
            isinstance(value, ast.Call)
            and getattr(value.func, "attr", getattr(value.func, "id", "")) in _MUTABLE_CALLS
        )
        for target in targets:
            if mutable and isinstance(target, ast.Name) and not target.id.startswith("__"):
                found.append(target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [f"global {name}" for name in node.names]
    return found


@pytest.mark.parametrize("module", sorted(MUTABLE_ALLOWED))
def test_the_watch_modules_hold_no_module_state_beyond_the_allow_list(module):
    assert sorted(_module_state(FZERO / module)) == sorted(MUTABLE_ALLOWED[module])


def test_the_module_state_rule_sees_what_it_should(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import threading\n__all__ = ['x']\n_a = []\n_b: dict = {}\n_c = threading.local()\n"
        "_d = (1, 2)\n_E = frozenset()\ndef f():\n    global _d\n"
    )
    assert sorted(_module_state(sample)) == ["_a", "_b", "_c", "global _d"]


# ---- the watch belongs to the process group ---------------------------------------------------


def lifecycle_case(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fzero import comm

    dist.init_process_group("gloo")  # the script's own group (torch hooks its excepthook)
    before = sys.excepthook
    comm.init_distributed()  # adopts it
    watch = _watch.current()
    assert watch is not None and watch.is_current()
    hooked = sys.excepthook is not before
    comm.init_distributed()
    same = _watch.current() is watch
    dist.destroy_process_group()  # the group goes: so does its watch
    gone = _watch.current() is None and watch.closed
    thread_ended = not watch._responder.thread.is_alive()
    restored = sys.excepthook is before
    # a new group (one rank on its own store: the old port may still be closing)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.init_distributed()
    fresh = _watch.current()
    return {
        "hooked": hooked,
        "same": same,
        "gone": gone,
        "thread_ended": thread_ended,
        "restored": restored,
        "fresh": fresh is not None and fresh is not watch and fresh.issued == 0,
    }


def test_the_watch_is_made_with_the_group_and_closed_with_it():
    got = run_world(lifecycle_case, 2)
    assert got == dict.fromkeys(got, True), got


def forget_case(rank: int, world: int) -> dict:
    """A harness that runs many worlds in one process (`tests._workers`): the group
    destroyed, `forget_process_groups` closes its watch and puts back what it hooked."""
    import signal

    import torch.distributed as dist

    from fzero import comm

    dist.init_process_group("gloo")  # torch hooks its excepthook here
    hook, term = sys.excepthook, signal.getsignal(signal.SIGTERM)
    comm.init_distributed()  # adopts it
    watch = _watch.current()
    comm.all_reduce(torch.ones(1), what="a sum")
    with comm.named_operation("an operation"):
        comm.all_reduce(torch.ones(2), what="another")
    caught = term is not signal.SIG_DFL or signal.getsignal(signal.SIGTERM) is not term
    dist.destroy_process_group()
    comm.forget_process_groups()
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    after = {
        "caught": caught,
        "closed": watch.closed and _watch.current() is None,
        "thread_ended": not watch._responder.thread.is_alive(),
        "hook_back": sys.excepthook is hook,
        "sigterm_back": signal.getsignal(signal.SIGTERM) is term and wakeup == -1,
    }
    # the next world (one rank on its own store: the old port may still be closing)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.init_distributed()  # adopted: a watch of its own, from the start
    fresh = _watch.current()
    after["fresh"] = fresh is not watch and (fresh.issued, fresh.order.tracks) == (0, {})
    return after


def test_forgetting_the_process_groups_closes_the_watch():
    got = run_world(forget_case, 2)
    assert got == dict.fromkeys(got, True), got


# ---- the order check across operations and outside them (world 2) -----------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _engine(stage: int) -> fzero.engine.Engine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    return fzero.shard(Net(), optimizer=fzero.optim.sgd(lr=0.1), config=config)


def _outcome(rank: int, action) -> dict:
    start = time.monotonic()
    try:
        action()
        return {"rank": rank, "error": "no error"}
    except Exception as error:
        seconds = time.monotonic() - start
        return {"rank": rank, "type": type(error).__name__, "error": str(error), "s": seconds}


def _both(rank: int, result: dict, directory: str) -> dict:
    """Rank 1 leaves its result in a file; rank 0 returns both."""
    import json

    path = Path(directory) / f"rank{rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(result))
    partial.replace(path)  # whole or absent: rank 0 may look while it is written
    if rank != 0:
        return result
    other = Path(directory) / "rank1.json"
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"0": result, "1": json.loads(other.read_text()) if other.exists() else None}


def plain_backward_case(rank: int, world: int, directory: str) -> dict:
    """Stage-3 gathers under a plain `loss.backward()` (outside any named operation):
    rank 1 skips its backward at the third step and goes to `step`."""
    engine = _engine(3)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))

    def train(skip: bool) -> None:
        loss = engine(x).square().mean()
        if not skip:
            loss.backward()
        engine.step()

    for _ in range(2):
        train(False)
    return _both(rank, _outcome(rank, lambda: train(rank == 1)), directory)


def module_forwards_case(rank: int, world: int, directory: str) -> dict:
    """Forwards of `engine.module` at stage 3 (as `generate` runs them, per token) after a
    step: rank 0 runs one more than rank 1, which goes on to `engine.state_dict()`."""
    engine = _engine(3)
    x = torch.randn(2, 8)

    def forwards(n: int) -> None:
        engine.backward(engine(x).square().mean())
        engine.step()
        with torch.no_grad():
            for _ in range(n):
                engine.module(x)

    forwards(3)  # both: the record of a step and then three forwards
    return _both(
        rank,
        _outcome(rank, lambda: (forwards(3 + (rank == 0)), engine.state_dict())),
        directory,
    )


def entries_case(rank: int, world: int, directory: str) -> dict:
    """Rank 0 calls `engine.state_dict()`, rank 1 `save_checkpoint`."""
    engine = _engine(2)
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().mean())
    engine.step()

    def call() -> None:
        if rank == 0:
            engine.state_dict()
        else:
            engine.save_checkpoint(str(Path(directory) / "ckpt"))

    return _both(rank, _outcome(rank, call), directory)


@pytest.mark.parametrize(
    ("case", "names"),
    [
        (plain_backward_case, ("outside fzero's operations", "step of engine Net (micro-step 2)")),
        (module_forwards_case, ("outside fzero's operations", "the entry of state_dict")),
        (entries_case, ("entered different operations", "rank 1: save_checkpoint of engine")),
    ],
    ids=["plain-backward-skipped", "more-module-forwards", "different-entry-points"],
)
def test_ranks_that_take_different_paths_are_named_on_both(case, names, tmp_path):
    """No collective is issued unchecked: each rank gets one `RankDisagreement` naming
    what both were doing, within seconds (a fresh process group: the ranks end apart)."""
    got = run_world(case, 2, str(tmp_path), fresh=True)
    for rank in ("0", "1"):
        result = got[rank]
        assert result["type"] == "RankDisagreement", result
        for name in names:
            assert name in result["error"], (name, result)
        assert result["s"] < 20, result


def plain_backward_trains_case(rank: int, world: int) -> dict:
    """Plain `loss.backward()` and module forwards outside named operations, steady."""
    engine = _engine(3)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(4):
        F.mse_loss(engine(x), torch.zeros(2, 8)).backward()
        engine.step()
        with torch.no_grad():
            engine.module(x)
    watch = _watch.current()
    agreed = watch.agreed
    F.mse_loss(engine(x), torch.zeros(2, 8)).backward()
    engine.step()
    with torch.no_grad():
        engine.module(x)
    return {"agreements in a steady step": watch.agreed - agreed, **engine.state_dict()}


def test_a_steady_loop_outside_named_operations_agrees_nothing():
    got = run_world(plain_backward_trains_case, 2)
    assert got.pop("agreements in a steady step") == 0
    assert len(got) == 6


# ---- the rules that end a wait, on fabricated views of the other rank ------------------------


def _answer(n: int, where: str, call: str = "", ranks: tuple[int, ...] | None = None) -> dict:
    return {"n": n, "state": "outside", "where": where, "call": call, "ranks": ranks,
            "operation": "", "last": "", "ago": 0.0}  # fmt: skip


COLLECTIVE = _waits.Collective(7, "all_gather", 96, "parameters of unit 1 'b'", "forward")
AGREEMENT = _waits.Collective(6, "agreement", 2, "the entry of state_dict", "state_dict", 3)


def _look(collective, views, asked=None):
    """One look of rank 0 at rank 1 (world 2): the reason to raise ("" if none) and what
    the next look compares with."""
    views = {1: views}
    return _waits.never_meet(0, collective, asked, views), _waits.remember(0, views, asked)


def test_a_rank_that_left_is_named_unless_it_issued_the_awaited_collective():
    view = _whereabouts.PeerView
    left = view(1, left="5|its script ended or called sys.exit, after step, collective #5")
    message, _ = _look(COLLECTIVE, left)
    assert message.startswith("fzero: rank 1 left the program (its script ended")
    assert "rank 0 waits in collective #7 all_gather" in message
    assert _look(AGREEMENT, left)[0]  # an agreement never completes without it
    issued = view(1, left="7|its script ended or called sys.exit, after step, collective #7")
    assert _look(COLLECTIVE, issued)[0] == ""  # #7 may still complete


def test_a_rank_whose_process_is_gone_or_that_raised_is_named():
    view = _whereabouts.PeerView
    gone = _look(COLLECTIVE, view(1, alive=False))[0]
    assert "rank 1's process has ended without a word" in gone
    caught = view(1, raised="forward: Boom: bad batch")
    message, asked = _look(COLLECTIVE, caught)
    assert message == ""  # it may catch it and go on: only when still so at the next look
    assert "rank 1 raised in forward: Boom" in _look(COLLECTIVE, caught, asked)[0]
    final = view(1, raised="forward: RankDisagreement: ...", final=True)
    assert "rank 1 raised in forward: RankDisagreement" in _look(COLLECTIVE, final)[0]


def test_ranks_in_different_collectives_twice_are_named():
    view = _whereabouts.PeerView
    other = view(1, status="waiting|c8|collective #8 reduce_scatter of 96 elements|2")
    message, asked = _look(COLLECTIVE, other)
    assert message == ""
    message, _ = _look(COLLECTIVE, other, asked)
    assert "rank 0 waits in collective #7" in message
    assert "rank 1 waits in collective #8" in message
    same = view(1, status=f"waiting|c7|{COLLECTIVE.describe()}|2")
    assert _look(COLLECTIVE, same, _look(COLLECTIVE, same)[1])[0] == ""
    later = view(1, status="waiting|c5|collective #5 all_gather of 96 elements|2")
    assert _look(AGREEMENT, later, _look(AGREEMENT, later)[1])[0] == ""


def test_a_rank_in_its_own_collective_that_needs_this_one_is_named_at_its_third_answer():
    view = _whereabouts.PeerView
    where = "in its own torch.distributed.barrier (called at train.py:9 in <module>)"
    asked = None
    for n in (1, 2):
        message, asked = _look(
            AGREEMENT, view(1, answer=_answer(n, where, "barrier", (0, 1))), asked
        )
        assert message == ""
    same_answer = _look(AGREEMENT, view(1, answer=_answer(2, where, "barrier", (0, 1))), asked)
    assert same_answer[0] == ""  # no new answer: no new evidence
    message, _ = _look(AGREEMENT, view(1, answer=_answer(3, where, "barrier", (0, 1))), asked)
    assert message.startswith(f"fzero: rank 1 is {where}, outside fzero, while rank 0 waits")
    elsewhere = (2, 3)  # a call on a group without this rank may complete without it
    asked = None
    for n in (1, 2, 3, 4):
        message, asked = _look(
            AGREEMENT, view(1, answer=_answer(n, where, "barrier", elsewhere)), asked
        )
        assert message == ""


def report_interval_case(rank: int, world: int) -> list[float]:
    """The config's `collective_report_s` reaches the group's watch through both doors."""
    seen = []
    config = {"train_micro_batch_size_per_gpu": 2, "collective_report_s": 5}
    fzero.shard(Net(), optimizer=fzero.optim.sgd(lr=0.1), config=config)
    seen.append(_watch.current().settings.report_s)
    model = Net()
    plan = fzero.partition.plan(fzero.partition.describe(model), world_size=world, stage=1)
    fzero.init(model, plan, fzero.optim.sgd(lr=0.1), config={"collective_report_s": 7})
    seen.append(_watch.current().settings.report_s)
    return seen


def test_the_configs_report_interval_reaches_the_watch():
    assert run_world(report_interval_case, 2) == [5.0, 7.0]
