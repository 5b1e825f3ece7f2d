"""Writing the files of index-cache entries: atomically, durably, and in batches.

An entry is its arrays (``numpy.save``, megatron-core's bytes), tokenmill's data fingerprint
sidecar and the description, the commit point. :func:`write_entry` writes all of them under
temporary names and commits them with `tokenmill.common.atomic.commit_together`: the data files
fsynced and renamed first, the description after them, so a committed description always has
whole arrays on disk, after a lost machine as after a killed process.

:func:`deferred_commits` batches that commit across entries: a blend of 1,000 sources writes
5,000 files, which fsynced one after the other took tens of seconds on a busy disk; in one
parallel round they take a fraction of a second. The reading side, locks and the rules of a hit
are `tokenmill.index.cache`; the protocol is docs/cache-protocol.md.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import WrittenFile, commit_together
from tokenmill.index import fingerprint as data_fingerprint

__all__ = ["atomic_save_npy", "batch_active", "deferred_commits", "write_entry"]

# The entries written inside deferred_commits(), committed together when it ends: per entry,
# its data files and its description. Process-wide rather than a contextvar: the builder
# constructs the members of a blend on a thread pool, and executor threads do not inherit the
# caller's context.
_DEFERRED: list[tuple[list[WrittenFile], WrittenFile]] | None = None
_DEFERRED_LOCK = threading.Lock()


def npy_header(array: npt.NDArray[Any]) -> bytes:
    """The header ``numpy.save`` writes before `array`'s bytes (format 1.0, or 2.0 when the
    header does not fit 1.0's 16-bit length), for a C-contiguous `array`."""
    header = io.BytesIO()
    fields = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(header, fields)
    except ValueError:  # "header does not fit inside 65535 bytes"
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, fields)
    return header.getvalue()


def _npy_writer(path: Path, array: npt.NDArray[Any]) -> WrittenFile:
    """`array` written as ``numpy.save`` writes it (the same bytes, megatron-core's format),
    under the temporary name of `path`, for the caller to commit."""
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ValueError(f"{path}: cannot cache an array of Python objects ({array.dtype})")
    return WrittenFile(path, (npy_header(array), array))


def atomic_save_npy(path: Path, array: npt.NDArray[Any]) -> None:
    """numpy.save `array` to `path` (same bytes) through a temporary file and a rename."""
    _npy_writer(path, array).commit()


def write_entry(
    array_paths: Mapping[str, Path],
    arrays: Mapping[str, npt.NDArray[Any]],
    fingerprint_path: Path,
    fingerprint: Mapping[str, Any] | None,
    description_path: Path,
    description: str,
    vouch: bool,
) -> None:
    """Write an entry's arrays, data fingerprint (if any) and description under temporary
    names, then commit them (now, or when the enclosing :func:`deferred_commits` ends).

    `vouch`: every value of `arrays` is valid (checked, or built by tokenmill's own kernels);
    the fingerprint then records each array file's size, mtime and inode (a rename keeps all
    three), so later loads of these very files skip the value checks
    (`fingerprint.vouches_for`).
    """
    files: list[WrittenFile] = []
    written: dict[str, dict[str, int]] = {}
    try:
        for name, path in array_paths.items():
            file = _npy_writer(path, arrays[name])
            files.append(file)
            written[name] = data_fingerprint.array_status(file.status)
        if fingerprint is not None:
            vouched = {**fingerprint, "arrays": written} if vouch else dict(fingerprint)
            files.append(data_fingerprint.fingerprint_writer(fingerprint_path, vouched))
        committing = WrittenFile(description_path, (description.encode("utf-8"),))
        files.append(committing)
    except BaseException:
        for file in files:
            file.abort()
        raise
    with _DEFERRED_LOCK:
        batch = _DEFERRED
        if batch is not None:
            batch.append((files[:-1], committing))
            return
    _commit_entries([(files[:-1], committing)])


def batch_active() -> bool:
    """Whether entries written now are committed only when a :func:`deferred_commits` ends."""
    return _DEFERRED is not None


@contextlib.contextmanager
def deferred_commits() -> Iterator[None]:
    """Within the block, :func:`write_entry` writes each entry's files and every entry is
    committed at the end, together: one parallel round of fsyncs for all files instead of
    serial ones per entry. Every entry's data files are renamed before any description (the
    commit point), and the directory is fsynced once per round.

    Entries written in the block are used from memory by this process and become visible to
    others when it ends: the builder wraps its whole batch in it, before its collective reports
    success. Entries completed before an exception are still committed (each is complete and
    checked). Nested blocks join the outermost one.
    """
    global _DEFERRED
    with _DEFERRED_LOCK:
        outermost = _DEFERRED is None
        if outermost:
            _DEFERRED = []
    if not outermost:
        yield
        return
    try:
        yield
    finally:
        with _DEFERRED_LOCK:
            entries, _DEFERRED = _DEFERRED or [], None
        if entries:
            _commit_entries(entries)


def _commit_entries(entries: Sequence[tuple[Sequence[WrittenFile], WrittenFile]]) -> None:
    """Data files of every entry, then every description; on failure nothing uncommitted is left
    behind (temporary files are removed)."""
    try:
        commit_together([file for files, _ in entries for file in files])
        commit_together([description for _, description in entries])
    finally:
        for files, description in entries:
            for file in (*files, description):
                file.abort()  # no-op after commit
