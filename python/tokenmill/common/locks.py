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
from collections.abc import Iterator

from tokenmill.common.mapping import resource_error

__all__ = ["best_effort_lock"]

logger = logging.getLogger(__name__)


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
        handle = open(path, "a")  # noqa: SIM115 - closed below, after the unlock
    except OSError as error:
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
