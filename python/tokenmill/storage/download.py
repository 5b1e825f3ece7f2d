"""Download a published manifest or a shard list: parallel, verified, resumable.

`source` is a manifest (local path, `s3://` or `http(s)://` URL), a `Manifest`, or a plain shard
list (`URL [sha256]` lines, nanochat-style). Objects are fetched by `workers` threads in manifest
order into `<local_dir>/.<name>.partial` and renamed to their key once their size and sha256
match the manifest, so a file under its final name is always complete and verified; the
published modification time is restored, so the data fingerprints beside index cache entries
still match. HTTP fetches retry connection errors, timeouts and 5xx/429 answers with exponential
backoff (full jitter, as `tokenmill.storage.s3` does for S3, whose client retries on its own);
after a kill, the next run skips finished objects (remembered in
`<local_dir>/.tokenmill-download.json` by size and mtime, so they are not even re-hashed) and
continues partial files from the byte they reached with ranged requests. A checksum mismatch
raises `tokenmill.errors.ChecksumError` naming the object, the file and both digests, and removes
the bad bytes.

`DownloadJob.wait(key)` returns as soon as one object is in place, so a dataset can open its
first shards while the rest still download.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tokenmill.common.atomic import atomic_write_text, durable_replace
from tokenmill.errors import ChecksumError, ObjectStorageError
from tokenmill.storage.manifest import (
    Manifest,
    ManifestObject,
    check_key,
)
from tokenmill.storage.transfer import (
    READ_BYTES,
    Deadline,
    RangeNotSatisfiable,
    TransferPolicy,
    http_open,
    is_http_location,
    is_s3_location,
    join_location,
    load_manifest,
    s3_client,
    sha256_file,
    url_within,
)

__all__ = [
    "STATE_NAME",
    "DownloadJob",
    "DownloadReport",
    "check_source",
    "download",
    "start_download",
]

STATE_NAME = ".tokenmill-download.json"


@dataclass
class DownloadReport:
    """What a download did."""

    local_dir: str
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    seconds: float = 0.0


def _open_partial(partial: str) -> BinaryIO:
    """The partial file `partial` opened for appending: created if missing, never through a
    symlink (O_NOFOLLOW), and never a file with another name (a hard link planted there would
    have its other name overwritten) or a special file.

    Raises:
        ValueError: naming the file and what it is.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        descriptor = os.open(partial, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"refusing to write through the symlink {partial}") from None
        raise
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"refusing to write to {partial}: it is not a regular file")
        if status.st_nlink > 1:
            raise ValueError(
                f"refusing to write to {partial}: it has {status.st_nlink} names (a hard link "
                "to another file; tokenmill did not create it)"
            )
        return os.fdopen(descriptor, "ab")
    except BaseException:
        os.close(descriptor)
        raise


def _partial_size(partial: str) -> int:
    """The bytes a partial file holds (0 if absent), checked as _open_partial checks it."""
    try:
        status = os.lstat(partial)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        with _open_partial(partial):  # raises naming what it is
            pass
    return status.st_size


def _restart_partial(partial: str) -> None:
    """Empty the partial file (through the checks of _open_partial, never by path)."""
    with _open_partial(partial) as stream:
        stream.truncate(0)


def _partial_path(final: str) -> str:
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}.partial")


class _State:
    """Objects known complete: key -> [size, mtime_ns, sha256] (saved atomically, thread-safe)."""

    def __init__(self, local_dir: str) -> None:
        self.path = os.path.join(local_dir, STATE_NAME)
        self.lock = threading.Lock()
        self.entries: dict[str, list[Any]] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            with open(self.path, encoding="utf-8") as stream:
                loaded = json.load(stream)
            if isinstance(loaded, dict):
                self.entries = {k: v for k, v in loaded.items() if isinstance(v, list)}

    def verified(self, key: str, path: str, digest: str | None) -> bool:
        try:
            status = os.stat(path)
        except FileNotFoundError:
            return False
        with self.lock:
            entry = self.entries.get(key)
        return entry == [status.st_size, status.st_mtime_ns, digest]

    def record(self, key: str, path: str, digest: str | None) -> None:

        status = os.stat(path)
        with self.lock:
            self.entries[key] = [status.st_size, status.st_mtime_ns, digest]
            atomic_write_text(Path(self.path), json.dumps(self.entries, sort_keys=True))


