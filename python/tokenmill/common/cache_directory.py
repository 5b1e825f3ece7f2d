"""Cache directories other users cannot write into: one ``stat`` of the directory per build.

Every rank serves what the index cache holds, and an entry that looks valid (the description
matches byte for byte, the arrays have the expected dtypes, shapes and in-range values) is a
hit. Whoever can create files in the cache directory can therefore choose the samples a job
trains on. The rule:

* a directory writable by "other" (``S_IWOTH``) is refused with
  :class:`~tokenmill.errors.SharedCacheDirectoryError`, even with the sticky bit (``/tmp``'s
  1777): the sticky bit only stops others from removing or renaming *your* files, and an entry
  name nobody has written yet is free for anyone to create first;
* a group-writable directory is accepted: a cache shared by a group is normal on a cluster, and
  the group is trusted as its members are;
* a directory owned by another user (writable by us through the group, or read-only: a cache
  published by a colleague) is trusted as its owner is, like any other input data;
* ``TOKENMILL_ALLOW_SHARED_CACHE_DIR=1`` accepts a world-writable directory anyway (logged as a
  warning), for a machine whose users all trust each other;
* a directory that does not exist yet is accepted: the builder creates it with the process's
  umask.

Only the directory itself is judged, once per build (not per entry: a blend of 10,000 sources
stats it once), so a directory made world-writable after the check, or replaced through a
world-writable parent, is not seen.
"""

from __future__ import annotations

import logging
import os
import stat

from tokenmill.errors import SharedCacheDirectoryError

__all__ = ["ALLOW_VARIABLE", "check_cache_directory"]

logger = logging.getLogger(__name__)

ALLOW_VARIABLE = "TOKENMILL_ALLOW_SHARED_CACHE_DIR"
"""Set to ``1`` to use a cache directory every user can write (refused otherwise)."""


def _allowed() -> bool:
    raw = os.environ.get(ALLOW_VARIABLE, "")
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(f"environment variable {ALLOW_VARIABLE} must be 0 or 1, got {raw!r}")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_cache_directory(directory: str, what: str = "index cache directory") -> None:
    """Refuse `directory` if every user can write into it (one ``stat``; see the module).

    Args:
        directory: the cache directory (symlinks followed: the directory they name is judged).
        what: how the error names the directory.

    Raises:
        SharedCacheDirectoryError: the directory is world-writable and the opt-in is not set.
        ValueError: the opt-in variable has a value other than 0 or 1.
    """
    try:
        status = os.stat(directory)
    except OSError:
        return  # missing (we create it), or unreadable: the cache's own calls report that
    mode = stat.S_IMODE(status.st_mode)
    if not stat.S_ISDIR(status.st_mode) or not mode & stat.S_IWOTH:
        return
    if _allowed():
        logger.warning(
            "using the world-writable %s %s (mode %s, owner %s) because %s=1: any user of this "
            "machine can plant index arrays in it",
            what, directory, oct(mode), _owner(status.st_uid), ALLOW_VARIABLE,
        )  # fmt: skip
        return
    sticky = " (the sticky bit does not help: anyone can create an entry's files first)"
    raise SharedCacheDirectoryError(
        f"{what} {directory} is writable by every user (mode {oct(mode)}, owner "
        f"{_owner(status.st_uid)}): another user could plant cache files in it (valid-looking "
        f"index arrays or tokens) that every rank would then serve{sticky if mode & stat.S_ISVTX else ''}. Use a directory only "
        f"you or your group can write (e.g. chmod o-w {directory}, or a new directory), or set "
        f"{ALLOW_VARIABLE}=1 if every user of this machine is trusted"
    )
