"""The best-effort file lock every cache shares (index entries, remote-cache fetches, local
copies of objects): an exclusive ``flock`` when the filesystem gives one, and nothing worse than
duplicate work when it does not.

On NFS mounted with ``local_lock`` and Lustre with ``localflock`` locks are node-local; with
``noflock`` they fail (``ENOLCK``). The callers are correct without the lock (they write under
temporary names and rename identical bytes), so a lock that cannot be taken is logged and the
work goes on. Running out of descriptors (or disk space for the lock file) is raised as what it
is (:class:`~tokenmill.errors.ResourceLimitError`). See docs/cache-protocol.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from typing import TextIO

from tokenmill.common.mapping import resource_error

__all__ = ["best_effort_lock"]

logger = logging.getLogger(__name__)


class _NotRegularFile(OSError):
    pass


# O_NOFOLLOW: a symlink planted at the lock's name (by another user of a shared cache) is
# refused, not followed into a file the link's author chose; O_NONBLOCK: a FIFO planted there
# does not block the open (an open for writing waits for a reader), and fstat refuses it.
_LOCK_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_APPEND
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def _open_lock_file(path: str) -> TextIO:
    try:
        descriptor = os.open(path, _LOCK_FLAGS, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, f"lock file {path} is a symbolic link: refused, not followed", path
            ) from None
        if error.errno == errno.ENXIO:  # a FIFO with no reader
            raise _NotRegularFile(
                errno.ENXIO, f"lock file {path} is not a regular file (a FIFO?): refused", path
            ) from None
        raise
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _NotRegularFile(
                errno.EINVAL,
                f"lock file {path} is not a regular file (mode {stat.filemode(mode)}): refused",
                path,
            )
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "a")


@contextlib.contextmanager
def best_effort_lock(path: str, doing: str, remove_on_release: bool = False) -> Iterator[bool]:
    """Hold an exclusive lock on the file `path` (created if needed) while the block runs, if
    the filesystem gives one (blocking while another process holds it); yields whether it does.

    Args:
        path: the lock file.
        doing: what the block does, for the log line when it runs without the lock.
        remove_on_release: remove the lock file when the block ends, so no lock file stays
            beside a cache entry (a waiter then holds a lock on a removed file and may do the
            work once more: harmless, like every lost lock here).

    Raises:
        ResourceLimitError: the lock file cannot be opened for lack of descriptors or space.
    """
    try:
        handle = _open_lock_file(path)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO) or isinstance(error, _NotRegularFile):
            raise
        limit = resource_error(error, path)
        if limit is not None:
            raise limit from error
        logger.info("%s without the lock %s (%s)", doing, path, error)
        yield False
        return
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            locked = True
        except OSError as error:
            logger.info(
                "%s without the lock %s: %s (locks only save duplicate work)",
                doing,
                path,
                errno.errorcode.get(error.errno or 0, error),
            )
            locked = False
        try:
            yield locked
        finally:
            if remove_on_release:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if locked:
                with contextlib.suppress(OSError):
                    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
