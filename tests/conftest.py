"""The test run's plugin: ends the persistent rank groups of `run_world` at the end of the
run (they exit as processes do, saving coverage data), lists the groups that had to be
restarted and why, and with `FZERO_TEST_DURATIONS=path` writes each test's duration and
the kinds of process it used (`tests/durations.py` turns that into tests/DURATIONS.md).

`make test` runs the cases in two pytest processes (pytest-xdist's `-n 2`), each with its
own rank groups: what a case measured (CPU seconds, kinds of process, groups restarted)
travels on its teardown report to the process that writes the summary and the file."""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests import _dist, _workers

_durations: dict[str, dict[str, Any]] = {}
_restarts: list[tuple[str, str]] = []  # every pytest process's, as their reports said
_started = pytest.StashKey[tuple[float, int]]()


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":  # not multiprocessing's spawn, which does not go through it
        _dist.used.add("subprocess")


sys.addaudithook(_audit)


def _cpu_seconds() -> float:
    """CPU time of this process, of its children that ended, and of the persistent
    ranks' cases: a test's cost that does not depend on the machine's load."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    own = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return own - _workers.reaped[0] + _workers.cpu[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    item.stash[_started] = (_cpu_seconds(), len(_workers.restarts))
    _dist.used.clear()  # not what collection or an earlier test launched
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[Any]:
    report = yield
    if call.when == "teardown" and _started in item.stash:
        cpu, restarted = item.stash[_started]
        report.user_properties.append(("fzero_cpu", _cpu_seconds() - cpu))
        report.user_properties.append(("fzero_kinds", sorted(_dist.used)))
        for name, why in _workers.restarts[restarted:]:
            report.user_properties.append(("fzero_restart", [name, why]))
    return report


def pytest_runtest_logreport(report: Any) -> None:
    entry = _durations.setdefault(report.nodeid, {"seconds": 0.0})
    entry["seconds"] += report.duration
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped:
        entry["outcome"] = "skipped"
    entry.setdefault("outcome", "passed")
    for key, value in report.user_properties if report.when == "teardown" else ():
        if key == "fzero_cpu":
            entry["cpu"] = value
        elif key == "fzero_kinds":
            entry["kinds"] = list(value)
        elif key == "fzero_restart":
            _restarts.append((value[0], value[1]))


@pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: ends first
def pytest_runtestloop(session: Any) -> Iterator[None]:
    try:
        return (yield)
    finally:  # before pytest-cov combines the processes' data at the session's end
        _workers.close_all()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("FZERO_TEST_DURATIONS")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # the process that saw every report
        with open(path, "w") as f:
            json.dump(_durations, f, indent=0, sort_keys=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _restarts:
        terminalreporter.section("rank groups restarted")
        for name, why in _restarts:
            terminalreporter.write_line(f"{name}: {why}")


if "PYTEST_XDIST_WORKER" in os.environ:  # two pytest processes on the cores: one thread each
    import torch

    torch.set_num_threads(1)
