"""A one-line progress bar on stderr: documents/s, tokens/s, MB/s of text and an ETA.

On a terminal the line is redrawn in place at most 5 times a second; otherwise (a log file, a
CI job) a full line is printed every ``log_interval`` seconds. The ETA comes from the bytes of
the input files consumed so far (compressed bytes for compressed inputs) against their total.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` of a non-negative duration."""
    whole = max(0, int(seconds + 0.5))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


class Progress:
    """Counts documents, tokens and bytes and draws them on ``stream``.

    Args:
        total_bytes: the size of the inputs still to process (for the percentage and ETA).
        enabled: draw anything at all.
        stream: where to draw (stderr).
        label: the line's prefix.
        log_interval: seconds between lines when ``stream`` is not a terminal.
    """

    def __init__(
        self,
        total_bytes: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        label: str = "tokenize",
        log_interval: float = 10.0,
    ) -> None:
        self.total_bytes = max(0, total_bytes)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.documents = 0
        self.tokens = 0
        self.text_bytes = 0
        self.source_bytes = 0
        self._started = time.monotonic()
        self._last_draw = self._started
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._interval = 0.2 if self._interactive else log_interval

    def update(self, documents: int, tokens: int, text_bytes: int, source_bytes: int) -> None:
        """Add the counts of one finished chunk and redraw if it is time."""
        self.documents += documents
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.source_bytes += source_bytes
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self._interval:
            self._last_draw = now
            self._draw(now, final=False)

    def line(self, now: float | None = None) -> str:
        """The current status line."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._started, 1e-9)
        fraction = self.source_bytes / self.total_bytes if self.total_bytes else 1.0
        fraction = min(fraction, 1.0)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("inf")
        eta_text = format_duration(eta) if eta != float("inf") else "?"
        return (
            f"[{self.label}] {100 * fraction:5.1f}% {self.documents:,} docs "
            f"{_si(self.documents / elapsed)} docs/s {_si(self.tokens / elapsed)} tok/s "
            f"{self.text_bytes / elapsed / 1e6:.1f} MB/s elapsed {format_duration(elapsed)} "
            f"ETA {eta_text}"
        )

    def _draw(self, now: float, final: bool) -> None:
        text = self.line(now)
        if self._interactive:
            self.stream.write("\r" + text + ("\n" if final else "\x1b[K"))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final line."""
        if self.enabled:
            self._draw(time.monotonic(), final=True)

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return time.monotonic() - self._started
