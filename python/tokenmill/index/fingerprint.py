"""Data fingerprints: detect a `.bin`/`.idx` replaced behind a cached index.

megatron-core keys its index caches by the dataset *path* only, so re-tokenising a corpus in place
silently reuses indices built for the old data. tokenmill records what the data looked like when a
cache entry was built, in a sidecar beside the entry, and compares it on every hit. The
megatron-defined files (description, its md5, the ``.npy`` arrays) stay byte-identical.

A file's fingerprint is its size, its ``st_mtime_ns`` and the xxh3-128 hash (:data:`HASH`) of
its first and last 4 KiB; an ``.idx``'s (what the index arrays are computed from) also the hash
of the whole file. Size and mtime catch a rewrite; the hashes catch copies that preserve both
(any change to an ``.idx``; a ``.bin`` change at either end). Records written before 2026-11-28
hold sha256 hashes (``sample_sha256``, ``sha256``): they are checked with sha256.

The sidecar also records each file's ``ctime_ns`` and inode. A later check whose ``stat`` finds
size, mtime, ctime and inode all unchanged, with the last change over
:data:`IDENTITY_MARGIN_NS` older than the sidecar, takes the recorded fingerprint without
reading the file (the ctime cannot be set by users, so nothing wrote the file since); any other
file is hashed and compared as above. A warm check is then one ``stat`` per data file.

The sidecar ``<hash>-<Class>-<split>-data.tokenmill.json`` holds::

    {"format": "tokenmill.data-fingerprint", "version": 1,
     "datasets": {"<prefix>": {".bin": {"size": 1234, "mtime_ns": 1700000000000000000,
                                        "sample_xxh3_128": "9f86...", "ctime_ns": ...,
                                        "inode": ...},
                               ".idx": {..., "xxh3_128": "6ee2..."}}}}

An entry tokenmill built also records its array files, ``"arrays": {"<name>": {"size": ...,
"mtime_ns": ..., "inode": ..., "generation": ...}}`` (the inode's generation where the filesystem
reports one): the builder checked every value before writing them, so a later load that finds
these very files (:func:`vouches_for`) skips the value checks. Where the filesystem sets mtimes at
write-back (NFS), the record may not match and the values are checked: slower, never wrong.

Rules (see :func:`stale_reasons`):

* sidecar present: every recorded file must match the current one, else the entry is stale;
* sidecar absent (megatron-core or an older tokenmill wrote the entry): the entry is accepted only
  if no data file is newer than the entry's description file; the builder then writes the sidecar
  (adoption), so later checks compare fingerprints.

Public API (used by the dataset caches and by ``tokenmill build-cache --check``):
:func:`fingerprint_file`, :func:`fingerprint_prefixes`, :func:`differences`,
:func:`read_fingerprint`, :func:`write_fingerprint`, :func:`stale_reasons`, :data:`POLICIES`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import xxhash

from tokenmill.common.atomic import FileStatus, WrittenFile
from tokenmill.common.sidecar import check_header
from tokenmill.common.whole_read import Contents, read_whole, refresh_attributes, sampled_ahead
from tokenmill.errors import DataFormatError

__all__ = [
    "ARRAY_FIELDS",
    "ARRAY_GENERATION",
    "DATA_SUFFIXES",
    "FINGERPRINT_SUFFIX",
    "FORMAT",
    "HASH",
    "POLICIES",
    "SAMPLE_BYTES",
    "VERSION",
    "FileMemo",
    "Sidecar",
    "array_status",
    "differences",
    "fingerprint_as_recorded",
    "fingerprint_bytes",
    "fingerprint_file",
    "fingerprint_prefixes",
    "fingerprint_read",
    "read_fingerprint",
    "reseal",
    "stale_reasons",
    "vouches_for",
    "write_fingerprint",
]

FORMAT = "tokenmill.data-fingerprint"
VERSION = 1
FINGERPRINT_SUFFIX = "data.tokenmill.json"
"""Suffix of the sidecar beside a cache entry: ``<hash>-<Class>-<split>-data.tokenmill.json``."""
DATA_SUFFIXES = (".bin", ".idx")
SAMPLE_BYTES = 4096
"""Bytes hashed at each end of a file."""

POLICIES = ("rebuild", "error", "off")
"""Values of the ``cache_data_check`` config field:

