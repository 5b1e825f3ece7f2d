"""Check an allocation against the memory the machine has before making it.

A size that comes from a file or a config (a corrupt length, an absurd sample count) used to be
allocated first and fail later, after the machine swapped or the OOM killer took the job. A
builder calls :func:`check_allocation` with the bytes it is about to allocate: more than the
memory available (``MemAvailable`` of ``/proc/meminfo``, else physical memory, plus the swap
free) raises a MemoryError naming what was to be allocated, its size and the limit, before any
allocation. ``TOKENMILL_MEMORY_BUDGET`` (bytes) overrides the limit (tests, shared machines).

Why not ``psutil``: it is not a dependency, and one read of ``/proc/meminfo`` is all this needs.
"""

from __future__ import annotations

import os
import time

__all__ = ["available_memory", "check_allocation"]

# (monotonic time, bytes) of the last /proc/meminfo read: a blend of 1,000 sources checks 1,000
# small allocations in a second, and one read per 0.2 s is as good an answer
_LAST_READ: tuple[float, int | None] | None = None
_READ_EVERY = 0.2


def available_memory() -> int | None:
    """Bytes this process may allocate: the override, MemAvailable, or physical memory."""
    global _LAST_READ
    override = os.environ.get("TOKENMILL_MEMORY_BUDGET")
    if override:
        return int(override)
    now = time.monotonic()
    last = _LAST_READ
    if last is not None and now - last[0] < _READ_EVERY:
        return last[1]
    found = _read_available()
    _LAST_READ = (now, found)
    return found


def _read_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as stream:
            fields = dict(line.split(":", 1) for line in stream if ":" in line)
        total = 0
        for name in ("MemAvailable", "SwapFree"):
            if name in fields:
                total += int(fields[name].split()[0]) * 1024
        if total:
            return total
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_allocation(nbytes: int, what: str) -> None:
    """MemoryError before allocating ``nbytes`` for ``what`` if the machine cannot hold them.

    Args:
        nbytes: the bytes about to be allocated.
        what: names the arrays and the values that sized them, for the message.

    Raises:
        MemoryError: ``nbytes`` exceeds the available memory.
    """
    limit = available_memory()
    if limit is not None and nbytes > limit:
        raise MemoryError(
            f"{what} needs {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB) but only {limit:,} bytes "
            f"({limit / 2**30:.1f} GiB) are available; the sizes come from the data or config "
            "named above"
        )
