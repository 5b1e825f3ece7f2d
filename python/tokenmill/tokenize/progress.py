"""Tokenize's progress: documents/s, tokens/s, MB/s of text and an ETA.

Drawn by `tokenmill.common.progress` (a tqdm bar on a terminal or in a notebook; in a log, the
line below every ``log_interval`` seconds and at the end). The ETA comes from the bytes of the
input files consumed so far (compressed bytes for compressed inputs) against their total::

    [tokenize]  25.0% 10 docs 2.0k docs/s 400.0k tok/s 0.8 MB/s elapsed 0:00:05 ETA 0:00:15
"""

from __future__ import annotations

import time
from typing import TextIO

from tokenmill.common.progress import Progress as Display
from tokenmill.common.progress import format_duration, si

__all__ = ["Progress"]


class Progress:
    """Counts documents, tokens and bytes and reports them on ``stream``.

    Args:
        total_bytes: the size of the inputs still to process (for the percentage and ETA).
        enabled: report anything at all.
        stream: where to report (stderr).
        label: the line's prefix.
        log_interval: seconds between lines when ``stream`` is not interactive.
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
        self.documents = 0
        self.tokens = 0
        self.text_bytes = 0
        self.source_bytes = 0
        self._started = time.monotonic()
        self._display = Display(
            label,
            total=self.total_bytes,
            unit="B",
            unit_scale=True,
            status=self._status,
            postfix=self._postfix,
            enabled=enabled,
            stream=stream,
            log_interval=log_interval,
        )
        self.label = label
        self.enabled = enabled
        self.stream = self._display.stream

    def update(self, documents: int, tokens: int, text_bytes: int, source_bytes: int) -> None:
        """Add the counts of one finished chunk and redraw if it is time."""
        self.documents += documents
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.source_bytes += source_bytes
        self._display.update(source_bytes)

    def line(self, now: float | None = None) -> str:
        """The current status line."""
        return f"[{self.label}] {self._status(now)}"

    def write(self, text: str) -> None:
        """A message line (under the bar on a terminal)."""
        self._display.write(text)

    def _status(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._started, 1e-9)
        fraction = self.source_bytes / self.total_bytes if self.total_bytes else 1.0
        fraction = min(fraction, 1.0)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("inf")
        eta_text = format_duration(eta) if eta != float("inf") else "?"
        return (
            f"{100 * fraction:5.1f}% {self.documents:,} docs "
            f"{si(self.documents / elapsed)} docs/s {si(self.tokens / elapsed)} tok/s "
            f"{self.text_bytes / elapsed / 1e6:.1f} MB/s elapsed {format_duration(elapsed)} "
            f"ETA {eta_text}"
        )

    def _postfix(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return f"{self.documents:,} docs, {si(self.tokens / elapsed)} tok/s"

    def close(self) -> None:
        """Draw the final line."""
        self._display.close()

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return time.monotonic() - self._started