def _announced_size(response: Any, have: int) -> int | None:
    """The whole object's size as the server states it (Content-Range or Content-Length)."""
    if response.status == 206:
        content_range = response.headers.get("Content-Range", "")
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    return int(length) if length is not None and length.isdigit() else None


def _fetch_http(
    url: str, partial: str, size: int | None, policy: TransferPolicy, confine: str | None = None
) -> int:
    """Append the missing bytes of `url` to `partial`; returns bytes received (at most `size`:
    a longer body is stopped). `confine`: redirects may not leave this prefix. All attempts
    together end at the object's deadline (`Deadline.for_object`): DeadlinePassed."""
    deadline = Deadline.for_object(policy, url, size)
    try:
        return _fetch_http_within(url, partial, size, policy, confine, deadline)
    finally:
        deadline.close()


def _fetch_http_within(
    url: str,
    partial: str,
    size: int | None,
    policy: TransferPolicy,
    confine: str | None,
    deadline: Deadline,
) -> int:
    received = 0
    attempt = 0
    while True:
        have = _partial_size(partial)
        if size is not None and have > size:
            _restart_partial(partial)
            have = 0
        if size is not None and have == size:
            return received
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            response = http_open(url, policy, headers, confine, deadline)
        except RangeNotSatisfiable:  # the object is shorter than our partial: start over
            if not have:
                raise ObjectStorageError(f"{url}: HTTP 416 for a request without range") from None
            _restart_partial(partial)
            continue
        total = _announced_size(response, have)
        if size is not None and total is not None and total != size:
            response.close()
            raise ChecksumError(f"{url}: the object has {total} bytes but the manifest says {size}")
        try:
            with response, _open_partial(partial) as stream:
                if have and response.status != 206:  # the server ignored the range
                    stream.truncate(0)
                    have = 0
                # read1: whatever has arrived (up to 1 MiB), so a kill loses little; never
                # more than one byte past the declared size (a body that never ends)
                while block := response.read1(
                    READ_BYTES if size is None else max(1, min(READ_BYTES, size - have + 1))
                ):
                    have += len(block)
                    if size is not None and have > size:  # a body that never ends
                        raise ChecksumError(
                            f"{url}: the server sent more than the manifest's {size} bytes; stopped"
                        )
                    stream.write(block)
                    received += len(block)
            # the deadline cutting the connection looks like the end of the body
            deadline.check(f" (at byte {_partial_size(partial):,})")
            if size is None or _partial_size(partial) >= size:
                return received
            raise ConnectionError(f"the body ended at byte {_partial_size(partial)} of {size}")
        except (ConnectionError, TimeoutError, http.client.HTTPException) as error:
            deadline.check(f" (at byte {_partial_size(partial):,}; {type(error).__name__})")
            attempt += 1
            if attempt >= policy.max_attempts:
                raise ObjectStorageError(
                    f"{url}: body failed after {attempt} attempts: {type(error).__name__}: {error}"
                ) from error
            remaining = deadline.remaining()
            delay = policy.delay(attempt - 1)
            time.sleep(delay if remaining is None else max(0.0, min(delay, remaining)))


def _fetch_s3(url: str, partial: str, size: int | None, policy: TransferPolicy) -> int:
    """Ranged GETs of `policy.part_bytes` appended to `partial`, all within the object's total
    deadline (`Deadline.for_object`, the HEAD's size when no manifest declares one): checked
    before every request and retry, and the socket of a GET in flight is shut down when it
    passes (a body trickling within botocore's per-read timeout). DeadlinePassed then."""
    deadline = Deadline.for_object(policy, url, size)
    try:
        return _fetch_s3_within(url, partial, size, policy, deadline)
    finally:
        deadline.close()


