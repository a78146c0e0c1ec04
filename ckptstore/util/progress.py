"""A progress bar on a terminal, silence everywhere else.

:func:`progress` returns a :class:`Progress` that draws on standard error
only when it is a terminal and the caller did not ask for quiet (``--json``):
piped, redirected or machine-read output never carries bar characters. With
``rich`` importable the bar is rich's; otherwise one line redrawn in place
(``\\r``). Labels may come from storage: they are escaped before drawing.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

from .terminal import escape

#: redraw at most this often (seconds)
MIN_REDRAW = 0.1


class Progress:
    """``with progress("verify", total) as bar: ... bar.advance(n)``; no-op when not shown."""

    def __init__(self, label: str, total: float, *, enabled: bool, stream: TextIO | None = None,
                 use_rich: bool = True) -> None:
        self.label = escape(label)
        self.total = max(0.0, float(total))
        self.done = 0.0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._rich: Any = None
        self._task: Any = None
        self._use_rich = use_rich

    def __enter__(self) -> Progress:
        if self.enabled and self._use_rich:
            try:
                from rich.progress import Progress as RichProgress  # optional: a nicer bar when present
            except ImportError:
                self._rich = None
            else:
                from rich.console import Console

                self._rich = RichProgress(console=Console(file=self.stream), transient=True)
                self._rich.start()
                self._task = self._rich.add_task(self.label, total=self.total or None)
        return self

    def advance(self, amount: float = 1.0, *, label: str | None = None) -> None:
        self.done += amount
        if not self.enabled:
            return
        if label is not None:
            self.label = escape(label)
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, description=self.label)
            return
        now = time.monotonic()
        if now - self._last >= MIN_REDRAW or (self.total and self.done >= self.total):
            self._last = now
            self._draw()

    def clear(self) -> None:
        """Erase the bar (before other output on the terminal; :meth:`advance` redraws it)."""
        if self.enabled and self._rich is None:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()

    def _draw(self) -> None:
        width = 30
        frac = min(1.0, self.done / self.total) if self.total else 0.0
        fill = int(frac * width)
        shown = f"{frac * 100:5.1f}%" if self.total else "working…"
        self.stream.write(f"\r{self.label[:40]:<40} [{'#' * fill}{'.' * (width - fill)}] {shown}")
        self.stream.flush()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.stop()
            return
        self.stream.write("\r" + " " * 80 + "\r")
        self.stream.flush()


def progress(label: str, total: float, *, quiet: bool = False, stream: TextIO | None = None,
             use_rich: bool = True) -> Progress:
    """A bar on ``stream`` (standard error) when it is a terminal and not ``quiet``
    (``total`` 0: an activity line without a percentage)."""
    s = stream or sys.stderr
    isatty = getattr(s, "isatty", None)
    shown = not quiet and callable(isatty) and bool(isatty())
    return Progress(label, total, enabled=shown, stream=s, use_rich=use_rich)
