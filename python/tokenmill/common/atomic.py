"""Atomic file writing shared by every layer (format writers, caches, manifests, sidecars): a
hidden temporary file beside the target, renamed into place on success and removed on failure, so
a reader never sees a partial file.

Why not a library: the well-known one (``atomicwrites``) is archived, and the writers here need
the open binary stream (formats stream gigabytes into it) and an explicit commit/abort, which
is these few lines over ``tempfile.mkstemp`` and ``os.replace``."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import BinaryIO, TypeVar

from tokenmill.common.owner import owner_tag

__all__ = ["AtomicFile", "AtomicWriter", "atomic_write_text", "default_file_mode"]


def default_file_mode() -> int:
    """0o666 minus the process umask (what ``open(..., "w")`` would give)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class AtomicFile:
    """A binary file written under a temporary name and renamed to ``path`` by :meth:`commit`.

    Args:
        path: the final path.

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory, name = os.path.split(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                errno.ENOENT, f"directory of {self.path} does not exist: {directory}"
            )
        descriptor, self.temporary_path = tempfile.mkstemp(
            prefix=f".{name}.{owner_tag()}.", suffix=".tmp", dir=directory
        )
        os.fchmod(descriptor, default_file_mode())
        self.stream: BinaryIO = os.fdopen(descriptor, "w+b")
        self._done = False

    def commit(self) -> None:
        """Flush, close and rename the temporary file to its final name."""
        if self._done:
            return
        self.stream.flush()
        self.stream.close()
        os.replace(self.temporary_path, self.path)
        self._done = True

    def abort(self) -> None:
        """Close and remove the temporary file (the final path is left untouched)."""
        if self._done:
            return
        self._done = True
        self.stream.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary_path)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


_Writer = TypeVar("_Writer", bound="AtomicWriter")


class AtomicWriter:
    """Context-manager behaviour of a writer over an AtomicFile `_file`: `finalize()` on a clean
    exit, `abort()` (nothing left behind) on an exception."""

    _file: AtomicFile

    def finalize(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Discard everything written."""
        self._file.abort()

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is None:
            self.finalize()
        else:
            self.abort()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename."""
    target = AtomicFile(path)
    try:
        target.stream.write(text.encode("utf-8"))
        target.commit()
    finally:
        target.abort()  # no-op after commit