def _fetch_s3_within(
    url: str, partial: str, size: int | None, policy: TransferPolicy, deadline: Deadline
) -> int:
    client = s3_client()
    info = client.stat(url, deadline=deadline)
    if size is not None and info.size != size:
        raise ChecksumError(f"{url}: the object has {info.size} bytes but the manifest says {size}")
    if size is None:
        deadline.allow_size(info.size)
    have = _partial_size(partial)
    if have > info.size:
        _restart_partial(partial)
        have = 0
    received = 0
    with _open_partial(partial) as stream:
        while have < info.size:
            stop = min(info.size, have + policy.part_bytes)
            data = client.get_range(url, have, stop, if_match=info.etag, deadline=deadline)
            stream.write(data)
            stream.flush()
            have += len(data)
            received += len(data)
    return received


def _fetch_local(path: str, partial: str) -> int:
    have = _partial_size(partial)
    received = 0
    with open(path, "rb") as source, _open_partial(partial) as stream:
        if have > os.fstat(source.fileno()).st_size:
            stream.truncate(0)
            have = 0
        source.seek(have)
        for block in iter(lambda: source.read(READ_BYTES), b""):
            stream.write(block)
            received += len(block)
    return received


def _within(location: str, prefix: str) -> bool:
    """Whether `location` lies under `prefix` (a URL prefix or a local directory), after
    normalising both: same scheme and host, and a path below the prefix's path."""
    if is_s3_location(prefix) or is_http_location(prefix):
        return url_within(location, prefix)
    if "://" in location or location.startswith("file:"):
        return False
    real, root = os.path.realpath(location), os.path.realpath(prefix)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def check_source(
    location: str, base: str, allow: Sequence[str], trust_urls: bool, where: str
) -> str:
    """`location` if a manifest at `base` may name it, else ValueError naming `where`.

    An object must lie under the manifest's own location (`base`) or under a prefix of the
    explicit allow-list; never a ``file:`` URL, another scheme, or (for a remote manifest) a
    local path. `trust_urls`: the list is the user's own (``--url``, a local shard list, a
    `Manifest` built by the caller): its http(s) and s3 URLs may point anywhere.
    """
    parsed = urllib.parse.urlsplit(location)
    scheme = parsed.scheme.lower()
    remote = is_s3_location(location) or is_http_location(location)
    if scheme and not remote and not (len(scheme) == 1 and os.name == "nt"):
        raise ValueError(f"{where}: refusing {location!r}: only http(s):// and s3:// are fetched")
    if remote and trust_urls:
        return location
    if any(_within(location, prefix) for prefix in allow):
        return location
    if base and _within(location, base):  # a remote base never contains a local path
        return location
    raise ValueError(
        f"{where}: refusing {location!r}: a manifest may name only objects under its own "
        f"location {base or '(none)'!r} (pass allow=[...] / --allow PREFIX to permit others)"
    )


def _safe_destination(local_dir: str, final: str, where: str) -> None:
    """ValueError unless every component between `local_dir` and `final` is a real directory
    or absent (a symlink planted in the destination is never followed), and `final` itself is
    not a symlink."""
    relative = os.path.relpath(final, local_dir)
    if relative.startswith(os.pardir):
        raise ValueError(f"{where}: {final} is outside the destination {local_dir}")
    current = local_dir
    for part in relative.split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise ValueError(
                f"{where}: refusing to write through the symlink {current} in the destination "
                f"{local_dir} (tokenmill did not create it)"
            )
    partial = _partial_path(final)
    if os.path.islink(partial):
        raise ValueError(f"{where}: refusing to write through the symlink {partial}")


def _check_keys_apart(manifest: Manifest, local_dir: str, path: Callable[[str], str]) -> None:
    """ValueError if an object would land on the download's own state file or on another
    object's partial file (it would be given that file's bytes), or on another key twice."""
    state = os.path.join(local_dir, STATE_NAME)
    finals: dict[str, str] = {}
    for item in manifest.objects:
        final = path(item.key)
        if final == state:
            raise ValueError(
                f"{item.key}: refusing the key: it names the download's own state file {STATE_NAME}"
            )
        if final in finals:
            raise ValueError(f"{item.key}: the manifest lists this object twice")
        finals[final] = item.key
    for final, key in finals.items():
        other = finals.get(_partial_path(final))
        if other is not None:
            raise ValueError(
                f"{other}: refusing the key: it names the partial file of the object {key}"
            )


