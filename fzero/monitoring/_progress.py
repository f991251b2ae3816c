"""A progress bar for rank 0 that other output goes above.

While the bar is open (rank 0, a terminal, tqdm installed), what the process prints —
`print`, the "fzero" logger and the root logger's stream handlers — is written above
it (tqdm's `external_write_mode`: clear the bar, write whole lines, draw the bar
again), so lines never land inside the bar. The streams and handlers are given back
when the bar closes (the engine's `destroy`, or the end of the process).
"""

from __future__ import annotations

import atexit
import logging
import sys
import weakref
from typing import Any, TextIO

__all__ = ["ProgressBar"]


class _AboveBar:
    """A text stream that writes whole lines above the open bars."""

    def __init__(self, stream: TextIO, tqdm: Any, bar_file: TextIO) -> None:
        self.stream, self._tqdm, self._partial = stream, tqdm, ""
        self._bar_file = bar_file  # the bars to clear are those drawn there

    def write(self, text: str) -> int:
        lines, _, self._partial = (self._partial + text).rpartition("\n")
        if lines:
            with self._tqdm.external_write_mode(file=self._bar_file):
                self.stream.write(lines + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            with self._tqdm.external_write_mode(file=self._bar_file):
                self.stream.write(self._partial)
                self.stream.flush()
            self._partial = ""

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


class ProgressBar:
    """Rank 0's bar of optimizer steps (out of `total` when known) with the loss the
    step line reports; `write(text)` prints above it. Nothing when `tqdm` is missing."""

    def __init__(self, name: str, total: int | None) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._streams = (sys.stdout, sys.stderr)
        self.bar = tqdm(
            desc=f"fzero {name}", total=total, unit="step", dynamic_ncols=True, file=sys.stderr
        )
        bar_file = self._streams[1]
        sys.stdout = _AboveBar(self._streams[0], tqdm, bar_file)  # type: ignore[assignment]
        sys.stderr = _AboveBar(self._streams[1], tqdm, bar_file)  # type: ignore[assignment]
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        for logger in (logging.getLogger(), logging.getLogger("fzero")):
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream in self._streams:
                    stream = self._streams.index(handler.stream)
                    self._handlers.append((handler, handler.stream))
                    handler.setStream((sys.stdout, sys.stderr)[stream])
        self._finalizer = weakref.finalize(self, _give_back, self._streams, self._handlers)
        atexit.register(self._finalizer)

    def update(self, steps: int = 1, loss: float | None = None) -> None:
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(steps)

    def set_total(self, total: int) -> None:
        self.bar.total = total
        self.bar.refresh()

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        self.bar.close()
        self._finalizer()


def _give_back(streams: tuple[TextIO, TextIO], handlers: list[tuple[Any, Any]]) -> None:
    for wrapped in (sys.stdout, sys.stderr):
        if isinstance(wrapped, _AboveBar):
            wrapped.flush()
    if isinstance(sys.stdout, _AboveBar) and sys.stdout.stream is streams[0]:
        sys.stdout = streams[0]
    if isinstance(sys.stderr, _AboveBar) and sys.stderr.stream is streams[1]:
        sys.stderr = streams[1]
    for handler, stream in handlers:
        handler.setStream(stream)
