"""What the `--plot` options of the command line share."""

from __future__ import annotations

import sys

__all__ = ["matplotlib_missing"]


def matplotlib_missing(command: str) -> bool:
    """True (after telling the user on stderr) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            f"tokenmill {command}: error: --plot needs matplotlib (pip install matplotlib)",
            file=sys.stderr,
        )
        return True
    return False