class DownloadJob:
    """A download running on background threads (see `start_download`)."""

    def __init__(
        self,
        manifest: Manifest,
        base: str,
        local_dir: str,
        policy: TransferPolicy,
        progress: Callable[[str, str], None] | None = None,
        allow: Sequence[str] = (),
        trust_urls: bool = False,
    ) -> None:
        self.allow = tuple(allow)
        self.trust_urls = trust_urls
        # every source is checked before anything is written
        for item in manifest.objects:
            check_source(self._source_of(item, base), base, self.allow, trust_urls, item.key)
        self.manifest = manifest
        self.progress = progress
        self.base = base
        self.local_dir = local_dir
        _check_keys_apart(manifest, local_dir, self.path)
        self.policy = policy
        self.report = DownloadReport(local_dir)
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        os.makedirs(local_dir, exist_ok=True)
        self._state = _State(local_dir)
        self._executor = ThreadPoolExecutor(max_workers=policy.workers)
        self._futures: dict[str, Future[str]] = {
            item.key: self._executor.submit(self._one, item) for item in manifest.objects
        }
        self._executor.shutdown(wait=False)

    def path(self, key: str) -> str:
        """Where object `key` lands (whether or not it is there yet)."""
        return os.path.join(self.local_dir, *check_key(key, "key").split("/"))

    def wait(self, key: str, timeout: float | None = None) -> str:
        """Block until object `key` is in place and verified; returns its path.

        Raises:
            KeyError: the manifest has no such object.
            TimeoutError: not ready within `timeout` seconds.
            ChecksumError, ObjectStorageError, FileNotFoundError: its download failed.
        """
        future = self._futures.get(key)
        if future is None:
            raise KeyError(f"the manifest has no object {key!r}")
        try:
            return future.result(timeout)
        except FutureTimeout:
            if future.done():
                raise
            raise TimeoutError(f"{key} is not downloaded after {timeout} s") from None

    def done(self) -> bool:
        return all(future.done() for future in self._futures.values())

    def result(self, timeout: float | None = None) -> DownloadReport:
        """Wait for every object; the report, or the first failure in manifest order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        errors: list[BaseException] = []
        for future in self._futures.values():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            error = future.exception(remaining)
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]
        with self._lock:
            self.report.seconds = time.perf_counter() - self._started
            for names in (self.report.fetched, self.report.skipped, self.report.unverified):
                names.sort()
        return self.report

    @staticmethod
    def _source_of(item: ManifestObject, base: str) -> str:
        return item.url if item.url is not None else join_location(base, item.key)

    def _source(self, item: ManifestObject) -> str:
        return check_source(
            self._source_of(item, self.base), self.base, self.allow, self.trust_urls, item.key
        )

    def _confinement(self, source: str) -> str | None:
        """The prefix a redirect of `source` may not leave: the allow-list entry or manifest
        location it was accepted under (None for the caller's own trusted URLs)."""
        if self.trust_urls:
            return None
        for prefix in (*self.allow, self.base):
            remote = prefix and (is_http_location(prefix) or is_s3_location(prefix))
            if remote and _within(source, prefix):
                return prefix
        return self.base or source

    def _one(self, item: ManifestObject) -> str:
        final = self.path(item.key)
        _safe_destination(self.local_dir, final, item.key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        _safe_destination(self.local_dir, final, item.key)  # nothing planted meanwhile
        if self._already_there(item, final):
            with self._lock:
                self.report.skipped.append(item.key)
            if self.progress is not None:
                self.progress(item.key, "present")
            return final
        partial = _partial_path(final)
        source = self._source(item)
        for attempt in range(2):
            resumed = _partial_size(partial) > 0
            if is_s3_location(source):
                received = _fetch_s3(source, partial, item.size, self.policy)
            elif is_http_location(source):
                received = _fetch_http(
                    source, partial, item.size, self.policy, self._confinement(source)
                )
            else:
                received = _fetch_local(source, partial)
            with self._lock:
                self.report.bytes_fetched += received
            problem = self._verify(item, partial)
            if problem is None:
                break
            os.unlink(partial)
            if not resumed or attempt == 1:
                raise ChecksumError(
                    f"{source}: {problem} (downloading to {final}; the bad bytes were removed)"
                )
            # a partial file from an earlier run may belong to another version: start over once
        if item.mtime_ns is not None:
            os.utime(partial, ns=(item.mtime_ns, item.mtime_ns))
        durable_replace(partial, final)
        self._state.record(item.key, final, item.sha256)
        with self._lock:
            self.report.fetched.append(item.key)
            if item.sha256 is None:
                self.report.unverified.append(item.key)
        if self.progress is not None:
            self.progress(item.key, "fetched")
        return final

    def _already_there(self, item: ManifestObject, final: str) -> bool:
        if not os.path.isfile(final):
            return False
        if item.sha256 is None:  # a plain shard list without checksums: presence is all we know
            return item.size is None or os.path.getsize(final) == item.size
        if self._state.verified(item.key, final, item.sha256):
            return True
        if os.path.getsize(final) == item.size and sha256_file(final) == item.sha256:
            if item.mtime_ns is not None:
                os.utime(final, ns=(item.mtime_ns, item.mtime_ns))
            self._state.record(item.key, final, item.sha256)
            return True
        return False

    @staticmethod
    def _verify(item: ManifestObject, partial: str) -> str | None:
        size = os.path.getsize(partial)
        if item.size is not None and size != item.size:
            return f"got {size} bytes, the manifest says {item.size}"
        if item.sha256 is not None:
            digest = sha256_file(partial)
            if digest != item.sha256:
                return f"sha256 mismatch: got {digest}, the manifest says {item.sha256}"
        return None


def start_download(
    source: str | Manifest,
    local_dir: str,
    *,
    base: str | None = None,
    policy: TransferPolicy | None = None,
    keys: Iterable[str] | None = None,
    progress: Callable[[str, str], None] | None = None,
    allow: Sequence[str] = (),
) -> DownloadJob:
    """Start downloading in the background; returns at once.

    Args:
        source: a manifest location (`.json`: local, `s3://`, `http(s)://`), a shard-list file,
            or a Manifest (then `base` says where its keys live).
        local_dir: where objects land, under their keys.
        policy: workers, retries, part size.
        keys: only these objects (default: all).
        progress: called from the worker threads with (key, "fetched" | "present").
        allow: URL prefixes or local directories objects may come from besides the manifest's
            own location. A loaded manifest (and a remote shard list) may otherwise name only
            objects under its own location: no other host, no local path, no ``file:``. A
            `Manifest` passed in, and a local shard list, are the caller's own: their http(s)
            and s3 URLs may point anywhere.

    Raises:
        FileNotFoundError / ValueError: the manifest is missing or invalid, or names an object
            outside its location and the allow-list; KeyError: an unknown key.
    """
    policy = policy or TransferPolicy()
    if isinstance(source, Manifest):
        if base is None and any(item.url is None for item in source.objects):
            raise ValueError("a Manifest without URLs needs base= (where its keys live)")
        manifest, where = source, base or ""
        trust_urls = True
    else:
        manifest, where = load_manifest(source, policy)
        is_local = not (is_s3_location(source) or is_http_location(source))
        trust_urls = is_local and not source.endswith(".json")  # the user's own shard list
    if keys is not None:
        manifest = Manifest(tuple(manifest.find(key) for key in keys), manifest.config)
    return DownloadJob(manifest, where, os.fspath(local_dir), policy, progress, allow, trust_urls)


def download(
    source: str | Manifest,
    local_dir: str,
    *,
    base: str | None = None,
    policy: TransferPolicy | None = None,
    keys: Iterable[str] | None = None,
    progress: Callable[[str, str], None] | None = None,
    allow: Sequence[str] = (),
) -> DownloadReport:
    """Download every object (see `start_download`) and wait for all of them.

    Raises:
        ChecksumError: an object's bytes do not match the manifest.
        ObjectStorageError: a transfer failed after its retries.
        FileNotFoundError: the manifest or an object is missing.
    """
    job = start_download(
        source, local_dir, base=base, policy=policy, keys=keys, progress=progress, allow=allow
    )
    return job.result()
