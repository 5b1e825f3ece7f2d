"""Who wrote a temporary file, and whether that writer is provably gone.

Temporary files (``common.atomic``) carry their writer in their name,
``.<final name>.tm-<host>-<pid namespace>-<pid>.<random>.tmp``, so a cleaner on a shared
filesystem can tell a live builder's file (never touched) from one a killed process left behind:
the owner ran on this host, in this pid namespace (containers sharing a host name do not see
each other's pids), and its pid no longer exists; or the file is older than :data:`MAX_AGE`
whoever wrote it. A reused pid only keeps a dead writer's file longer. See
docs/cache-protocol.md.
"""

from __future__ import annotations

import os
import re
import socket
import time

__all__ = ["MAX_AGE", "is_abandoned", "owner_tag", "pid_alive", "pid_namespace"]

MAX_AGE = 24 * 3600.0
"""Seconds after which any temporary file is abandoned (no build writes for a day)."""

_TAG = re.compile(r"\.tm-(?P<host>[A-Za-z0-9_-]+)-(?P<ns>\d+)-(?P<pid>\d+)\.[^.]*\.tmp$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:64] or "host"


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux, or no /proc: only the age rule applies to others' files
        return 0


def owner_tag() -> str:
    """``tm-<host>-<pid namespace>-<pid>``: this process, as its temporary files name it."""
    return f"tm-{_host()}-{pid_namespace()}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_abandoned(name: str, mtime: float, now: float | None = None) -> bool:
    """Whether the temporary file `name` (last modified at `mtime`) provably has no live writer."""
    age = (time.time() if now is None else now) - mtime
    if age > MAX_AGE:
        return True
    match = _TAG.search(name)
    if match is None or match["host"] != _host():
        return False
    namespace = pid_namespace()
    if namespace == 0 or int(match["ns"]) != namespace:
        return False
    pid = int(match["pid"])
    return pid != os.getpid() and not pid_alive(pid)
