"""The progress line of the command line tools (``sparkjet demo``, ``sparkjet snapshots
verify``): one line redrawn in place on a terminal, and a text bar to put in it."""
from __future__ import annotations

import math
import sys
import time
from typing import TextIO

_CLEAR = "\r\033[K"  # back to the start of the line, and erase it


def bar(fraction: float, width: int = 30) -> str:
    """``[#########.....]``: ``fraction`` (clamped to 0..1) of ``width`` cells filled."""
    filled = int(min(1.0, max(0.0, fraction)) * width)
    return f"[{'#' * filled}{'.' * (width - filled)}]"


class ProgressLine:
    """A line of progress at the bottom of ``out`` (default: stdout).

    On a terminal, :meth:`update` redraws it in place, at most every ``redraw`` seconds.
    Elsewhere (a pipe, a log file) it is printed as a line of its own every ``every``
    seconds, or never when ``every`` is None. :meth:`print` writes a lasting line above it;
    :meth:`close` leaves the last state on screen and moves to the next line.
    """

    def __init__(self, out: TextIO | None = None, *, redraw: float = 0.2,
                 every: float | None = None):
        self.out = sys.stdout if out is None else out
        self.tty = self.out.isatty()
        self.redraw = redraw
        self.every = every
        self._last = -math.inf
        self._drawn = False  # the terminal's current line holds our progress

    def update(self, text: str, *, force: bool = False) -> None:
        """Shows ``text`` as the progress (now if ``force``, else when it is time)."""
        now = time.monotonic()
        if self.tty:
            if force or now - self._last >= self.redraw:
                self._write(_CLEAR + text)
                self._last = now
                self._drawn = True
        elif self.every is not None and (force or now - self._last >= self.every):
            self._write(text + "\n")
            self._last = now

    def print(self, text: str) -> None:
        """Writes ``text`` as a line of its own; on a terminal the progress is redrawn
        below it at the next :meth:`update`."""
        if self._drawn:
            self._write(_CLEAR)
            self._drawn = False
            self._last = -math.inf
        self._write(text + "\n")

    def close(self) -> None:
        """Ends the progress line (on a terminal, the last state stays visible)."""
        if self._drawn:
            self._write("\n")
            self._drawn = False

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
