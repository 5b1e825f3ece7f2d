"""Who wrote a temporary file, and whether that writer is provably gone.

Temporary files (``common.atomic``) carry their writer in their name,
``.<final name>.tm-<host>-<boot>-<pid namespace>-<pid>.<number>.tmp``, so a cleaner on a shared
filesystem can tell a live builder's file (never touched) from one a killed process left behind:
the owner ran on this machine since its last boot (the host name and the kernel's random boot
id, both: machine images and containers often share a host name, and the pid namespace of
processes outside containers has the same inode on every machine), in this pid namespace
(containers sharing a kernel do not see each other's pids), and its pid no longer exists; or the
file is older than :data:`MAX_AGE` whoever wrote it. A reused pid only keeps a dead writer's file
longer. See docs/cache-protocol.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable

__all__ = [
    "MAX_AGE",
    "boot_id",
    "is_abandoned",
    "owner_tag",
    "pid_alive",
    "pid_namespace",
    "remove_abandoned",
    "tag",
]

MAX_AGE = 24 * 3600.0
"""Seconds after which any temporary file is abandoned (no build writes for a day)."""

_TAG = re.compile(
    r"\.tm-(?P<host>[A-Za-z0-9_-]+)-(?P<boot>[0-9a-f]{12})-(?P<ns>\d+)-(?P<pid>\d+)\.[^.]*\.tmp$"
)
_UNKNOWN_BOOT = "0" * 12


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:64] or "host"


_BOOT_ID: str | None = None


def boot_id() -> str:
    """12 hex digits of the kernel's random boot id (``/proc/sys/kernel/random/boot_id``): this
    machine since its last boot, shared by its containers ("000000000000" where it cannot be
    read: only the age rule then applies to other processes' files)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as stream:
                digits = stream.read().strip().replace("-", "").lower()
        except OSError:  # not Linux, or no /proc
            digits = ""
        _BOOT_ID = digits[:12] if re.fullmatch(r"[0-9a-f]{12,}", digits) else _UNKNOWN_BOOT
    return _BOOT_ID


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux, or no /proc: only the age rule applies to others' files
        return 0


# The tag of this process: every temporary file carries it, and a blend's cold build writes
# thousands of them (three system calls each to recompute it, one to compare a pid); a forked
# child forgets its parent's (the at-fork hook) and recomputes it
_OWNER_TAG: str | None = None


def _forget_tag_in_child() -> None:
    global _OWNER_TAG
    _OWNER_TAG = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_tag_in_child)


def tag(host: str, namespace: int, pid: int) -> str:
    """``tm-<host>-<boot>-<pid namespace>-<pid>``: the tag of process `pid` of pid namespace
    `namespace` on a machine named `host`, booted as this one (tests plant others' files)."""
    return f"tm-{host}-{boot_id()}-{namespace}-{pid}"


def owner_tag() -> str:
    """``tm-<host>-<boot>-<pid namespace>-<pid>``: this process, as its temporary files name
    it."""
    global _OWNER_TAG
    found = _OWNER_TAG
    if found is None:
        pid = os.getpid()
        found = _OWNER_TAG = tag(_host(), pid_namespace(), pid)
    return found


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
    boot = boot_id()
    if boot == _UNKNOWN_BOOT or match["boot"] != boot:  # another machine of the same name
        return False
    namespace = pid_namespace()
    if namespace == 0 or int(match["ns"]) != namespace:
        return False
    pid = int(match["pid"])
    return pid != os.getpid() and not pid_alive(pid)


def remove_abandoned(directory: str | os.PathLike[str], wanted: Callable[[str], bool]) -> None:
    """Remove the entries of `directory` whose name `wanted` selects and that provably have no
    live writer (:func:`is_abandoned`): files are unlinked, directories removed with their
    contents. Best effort per entry (another cleaner may be faster).

    Raises:
        OSError: `directory` cannot be listed.
    """
    # names only (listdir, not scandir): a warm start sweeps a directory of thousands of cache
    # files for the few it wants, and a DirEntry per file costs more than the listing
    for name in os.listdir(directory):
        if not wanted(name):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            status = os.lstat(path)
            if not is_abandoned(name, status.st_mtime):
                continue
            if stat.S_ISDIR(status.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
