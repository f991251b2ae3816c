"""The hooks the collective watch (`fzero._watch.Watch`) installs in the process while its
process group runs, each undone when the watch closes: a function at interpreter exit,
an addition to the except hook, and a SIGTERM handler that also wakes the answering
thread (`signal.set_wakeup_fd`) where SIGTERM has none. No hook stays installed after
`undo` (fzero patches nothing for longer than its process group lives)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["ProcessHooks", "die_of"]


class ProcessHooks:
    """The hooks one watch installed, and how to undo each (`undo`, in reverse order)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def at_exit(self, function: Callable[[], None]) -> None:
        """Run `function` at interpreter exit (before teardown)."""
        atexit.register(function)
        self._undo.append(lambda: atexit.unregister(function))

    def on_uncaught(self, function: Callable[..., None]) -> None:
        """Call `function(type, value, traceback)` on an uncaught exception, before the
        except hook that was there (which still runs)."""
        previous = sys.excepthook

        def hook(*info: Any) -> None:
            function(*info)
            previous(*info)

        sys.excepthook = hook
        self._undo.append(lambda: _restore_excepthook(hook, previous))

    def catch_sigterm(self, function: Callable[[int, FrameType | None], None]) -> int | None:
        """Call `function(signum, frame)` on SIGTERM; returns the read end of the wakeup
        pipe (None where nothing was installed). Python runs a handler only between
        bytecodes of the main thread, which may sit in native code for the whole wait: so
        the signal also wakes the answering thread (`signal.set_wakeup_fd`), which acts at
        once. Only where SIGTERM is untouched (the default action) and no one else uses
        the wakeup fd (asyncio); only from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            old = None
        if old != -1:
            if old is not None:
                signal.set_wakeup_fd(old)
            os.close(read)
            os.close(write)
            return None

        def handler(signum: int, frame: FrameType | None) -> None:
            function(signum, frame)

        signal.signal(signal.SIGTERM, handler)

        def undo() -> None:
            if threading.current_thread() is threading.main_thread():
                if signal.getsignal(signal.SIGTERM) is handler:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                mine = signal.set_wakeup_fd(-1)
                if mine != write:
                    signal.set_wakeup_fd(mine)
            for fd in (read, write):
                with contextlib.suppress(OSError):
                    os.close(fd)

        self._undo.append(undo)
        return read

    def undo(self) -> None:
        """Remove every hook, the last installed first."""
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self._undo.clear()


def die_of(signum: int) -> None:
    """End the process by `signum`'s default action, as without fzero (from any thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # only the main thread may call signal.signal: set the action below it
        setsig = ctypes.pythonapi.PyOS_setsig
        setsig.argtypes, setsig.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
        setsig(signum, None)
    os.kill(os.getpid(), signum)


def _restore_excepthook(hook: Any, previous: Any) -> None:
    if sys.excepthook is hook:
        sys.excepthook = previous