* ``"rebuild"`` (default): a stale entry is rebuilt by the cache-building rank (a warning is
  logged); other ranks raise :class:`~tokenmill.errors.StaleCacheError`.
* ``"error"``: a stale entry raises :class:`~tokenmill.errors.StaleCacheError` everywhere.
* ``"off"``: megatron-core's behaviour: the path-only key, no sidecar read or written.
"""

# The content hash of a file's record: xxh3-128 (the xxhash package, ~50 GB/s; sha256 runs at
# ~1.7 GB/s even with SHA extensions, and the whole .idx of a source is hashed on every cold
# build: 23 us of ~500 per source at 1,000 sources). Any accidental change (a rewrite, a copy,
# a truncation) changes a 128-bit hash but for a 2^-128 chance; it does not stand against
# someone who can write the data and crafts a collision, nor did the sampled hash of a .bin,
# which reads 8 KiB of it. Records written before it name sha256 and are checked with sha256.
HASH = "xxh3_128"
_HASH_ALGORITHMS = (HASH, "sha256")


class _Digest:
    """A streaming hash by its record name (xxh3_128, or sha256 for older records)."""

    def __init__(self, algorithm: str) -> None:
        self._hash: Any = xxhash.xxh3_128() if algorithm == HASH else hashlib.sha256()

    def update(self, data: Any) -> _Digest:
        self._hash.update(data)
        return self

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())


def _sample_field(algorithm: str) -> str:
    return "sample_" + algorithm


def record_hash(record: Mapping[str, Any]) -> str | None:
    """The hash a file's record was made with (the first sample field it has), or None."""
    for algorithm in _HASH_ALGORITHMS:
        if _sample_field(algorithm) in record:
            return algorithm
    return None


_FILE_FIELDS = ("size", "mtime_ns")
# Recorded beside them (optional): what lets a later check trust a file's stat (`_unchanged`).
_IDENTITY_FIELDS = ("ctime_ns", "inode")
# An `.idx`'s record also holds the hash of the whole file under the algorithm's own name
# (optional: older sidecars lack it; compared when both have it)
_HASH_FIELDS = frozenset(
    field for algorithm in _HASH_ALGORITHMS for field in (algorithm, _sample_field(algorithm))
)


