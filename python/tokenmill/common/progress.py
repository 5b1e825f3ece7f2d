"""Progress of a long command: tqdm on a terminal or in a notebook, a stable line in logs.

Every long command (tokenize, merge, convert, build-cache, publish, download) reports through
:class:`Progress`, and each takes ``--quiet`` (``-q``) to report nothing:

* on an interactive stream (a terminal, or stderr inside a Jupyter kernel) it draws a tqdm bar
  (``tqdm.auto``: a widget in notebooks), with the command's own fields as the bar's postfix;
* elsewhere (a log file, a CI job, a pipe) it prints plain lines instead, because a redrawn bar
  is unreadable there: ``[<command>] <status>`` every ``log_interval`` seconds and once at the
  end, plus one ``[<command>] <event>`` line per finished item for commands that have items
  (published and downloaded objects). The status is the command's own; tokenize's is
  ``[tokenize] 25.0% 10 docs 2.0k docs/s 400k tok/s 0.8 MB/s elapsed 0:00:05 ETA 0:00:15``.
  These lines are a stable, tested format for log scrapers.

tqdm is imported only when a bar is drawn (never by ``import tokenmill``). The plain lines are
tokenmill's own because tqdm has no line-per-interval mode for logs; the rest is tqdm's.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "format_duration", "is_interactive", "si"]


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` of a non-negative duration (always with hours, unlike tqdm's
    ``format_interval``, so the plain lines keep one shape)."""
    whole = max(0, int(seconds + 0.5))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def si(value: float) -> str:
    """``value`` with a k/M/G suffix and one decimal (no suffix below 1000): the plain lines'
    format, which predates tqdm here (tqdm's ``format_sizeof`` gives three digits)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def is_interactive(stream: TextIO) -> bool:
    """Whether progress on `stream` is seen live: a terminal, or stderr of a Jupyter kernel."""
    if bool(getattr(stream, "isatty", lambda: False)()):
        return True
    return stream is sys.stderr and "ipykernel" in sys.modules


class Progress:
    """A progress display over `total` units (or an open-ended count).

    Args:
        label: the command ("tokenize"), the bar's description and the lines' prefix.
        total: units expected (None: unknown).
        unit: tqdm's unit name ("B", "tok", "object").
        unit_scale: let tqdm scale the unit (k, M, G).
        status: the plain line's status text, called when a line is printed (default: the
            count, and the total when known).
        postfix: extra fields for the bar (default: none; events show there instead).
        enabled: report anything at all (False for ``--quiet``).
        stream: where to report (default: stderr).
        log_interval: seconds between status lines when `stream` is not interactive.
        first_line_now: print the first status line at the first update rather than
            `log_interval` seconds after the start.

    Thread-safe: `update` and `event` may be called from worker threads.
    """

    def __init__(
        self,
        label: str,
        *,
        total: float | None = None,
        unit: str = "it",
        unit_scale: bool = False,
        status: Callable[[], str] | None = None,
        postfix: Callable[[], str] | None = None,
        enabled: bool = True,
        stream: TextIO | None = None,
        log_interval: float = 10.0,
        first_line_now: bool = False,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0.0
        self._status = status
        self._postfix = postfix
        self._interval = log_interval
        self._started = time.monotonic()
        self._last_line = float("-inf") if first_line_now else self._started
        self._lock = threading.Lock()
        self._closed = False
        self._bar: Any = None
        if enabled and is_interactive(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=label,
                unit=unit,
                unit_scale=unit_scale,
                file=self.stream,
                dynamic_ncols=True,
                mininterval=0.2,
            )

    @property
    def elapsed(self) -> float:
        """Seconds since the display was created."""
        return time.monotonic() - self._started

    def status(self) -> str:
        """The plain line's status text: the command's, or by default
        ``42.0% 420 / 1,000 tok 1.2k tok/s elapsed 0:00:01 ETA 0:00:01`` (with a total) or
        ``420 object elapsed 0:00:01`` (without)."""
        if self._status is not None:
            return self._status()
        elapsed = self.elapsed
        if self.total is None:
            return f"{int(self.count):,} {self.unit} elapsed {format_duration(elapsed)}"
        fraction = min(self.count / self.total, 1.0) if self.total else 1.0
        rate = self.count / max(elapsed, 1e-9)
        eta = format_duration((self.total - self.count) / rate) if rate > 0 else "?"
        return (
            f"{100 * fraction:5.1f}% {int(self.count):,} / {int(self.total):,} {self.unit} "
            f"{si(rate)} {self.unit}/s elapsed {format_duration(elapsed)} ETA {eta}"
        )

    def line(self) -> str:
        """The plain status line: ``[label] status``."""
        return f"[{self.label}] {self.status()}"

    def update(self, amount: float = 1) -> None:
        """Count `amount` more units done, and redraw (bar) or print a line if it is time."""
        with self._lock:
            self.count += amount
            if not self.enabled or self._closed:
                return
            if self._bar is not None:
                if self._postfix is not None:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.update(amount)
                return
            now = time.monotonic()
            if now - self._last_line >= self._interval:
                self._last_line = now
                self._print(self.line())

    def event(self, text: str) -> None:
        """One finished item: a ``[label] text`` line in logs, the bar's postfix on a terminal."""
        with self._lock:
            if not self.enabled or self._closed:
                return
            if self._bar is not None:
                self._bar.set_postfix_str(text, refresh=True)
            else:
                self._print(f"[{self.label}] {text}")

    def write(self, text: str) -> None:
        """A message line that does not break the bar."""
        with self._lock:
            if not self.enabled:
                return
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                self._print(text)

    def close(self, final_line: bool = True) -> None:
        """Finish: close the bar, or print the last status line (unless `final_line` is
        False, for commands whose event lines already tell everything)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.enabled:
                return
            if self._bar is not None:
                if self._postfix is not None:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.close()
            elif final_line:
                self._print(self.line())

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(final_line=kind is None)
