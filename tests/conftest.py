"""The test run's plugin: ends the persistent rank groups of `run_world` at the end of the
run (they exit as processes do, saving coverage data), lists the groups that had to be
restarted and why, and with `FZERO_TEST_DURATIONS=path` writes each test's duration and
the kinds of process it used (`tests/durations.py` turns that into tests/DURATIONS.md)."""

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
    start = _cpu_seconds()
    _dist.used.clear()  # not what collection or an earlier test launched
    try:
        return (yield)
    finally:
        entry = _durations.setdefault(item.nodeid, {"seconds": 0.0})
        entry["cpu"] = _cpu_seconds() - start
        entry["kinds"] = sorted(_dist.used)


def pytest_runtest_logreport(report: Any) -> None:
    entry = _durations.setdefault(report.nodeid, {"seconds": 0.0})
    entry["seconds"] += report.duration
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped:
        entry["outcome"] = "skipped"
    entry.setdefault("outcome", "passed")


@pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: ends first
def pytest_runtestloop(session: Any) -> Iterator[None]:
    try:
        return (yield)
    finally:  # before pytest-cov combines the processes' data at the session's end
        _workers.close_all()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("FZERO_TEST_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump(_durations, f, indent=0, sort_keys=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _workers.restarts:
        terminalreporter.section("rank groups restarted")
        for name, why in _workers.restarts:
            terminalreporter.write_line(f"{name}: {why}")