def _read_at(descriptor: int, size: int, offset: int) -> bytes:
    """`size` bytes at `offset` (fewer only if the file shrank meanwhile)."""
    data = os.pread(descriptor, size, offset)
    while len(data) < size:
        more = os.pread(descriptor, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


_WHOLE_CHUNK = 1 << 20


def fingerprint_file(path: str | os.PathLike[str], algorithm: str = HASH) -> dict[str, Any]:
    """Size, modification time (ns) and the hash (:data:`HASH`, or `algorithm`: that of an older
    record compared with) of the first and last :data:`SAMPLE_BYTES`; for an ``.idx`` (what the
    index arrays are computed from) also the hash of the whole file.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    path = os.fspath(path)
    whole_file = path.endswith(".idx")
    if not whole_file:  # read ahead, if the builder did (common.whole_read.reading_ahead)
        ahead = sampled_ahead(path, SAMPLE_BYTES)
        if ahead is not None:
            read_status, head, tail = ahead
            sample = _Digest(algorithm).update(head).update(tail).hexdigest()
            return _record(read_status, algorithm, sample, None)
    # descriptor calls, not a Python file object: a cold blend fingerprints 2 files per source
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        status = os.fstat(descriptor)
        digest = _Digest(algorithm)
        digest.update(_read_at(descriptor, min(SAMPLE_BYTES, status.st_size), 0))
        if status.st_size > SAMPLE_BYTES:
            start = max(SAMPLE_BYTES, status.st_size - SAMPLE_BYTES)
            digest.update(_read_at(descriptor, status.st_size - start, start))
        whole = _whole_hash(descriptor, algorithm) if whole_file else None
    finally:
        os.close(descriptor)
    return _record(status, algorithm, digest.hexdigest(), whole)


def _record(status: Any, algorithm: str, sample: str, whole: str | None) -> dict[str, Any]:
    """A file's fingerprint record (:func:`fingerprint_file`, :func:`fingerprint_read`) from
    its status (``os.stat_result`` or ``FileStatus``) and hashes."""
    found: dict[str, Any] = {
        "size": int(status.st_size),
        "mtime_ns": int(status.st_mtime_ns),
        _sample_field(algorithm): sample,
        "ctime_ns": int(status.st_ctime_ns),
        "inode": int(status.st_ino),
    }
    if whole is not None:
        found[algorithm] = whole
    return found


def fingerprint_read(
    path: str | os.PathLike[str], status: FileStatus, contents: Contents, algorithm: str = HASH
) -> dict[str, Any] | None:
    """:func:`fingerprint_file`'s record of a file already read whole, from those bytes and the
    ``fstat`` of the same open (`common.whole_read.read_whole`): the same fields and hashes,
    nothing read again. A cold build fingerprints each ``.idx`` this way from the bytes its
    reader read, which are what the index arrays are computed from. None when `contents` is not
    the whole file by `status` (it changed under the read): read it again."""
    size = int(status.st_size)
    if len(contents) != size:
        return None
    view = memoryview(contents)
    digest = _Digest(algorithm).update(view[: min(SAMPLE_BYTES, size)])
    if size > SAMPLE_BYTES:
        digest.update(view[max(SAMPLE_BYTES, size - SAMPLE_BYTES) :])
    whole = None
    if os.fspath(path).endswith(".idx"):
        whole = _Digest(algorithm).update(view).hexdigest()
    return _record(status, algorithm, digest.hexdigest(), whole)


def _whole_hash(descriptor: int, algorithm: str) -> str:
    """The hash of everything the descriptor's file holds."""
    digest = _Digest(algorithm)
    offset = 0
    while chunk := os.pread(descriptor, _WHOLE_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


# How long before its sidecar was written a file's last change must be for the file's stat
# alone to vouch for it: file times move in clock ticks (milliseconds on Linux, up to seconds on
# some network filesystems), so a file changed in the tick it was fingerprinted in could show
# the same times after a second change ("racy" entries, as git calls them). Those are hashed.
IDENTITY_MARGIN_NS = 2_000_000_000


def _unchanged(status: os.stat_result, recorded: Mapping[str, Any], written_ns: int) -> bool:
    """Whether `status` is provably the file `recorded` describes: same size, mtime, ctime and
    inode, and its last change long enough before the sidecar was written. The ctime cannot be
    set by a user (a copy that keeps the mtime, `touch -d`, `rsync -t` all get a new one), so
    equal times and inode mean no write since the fingerprint."""
    ctime = recorded.get("ctime_ns")
    return (
        isinstance(ctime, int)
        and ctime + IDENTITY_MARGIN_NS < written_ns
        and status.st_ctime_ns == ctime
        and status.st_ino == recorded.get("inode")
        and status.st_size == recorded.get("size")
        and status.st_mtime_ns == recorded.get("mtime_ns")
    )


class FileMemo:
    """The fingerprint and ``stat`` of each data file, taken at most once during one build (held
    by its build context, `cache_writes.BuildContext`): a blend's entry names every member's
    files, so without it a blend of S sources fingerprints 2S files again for each of its
    entries after each member's own entry did. The data is assumed not to change during the
    build (a change is seen by the next build)."""

    def __init__(self) -> None:
        self.fingerprints: dict[tuple[str, str], dict[str, Any]] = {}  # by (path, hash)
        self.stats: dict[str, os.stat_result] = {}


def _stat_once(path: str, memo: FileMemo | None) -> os.stat_result:
    """``os.stat(path)``, taken at most once per `memo`."""
    if memo is None:
        return os.stat(path)
    found = memo.stats.get(path)
    if found is None:
        found = memo.stats[path] = os.stat(path)
    return found


WholeReads = Mapping[str, tuple[FileStatus, Contents]]
"""Data files already read whole, by path: the ``fstat`` of that open and the bytes read."""


def _fingerprint_once(
    path: str, memo: FileMemo | None, read: WholeReads | None = None, algorithm: str = HASH
) -> dict[str, Any]:
    key = (path, algorithm)
    found = memo.fingerprints.get(key) if memo is not None else None
    if found is None:
        whole = read.get(path) if read else None
        found = fingerprint_read(path, *whole, algorithm) if whole is not None else None
        if found is None:
            found = fingerprint_file(path, algorithm)
        if memo is not None:
            memo.fingerprints[key] = found
    return dict(found)


def fingerprint_prefixes(
    prefixes: Iterable[str], memo: FileMemo | None = None, read: WholeReads | None = None
) -> dict[str, Any]:
    """The fingerprint payload of the ``.bin`` and ``.idx`` of each dataset prefix (each file
    fingerprinted at most once per `memo`; a file in `read` from those bytes,
    :func:`fingerprint_read`).

    Raises:
        FileNotFoundError: a data file does not exist.
    """
    datasets = {
        prefix: {suffix: _fingerprint_once(prefix + suffix, memo, read) for suffix in DATA_SUFFIXES}
        for prefix in prefixes
    }
    return {"format": FORMAT, "version": VERSION, "datasets": datasets}


def fingerprint_as_recorded(prefixes: Iterable[str], recorded: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`fingerprint_prefixes`, each file hashed as its record in `recorded` was (sha256
    for a record older than xxh3-128), for :func:`differences` with it."""
    return _current_against(recorded, 0, prefixes, None)[0]  # written at 0: every file hashed


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What changed between two payloads of :func:`fingerprint_prefixes`, one line per field.

    Datasets recorded but not current (or the reverse) count as changes.
    """
    found: list[str] = []
    old, new = recorded.get("datasets", {}), current.get("datasets", {})
    for prefix in sorted(set(old) | set(new)):
        if prefix not in new:
            found.append(f"dataset {prefix!r} is recorded but not part of this config")
            continue
        if prefix not in old:
            found.append(f"dataset {prefix!r} has no recorded fingerprint")
            continue
        for suffix in sorted(set(old[prefix]) | set(new[prefix])):
            before, after = old[prefix].get(suffix), new[prefix].get(suffix)
            if before is None or after is None:
                found.append(f"{prefix}{suffix}: recorded {before!r}, now {after!r}")
                continue
            algorithm = record_hash(before)
            if algorithm is None or algorithm != record_hash(after):
                found.append(
                    f"{prefix}{suffix}: hashed with {algorithm}, now with {record_hash(after)}"
                )
                continue
            fields: tuple[str, ...] = (*_FILE_FIELDS, _sample_field(algorithm))
            if algorithm in before and algorithm in after:
                fields = (*fields, algorithm)
            for field in fields:
                if before.get(field) != after.get(field):
                    found.append(
                        f"{prefix}{suffix}: {field} was {before.get(field)!r}, "
                        f"now {after.get(field)!r}"
                    )
    return found


def read_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The payload of a fingerprint sidecar, or None if there is none.

    Raises:
        DataFormatError: the file exists but is not a valid fingerprint sidecar.
    """
    found = _read_fingerprint_dated(path)
    return None if found is None else found[0]


class Sidecar(NamedTuple):
    """A valid sidecar: its payload, its mtime (ns) and its raw bytes."""

    payload: dict[str, Any]
    written_ns: int
    raw: bytes
    changed_ns: int  # its st_ctime_ns: no array it vouches for changed after it
    inode: int = -1  # its st_ino: reseal touches only this very file


# A sidecar names two files per dataset: a blend of 10,000 sources writes about 3 MB.
_MAX_SIDECAR_BYTES = 1 << 24


def _read_fingerprint_dated(path: str | os.PathLike[str]) -> Sidecar | None:
    """The sidecar at `path`, or None if there is none; one that is not a valid sidecar is read
    once more after this machine's kernel fetched its attributes afresh: a sidecar is written
    under its final name in a batch, and the kernel may still hold the size it saw while
    another host was writing it (`whole_read.refresh_attributes`)."""
    path = os.fspath(path)
    try:
        return _read_sidecar(path)
    except DataFormatError:
        if not refresh_attributes(path):
            raise
    return _read_sidecar(path)


def _read_sidecar(path: str) -> Sidecar | None:
    """The sidecar at `path` as read, or None if there is none."""
    # one call (open, fstat, read, close without the GIL): a warm start reads one per entry
    try:
        raw, status = read_whole(path, _MAX_SIDECAR_BYTES)
    except FileNotFoundError:
        return None
    if not isinstance(raw, bytes):  # None: larger than the limit (an int only with keep_open)
        raise DataFormatError(
            f"{path}: {status.st_size} bytes, larger than any fingerprint sidecar "
            f"({_MAX_SIDECAR_BYTES})"
        )
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise DataFormatError(f"{path}: not a JSON fingerprint ({error})") from None
    _validate(payload, path)
    return Sidecar(
        dict(payload),
        int(status.st_mtime_ns),
        raw,
        int(status.st_ctime_ns),
        int(status.st_ino),
    )


def _current_against(
    recorded: Mapping[str, Any], written_ns: int, prefixes: Iterable[str], memo: FileMemo | None
) -> tuple[dict[str, Any], bool]:
    """The current fingerprint payload of `prefixes`, taking each file's recorded fingerprint
    when its stat proves it unchanged (:func:`_unchanged`: one ``stat``, no read) and hashing
    the others (:func:`fingerprint_file`); and whether every file was proven unchanged."""
    old = recorded.get("datasets", {})
    datasets: dict[str, Any] = {}
    all_unchanged = True
    for prefix in prefixes:
        files = {}
        for suffix in DATA_SUFFIXES:
            path = prefix + suffix
            entry = old.get(prefix, {}).get(suffix) if isinstance(old.get(prefix), dict) else None
            if isinstance(entry, dict) and _unchanged(_stat_once(path, memo), entry, written_ns):
                files[suffix] = dict(entry)
            else:
                # hashed as the record was (an older record: sha256), to be compared with it
                algorithm = (record_hash(entry) if isinstance(entry, dict) else None) or HASH
                files[suffix] = _fingerprint_once(path, memo, algorithm=algorithm)
                all_unchanged = False
        datasets[prefix] = files
    return {"format": FORMAT, "version": VERSION, "datasets": datasets}, all_unchanged


def reseal(
    path: str | os.PathLike[str],
    dated: Sidecar,
    prefixes: Iterable[str],
    memo: FileMemo | None = None,
) -> bool:
    """Re-date a sidecar whose data files were fingerprinted too soon after their last change
    for `stat` to vouch for them (:data:`IDENTITY_MARGIN_NS`), so that later checks take one
    ``stat`` per file instead of hashing it again, forever.

    Call it only after this very sidecar (`dated`) was found fresh by hashing and the arrays it
    records were vouched for (:func:`vouches_for`) under its current date. Then the data files
    hold what the builder fingerprinted as of that check; each still has the recorded size,
    mtime, ctime and inode, and its last change is now over the margin old, so any later write
    gives it another ctime. The payload is not rewritten (its bytes, hence the entry digest that
    ranks compare, stay the same): the file's times are set to now through a descriptor checked
    to be the sidecar that was read, which also moves its ctime (the seal of the arrays) past
    every array's. Best effort: a sidecar another user owns, or on a read-only filesystem, is
    left as it is.

    Returns:
        Whether the sidecar was re-dated (False when no file was racy, one still is, or a file
        is not the recorded one by `stat`: re-dating would prove nothing).
    """
    recorded = dated.payload.get("datasets", {})
    prefixes = list(prefixes)
    entries: list[tuple[str, Mapping[str, Any]]] = []
    racy = False
    for prefix in prefixes:  # the recorded times alone first: a warm hit is rarely racy
        files = recorded.get(prefix)
        for suffix in DATA_SUFFIXES:
            entry = files.get(suffix) if isinstance(files, dict) else None
            if not isinstance(entry, dict) or not isinstance(entry.get("ctime_ns"), int):
                return False
            entries.append((prefix + suffix, entry))
            racy = racy or entry["ctime_ns"] + IDENTITY_MARGIN_NS >= dated.written_ns
    if not racy:
        return False
    now = time.time_ns()
    for path_of_data, entry in entries:
        status = _stat_once(path_of_data, memo)
        if (
            status.st_ctime_ns != entry["ctime_ns"]
            or status.st_ino != entry.get("inode")
            or status.st_size != entry.get("size")
            or status.st_mtime_ns != entry.get("mtime_ns")
            or status.st_ctime_ns + IDENTITY_MARGIN_NS >= now
        ):
            return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return False
    try:
        status = os.fstat(descriptor)
        if (status.st_ino, status.st_mtime_ns, status.st_ctime_ns) != (
            dated.inode,
            dated.written_ns,
            dated.changed_ns,
        ):
            return False  # replaced or touched since it was read: not the sidecar checked
        os.utime(descriptor)
    except OSError:  # EPERM (another owner), EROFS
        return False
    finally:
        os.close(descriptor)
    return True


ARRAY_FIELDS = ("size", "mtime_ns", "inode")
"""Fields of each entry of a sidecar's optional ``arrays`` record (see :func:`vouches_for`),
besides the optional ``generation`` (:data:`ARRAY_GENERATION`)."""

ARRAY_GENERATION = "generation"
"""The optional field of an ``arrays`` entry: the inode's generation, where the filesystem
reports one (``_core.inode_generation``; absent in records of older tokenmill)."""


def array_status(status: FileStatus) -> dict[str, int]:
    """The ``arrays`` record of one cached array file, from its status (with the inode's
    generation when the filesystem reported one)."""
    record = {
        "size": int(status.st_size),
        "mtime_ns": int(status.st_mtime_ns),
        "inode": int(status.st_ino),
    }
    if status.st_gen >= 0:
        record[ARRAY_GENERATION] = int(status.st_gen)
    return record


def vouches_for(
    recorded: Mapping[str, Any] | None,
    current: Mapping[str, dict[str, int]],
    sealed_ns: int | None = None,
) -> bool:
    """Whether a sidecar's ``arrays`` record names exactly the files now in place, unchanged
    since the sidecar was written.

    `current`: each array file's :func:`array_status` plus its ``ctime_ns``; `sealed_ns`: the
    sidecar's own ctime. The builder writes the sidecar after the arrays (renamed, or written in
    place, before it), so an array file whose ctime is later than the sidecar's was changed
    since: a rewrite in place that put its mtime back (``touch -d``, ``cp -p``) cannot set the
    ctime back. Without `sealed_ns` the record does not vouch.

    The builder that wrote the sidecar checked every value of the arrays it built (or built them
    with tokenmill's own kernels) and recorded, for each array file it wrote, its size, mtime,
    inode and (where the filesystem reports one) the inode's generation; a rename keeps them
    all. The same values now mean the same file, unmodified since: a rewrite changes the mtime,
    a replacement the inode, and a replacement that was given the freed number of the original
    inode within one tick of the clock (the same mtime) a new generation. Its values need no
    second check. Anything else (no record, an entry adopted from megatron-core, racing builders
    whose files and sidecar come from different writers, a generation recorded but not readable
    now) means check them. A record without generations (older tokenmill) is compared on the
    other fields.
    """
    arrays = recorded.get("arrays") if recorded is not None else None
    if not isinstance(arrays, dict) or not current or sealed_ns is None:
        return False
    for name, found in current.items():
        status = dict(found)
        changed = status.pop("ctime_ns", None)
        if changed is None or changed > sealed_ns:
            return False
        record = arrays.get(name)
        if isinstance(record, dict) and ARRAY_GENERATION not in record:
            # recorded before generations were: compare the other fields
            status = {field: value for field, value in status.items() if field != ARRAY_GENERATION}
        if record != status:
            return False
    return True


def _is_count(value: Any) -> bool:
    """A JSON integer >= 0 (sizes, times, inodes; not a bool)."""
    return type(value) is int and value >= 0  # json.loads makes exact ints; a bool is no count


_ABSENT = object()
_ARRAY_FIELD_SET = frozenset(ARRAY_FIELDS)
_ARRAY_FIELD_SET_WITH_GENERATION = frozenset((*ARRAY_FIELDS, ARRAY_GENERATION))
_DATA_SUFFIX_SET = frozenset(DATA_SUFFIXES)


def _check_fields(
    entry: Mapping[str, Any],
    fields: Sequence[str],
    where: tuple[str, object, object],
    path: str,
    optional: Sequence[str] = (),
) -> None:
    """Each of `fields` of `entry` a count (the sample hash: a string); `optional` ones may be
    absent. `where` names the entry in the error, a format and its two values (formatted only
    then: a warm start validates a sidecar per cache entry)."""
    for field in fields:
        value = entry.get(field, _ABSENT)
        if value is _ABSENT and field in optional:
            continue
        if field in _HASH_FIELDS:
            if type(value) is str:
                continue
        elif type(value) is int and value >= 0:
            continue
        shown = None if value is _ABSENT else value
        named = where[0].format(where[1], where[2])
        raise DataFormatError(f"{path}: {named} field {field!r} is invalid: {shown!r:.80}")


def _validate(payload: Any, path: str) -> None:
    check_header(payload, path, FORMAT, VERSION, "fingerprint", DataFormatError)
    arrays = payload.get("arrays")
    if arrays is not None:
        if not isinstance(arrays, dict):
            raise DataFormatError(f"{path}: 'arrays' must be an object, got {arrays!r:.80}")
        for name, entry in arrays.items():
            if not isinstance(entry, dict) or (
                entry.keys() != _ARRAY_FIELD_SET
                and entry.keys() != _ARRAY_FIELD_SET_WITH_GENERATION
            ):
                raise DataFormatError(
                    f"{path}: arrays[{name!r}] must map {list(ARRAY_FIELDS)} (and optionally "
                    f"{ARRAY_GENERATION!r}) to integers, got {entry!r:.80}"
                )
            _check_fields(
                entry,
                (*ARRAY_FIELDS, ARRAY_GENERATION),
                ("arrays[{!r}]{}", name, ""),
                path,
                optional=(ARRAY_GENERATION,),
            )
    datasets = payload.get("datasets")
    if not isinstance(datasets, dict):
        raise DataFormatError(f"{path}: 'datasets' must be an object, got {datasets!r:.80}")
    for prefix, files in datasets.items():
        if not isinstance(files, dict) or files.keys() != _DATA_SUFFIX_SET:
            raise DataFormatError(
                f"{path}: dataset {prefix!r} must map {list(DATA_SUFFIXES)} to file "
                f"fingerprints, got {files!r:.80}"
            )
        for suffix, entry in files.items():
            if not isinstance(entry, dict):
                raise DataFormatError(f"{path}: {prefix}{suffix} must be an object")
            algorithm = record_hash(entry)
            if algorithm is None:
                raise DataFormatError(
                    f"{path}: {prefix}{suffix} has no sample hash "
                    f"({' or '.join(_sample_field(name) for name in _HASH_ALGORITHMS)})"
                )
            # the identity fields and the whole hash are optional (older sidecars)
            optional = (*_IDENTITY_FIELDS, algorithm)
            _check_fields(
                entry,
                (*_FILE_FIELDS, _sample_field(algorithm), *optional),
                ("{}{}", prefix, suffix),
                path,
                optional=optional,
            )


def fingerprint_writer(
    path: str | os.PathLike[str],
    payload: Mapping[str, Any],
    background: bool = False,
    made_here: bool = False,
) -> WrittenFile:
    """A fingerprint sidecar written under its temporary name (`background`: being written,
    see WrittenFile), for the caller to commit (or abort).

    `made_here`: the payload was made by this module (`fingerprint_prefixes`, `array_status`),
    so its structure is not checked again (a cold blend writes one sidecar per source)."""
    return WrittenFile(path, (fingerprint_bytes(path, payload, made_here),), background=background)


def fingerprint_bytes(
    path: str | os.PathLike[str], payload: Mapping[str, Any], made_here: bool = False
) -> bytes:
    """The bytes of the sidecar at `path` holding `payload` (`made_here`: see
    fingerprint_writer)."""
    if not made_here:
        _validate(payload, os.fspath(path))
    # compact: json.dumps with indent runs the pure-Python encoder, 4x slower on a blend's
    # sidecar (2 files per source); `python -m json.tool` shows it indented
    return (json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


def write_fingerprint(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> None:
    """Write a fingerprint sidecar atomically (temporary file + rename)."""
    fingerprint_writer(path, payload).commit()


def _against(
    recorded: Mapping[str, Any], written_ns: int, prefixes: Iterable[str], memo: FileMemo | None
) -> tuple[list[str], dict[str, Any], bool]:
    """(reasons, current payload, proven by stat alone) of `prefixes` against a sidecar."""
    current, all_unchanged = _current_against(recorded, written_ns, prefixes, memo)
    if all_unchanged and len(current["datasets"]) == len(recorded["datasets"]):
        # every recorded file is a current one, proven unchanged, and none is missing (the
        # prefixes are distinct keys of both): nothing to compare
        return [], current, True
    return differences(recorded, current), current, False


def stale_reasons(
    prefixes: Iterable[str],
    sidecar: str | os.PathLike[str],
    description: str | os.PathLike[str],
    recorded_out: dict[str, Any] | None = None,
    memo: FileMemo | None = None,
    sidecar_out: list[Sidecar] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Why a cache entry no longer matches its data (empty when it is fresh).

    Args:
        prefixes: the dataset prefixes the entry was built from.
        sidecar: the entry's fingerprint sidecar (may be missing).
        description: the entry's description file, whose mtime dates an entry without sidecar.
        recorded_out: if given, receives the sidecar's payload (when there is a valid one).
        memo: fingerprints and stats already taken in this build.
        sidecar_out: if given, receives the sidecar (when there is a valid one).

    Returns:
        (reasons, current fingerprint payload: without a sidecar, one naming no dataset).

    Raises:
        FileNotFoundError: a data file is missing.
    """
    prefixes = list(prefixes)
    try:
        dated = _read_fingerprint_dated(sidecar)
    except DataFormatError as error:
        return [str(error)], fingerprint_prefixes(prefixes, memo)
    if dated is not None:
        if recorded_out is not None:
            recorded_out.update(dated.payload)
        if sidecar_out is not None:
            sidecar_out.append(dated)
        reasons, compared, _ = _against(dated.payload, dated.written_ns, prefixes, memo)
        return reasons, compared
    # No sidecar: megatron-core (or an older tokenmill) wrote the entry. Accept it only if the
    # data predates it; a data file written after the entry cannot be what it was built from.
    # One stat per data file, nothing read: the current payload stays empty (the caller
    # fingerprints the data itself if it adopts the entry).
    current: dict[str, Any] = {"format": FORMAT, "version": VERSION, "datasets": {}}
    try:
        built_ns = os.stat(description).st_mtime_ns
    except FileNotFoundError:
        return [f"{os.fspath(description)}: missing"], current
    reasons = []
    for prefix in prefixes:
        for suffix in DATA_SUFFIXES:
            modified = _stat_once(prefix + suffix, memo).st_mtime_ns
            if modified > built_ns:
                reasons.append(
                    f"{prefix}{suffix} (modified at {modified} ns) is newer than the "
                    f"cache entry {os.fspath(description)} (written at {built_ns} ns) and the "
                    "entry has no data fingerprint"
                )
    return reasons, current
