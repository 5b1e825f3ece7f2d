"""One-line CLI errors: every failure of a subcommand ends as ``tokenmill CMD: error: ...``.

The subcommands catch the errors they expect and print them; whatever escapes (a directory where
a file belongs, a mistyped config value, ``MemoryError``, a bug) reaches :func:`report_error`
instead of a traceback. ``tokenmill --debug ...`` re-raises it with the traceback. Ctrl-C and
SIGTERM end the whole job with one line and exit status 130; outputs are written under temporary
names and resumable parts are kept, so rerunning the same command resumes.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

__all__ = [
    "INTERRUPTED",
    "MAX_MESSAGE",
    "install_sigterm",
    "one_line",
    "report_error",
    "restore_sigterm",
]

INTERRUPTED = 130
MAX_MESSAGE = 2000
"""Characters of a message shown: a value formatted into it (an alias bomb, a huge list) cannot
flood the terminal or grow memory."""


def one_line(text: object, limit: int = MAX_MESSAGE) -> str:
    """``str(text)`` on one line, at most ``limit`` characters (the cut is marked)."""
    message = " ".join(str(text).split())
    if len(message) > limit:
        message = message[: limit - 25] + f" ... ({len(message) - limit + 25} more chars)"
    return message


def report_error(command: str, error: BaseException) -> int:
    """Print ``error`` as one line naming it and return the exit status."""
    if isinstance(error, KeyboardInterrupt):
        resumes = "; finished parts are kept, rerun the same command to resume"
        sys.stderr.write(
            f"tokenmill {command}: interrupted"
            f"{resumes if command in ('tokenize', 'merge', 'download') else ''}\n"
        )
        return INTERRUPTED
    if isinstance(error, MemoryError):
        text = f"out of memory (MemoryError{': ' + str(error) if str(error) else ''})"
    elif isinstance(error, RecursionError):
        text = f"input nested too deeply (RecursionError: {error})"
    else:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    sys.stderr.write(f"tokenmill {command}: error: {one_line(text)} (--debug for the traceback)\n")
    return 1


def _terminate(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise KeyboardInterrupt


def install_sigterm() -> object:
    """Make SIGTERM end the job like Ctrl-C: the same cleanup, one line, exit 130.

    Returns:
        The previous handler (for :func:`restore_sigterm`), or None when it could not be set.
    """
    try:
        return signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (main() called from a thread): leave it
        return None


def restore_sigterm(previous: object) -> None:
    """Put back the handler :func:`install_sigterm` replaced."""
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
