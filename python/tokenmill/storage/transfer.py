"""Publish shards and caches to a bucket, and download them on every node, verified and resumable.

**publish** (`publish(paths, destination)`): every file of the given dataset prefixes
(`.bin`, `.idx`, `.tokenmill.json`), directories (an index cache) or single files is uploaded under
`destination` (an `s3://bucket/prefix` or a local directory), then `manifest.json` listing every
object's key, size and sha256 and the config they serve is written last (the commit point: a
reader never sees a manifest whose objects are not all there). Objects already present with the
same size and sha256 (stored as the object's `sha256` metadata) are skipped, so an interrupted
publish resumes where it stopped; files above `part_bytes` go multipart with a Content-MD5 per
part, and a multipart upload interrupted half-way resumes too: parts the server already holds
with the same size and MD5 ETag are kept, the rest are sent.

**download** (`download(source, local_dir)` or `start_download(...)` in the background): `source`
is a manifest (local path, `s3://` or `http(s)://` URL), a `Manifest`, or a plain shard list
(`URL [sha256]` lines, nanochat-style). Objects are fetched by `workers` threads in manifest order
into `<local_dir>/.<name>.partial` and renamed to their key once their size and sha256 match the
manifest, so a file under its final name is always complete and verified; the published
modification time is restored, so the data fingerprints beside index cache entries still match. HTTP fetches retry
connection errors, timeouts and 5xx/429 answers with exponential backoff (full jitter, as
`tokenmill.storage.s3` does for S3, whose client retries on its own); after a kill, the next run
skips finished objects (remembered in `<local_dir>/.tokenmill-download.json` by size and mtime,
so they are not even re-hashed) and continues partial files from the byte they reached with
ranged requests. A checksum mismatch raises `tokenmill.errors.ChecksumError` naming the object,
the file and both digests, and removes the bad bytes.

`DownloadJob.wait(key)` returns as soon as one object is in place, so a dataset can open its
first shards while the rest still download.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import http.client
import json
import os
import random
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.errors import ChecksumError, ObjectStorageError
from tokenmill.storage.manifest import (
    Manifest,
    ManifestObject,
    base_location,
    check_key,
    parse_shard_list,
)

__all__ = [
    "MANIFEST_NAME",
    "DownloadJob",
    "DownloadReport",
    "PublishReport",
    "TransferPolicy",
    "collect_files",
    "download",
    "join_location",
    "load_manifest",
    "publish",
    "read_location",
    "sha256_file",
    "start_download",
]

MANIFEST_NAME = "manifest.json"
STATE_NAME = ".tokenmill-download.json"
_DATASET_SUFFIXES = (".bin", ".idx", ".tokenmill.json")
_READ_BYTES = 1 << 20
_S3_MIN_PART_BYTES = 5 << 20


@dataclass(frozen=True)
class TransferPolicy:
    """How transfers run.

    Args:
        workers: objects transferred at once.
        max_attempts: attempts per HTTP request, including the first.
        backoff_base: seconds; attempt n (from 0) sleeps uniform(0, min(backoff_max,
            backoff_base * 2**n)) before the next.
        backoff_max: cap of one sleep, in seconds.
        part_bytes: multipart part size for uploads, and the ranged-read size for S3 downloads.
        timeout: seconds without progress before an HTTP request fails (and is retried).

    Raises:
        ValueError: a value out of range (names the field).
    """

    workers: int = 4
    max_attempts: int = 6
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    part_bytes: int = 8 << 20
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"TransferPolicy.workers must be >= 1, got {self.workers}")
        if self.max_attempts < 1:
            raise ValueError(f"TransferPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_base < 0 or self.backoff_max < 0:
            raise ValueError(
                f"TransferPolicy backoff must be >= 0, got {self.backoff_base}/{self.backoff_max}"
            )
        if self.part_bytes < 1:
            raise ValueError(f"TransferPolicy.part_bytes must be >= 1, got {self.part_bytes}")
        if self.timeout <= 0:
            raise ValueError(f"TransferPolicy.timeout must be > 0, got {self.timeout}")

    def delay(self, attempt: int) -> float:
        return random.uniform(
            0.0, min(self.backoff_max, self.backoff_base * 2.0 ** min(attempt, 30))
        )


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_s3(location: str) -> bool:
    return location.startswith("s3://")


def _is_http(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def join_location(base: str, key: str) -> str:
    """`base/key` for an s3:// or http(s):// prefix, or a path below a local directory."""
    if _is_s3(base) or _is_http(base):
        return base.rstrip("/") + "/" + key
    return os.path.join(base, *key.split("/"))


def _s3_client() -> Any:
    from tokenmill.storage.s3 import get_client

    return get_client()


# -- reading whole small objects (manifests) ---------------------------------------------------


class _RangeNotSatisfiable(Exception):
    """HTTP 416: the server's object is no longer than the bytes we already have."""


def _http_open(url: str, policy: TransferPolicy, headers: Mapping[str, str] | None = None) -> Any:
    """urlopen with retries on transient failures; 404 is FileNotFoundError."""
    attempt = 0
    while True:
        try:
            request = urllib.request.Request(url, headers=dict(headers or {}))
            return urllib.request.urlopen(request, timeout=policy.timeout)
        except urllib.error.HTTPError as error:
            error.close()  # it holds the response's socket
            if error.code == 404:
                raise FileNotFoundError(errno.ENOENT, f"not found: {url} (HTTP 404)") from None
            if error.code == 416:
                raise _RangeNotSatisfiable(url) from None
            if error.code < 500 and error.code != 429:
                raise ObjectStorageError(f"{url}: HTTP {error.code} {error.reason}") from None
            last: BaseException = error
        except (
            urllib.error.URLError,
            ConnectionError,
            TimeoutError,
            http.client.HTTPException,
        ) as error:
            last = error
        attempt += 1
        if attempt >= policy.max_attempts:
            raise ObjectStorageError(
                f"{url}: failed after {attempt} attempts: {type(last).__name__}: {last}"
            ) from last
        time.sleep(policy.delay(attempt - 1))


def read_location(location: str, policy: TransferPolicy | None = None) -> bytes:
    """The bytes of a local file, an `s3://` object or an `http(s)://` URL.

    Raises:
        FileNotFoundError: it does not exist.
        ObjectStorageError: the retries were spent.
    """
    policy = policy or TransferPolicy()
    if _is_s3(location):
        client = _s3_client()
        size = client.stat(location).size
        return bytes(client.get_range(location, 0, size)) if size else b""
    if _is_http(location):
        with _http_open(location, policy) as response:
            data: bytes = response.read()
            return data
    with open(location, "rb") as stream:
        return stream.read()


def load_manifest(source: str, policy: TransferPolicy | None = None) -> tuple[Manifest, str]:
    """A manifest and the base its keys are relative to.

    `source` is a manifest (`.json`: local, `s3://` or `http(s)://`) or a plain shard list (any
    other local file: `URL [sha256]` per line).

    Raises:
        FileNotFoundError: the manifest does not exist.
        ValueError: it is not a valid manifest or shard list.
    """
    text = read_location(source, policy)
    if source.endswith(".json"):
        return Manifest.from_json(text, source), base_location(source)
    lines = text.decode("utf-8", errors="replace").splitlines()
    return parse_shard_list(lines, source), base_location(source)


# -- publish -----------------------------------------------------------------------------------


def collect_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(key, local path) of every file to publish, in a stable order.

    A dataset prefix contributes `<name>.bin`, `<name>.idx` and `<name>.tokenmill.json` (those
    that exist); a directory contributes every file below it (hidden files such as lock files
    and temporaries excluded) under `<directory name>/`; a file contributes itself.

    Raises:
        FileNotFoundError: a path is none of these.
        ValueError: two inputs map to the same key.
    """
    found: dict[str, str] = {}

    def add(key: str, path: str) -> None:
        check_key(key, path)
        if key in found and os.path.abspath(found[key]) != os.path.abspath(path):
            raise ValueError(f"both {found[key]} and {path} would be published as {key!r}")
        found[key] = path

    for raw in paths:
        path = os.fspath(raw).rstrip("/") or "/"
        if os.path.isdir(path):
            root = Path(path)
            for file in sorted(root.rglob("*")):
                relative = file.relative_to(root)
                if file.is_file() and not any(part.startswith(".") for part in relative.parts):
                    add(f"{root.resolve().name}/{relative.as_posix()}", os.fspath(file))
        elif os.path.isfile(path + ".bin") or os.path.isfile(path + ".idx"):
            for suffix in _DATASET_SUFFIXES:
                if os.path.isfile(path + suffix):
                    add(os.path.basename(path) + suffix, path + suffix)
        elif os.path.isfile(path):
            add(os.path.basename(path), path)
        else:
            raise FileNotFoundError(
                errno.ENOENT,
                f"nothing to publish at {path}: not a file, a directory or a dataset prefix "
                "(<prefix>.bin / <prefix>.idx)",
            )
    return sorted(found.items())


@dataclass
class PublishReport:
    """What `publish` did: the manifest and where it went, objects uploaded and skipped."""

    manifest: Manifest
    manifest_location: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    seconds: float = 0.0


def _md5_base64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode("ascii")


def _s3_head(client: Any, url: str) -> dict[str, Any] | None:
    from tokenmill.storage.s3 import S3Url

    parsed = S3Url.parse(url)
    try:
        response: dict[str, Any] = client.call(
            "HEAD", parsed, lambda c: c.head_object(Bucket=parsed.bucket, Key=parsed.key)
        )
    except FileNotFoundError:
        return None
    return response


def _s3_upload(
    client: Any, path: str, url: str, size: int, digest: str, policy: TransferPolicy
) -> int:
    """Upload one file (multipart above policy.part_bytes, resuming an interrupted one).

    Returns:
        Bytes sent.
    """
    from tokenmill.storage.s3 import S3Url

    parsed = S3Url.parse(url)
    bucket, key = parsed.bucket, parsed.key
    metadata = {"sha256": digest}
    if size <= policy.part_bytes:
        with open(path, "rb") as stream:
            data = stream.read()
        client.call(
            f"PUT from {path}",
            parsed,
            lambda c: c.put_object(
                Bucket=bucket, Key=key, Body=data, Metadata=metadata, ContentMD5=_md5_base64(data)
            ),
        )
        return size

    # Resume the newest unfinished multipart upload of this key, keeping parts whose size and
    # MD5 ETag equal ours (anything else is re-sent, so a stale upload cannot leak in).
    listing = client.call(
        "LIST multipart uploads",
        parsed,
        lambda c: c.list_multipart_uploads(Bucket=bucket, Prefix=key),
    )
    uploads = [u for u in listing.get("Uploads", []) if u.get("Key") == key]
    held: dict[int, tuple[int, str]] = {}
    if uploads:
        upload_id = max(uploads, key=lambda u: u.get("Initiated", 0))["UploadId"]
        parts = client.call(
            "LIST parts",
            parsed,
            lambda c: c.list_parts(Bucket=bucket, Key=key, UploadId=upload_id),
        )
        held = {
            int(p["PartNumber"]): (int(p["Size"]), str(p["ETag"]).strip('"'))
            for p in parts.get("Parts", [])
        }
    else:
        created = client.call(
            "CREATE multipart upload",
            parsed,
            lambda c: c.create_multipart_upload(Bucket=bucket, Key=key, Metadata=metadata),
        )
        upload_id = created["UploadId"]
    sent = 0
    completed = []
    with open(path, "rb") as stream:
        number = 0
        while True:
            data = stream.read(policy.part_bytes)
            if not data:
                break
            number += 1
            etag = hashlib.md5(data, usedforsecurity=False).hexdigest()
            if held.get(number) != (len(data), etag):
                part_number, body = number, data
                client.call(
                    f"PUT part {number} from {path}",
                    parsed,
                    lambda c, n=part_number, b=body: c.upload_part(
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=n,
                        Body=b,
                        ContentMD5=_md5_base64(b),
                    ),
                )
                sent += len(data)
            completed.append({"PartNumber": number, "ETag": f'"{etag}"'})
    client.call(
        "COMPLETE multipart upload",
        parsed,
        lambda c: c.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": completed}
        ),
    )
    return sent


def _local_copy(path: str, target: str) -> None:
    from tokenmill.common.atomic import AtomicFile

    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    output = AtomicFile(target)
    try:
        with open(path, "rb") as stream:
            shutil.copyfileobj(stream, output.stream, _READ_BYTES)
        output.commit()
    finally:
        output.abort()


def publish(
    paths: Sequence[str],
    destination: str,
    *,
    config: Mapping[str, Any] | None = None,
    policy: TransferPolicy | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> PublishReport:
    """Upload datasets, caches and files under `destination`, then its `manifest.json`.

    Args:
        paths: dataset prefixes, directories (e.g. an index cache) or files.
        destination: `s3://bucket/prefix` or a local directory.
        config: the config the objects serve (recorded in the manifest).
        policy: workers, part size, retries.
        progress: called with (key, "uploaded" | "skipped") after each object.

    Returns:
        The report (manifest, uploaded and skipped keys, bytes sent).

    Raises:
        FileNotFoundError: an input is missing.
        ValueError: two inputs share a key, or the destination is an http(s) URL.
        ObjectStorageError: the storage failed for good.
    """
    policy = policy or TransferPolicy()
    if _is_http(destination):
        raise ValueError(f"cannot publish to {destination}: use an s3:// URL or a local directory")
    if _is_s3(destination) and policy.part_bytes < _S3_MIN_PART_BYTES:
        raise ValueError(
            f"part size {policy.part_bytes} bytes is below S3's multipart minimum of 5 MiB"
        )
    started = time.perf_counter()
    files = collect_files(paths)
    objects: dict[str, ManifestObject] = {}
    report = PublishReport(Manifest(()), join_location(destination, MANIFEST_NAME))
    lock = threading.Lock()
    client = _s3_client() if _is_s3(destination) else None

    def send(item: tuple[str, str]) -> None:
        key, path = item
        # hashed here, on the worker threads: hashing dominates a publish that skips objects
        status = os.stat(path)
        size, digest = status.st_size, sha256_file(path)
        with lock:
            objects[key] = ManifestObject(key, size, digest, None, status.st_mtime_ns)
        target = join_location(destination, key)
        sent = 0
        if client is not None:
            head = _s3_head(client, target)
            present = (
                head is not None
                and int(head.get("ContentLength", -1)) == size
                and head.get("Metadata", {}).get("sha256") == digest
            )
            if not present:
                sent = _s3_upload(client, path, target, size, digest, policy)
                head = _s3_head(client, target)
                if head is None or int(head.get("ContentLength", -1)) != size:
                    raise ObjectStorageError(f"{target}: upload of {path} did not arrive whole")
        else:
            present = (
                os.path.isfile(target)
                and os.path.getsize(target) == size
                and sha256_file(target) == digest
            )
            if not present:
                _local_copy(path, target)
                sent = size
        with lock:
            (report.skipped if present else report.uploaded).append(key)
            report.bytes_uploaded += sent
        if progress is not None:
            progress(key, "skipped" if present else "uploaded")

    with ThreadPoolExecutor(max_workers=policy.workers) as executor:
        for future in [executor.submit(send, item) for item in files]:
            future.result()
    manifest = Manifest(
        tuple(objects[key] for key, _ in files), dict(config) if config is not None else None
    )
    report.manifest = manifest
    text = manifest.to_json().encode("utf-8")
    if client is not None:
        from tokenmill.storage.s3 import S3Url

        parsed = S3Url.parse(report.manifest_location)
        client.call(
            "PUT manifest",
            parsed,
            lambda c: c.put_object(
                Bucket=parsed.bucket, Key=parsed.key, Body=text, ContentMD5=_md5_base64(text)
            ),
        )
    else:
        from tokenmill.common.atomic import atomic_write_text

        os.makedirs(destination, exist_ok=True)
        atomic_write_text(Path(report.manifest_location), text.decode("utf-8"))
    report.uploaded.sort()
    report.skipped.sort()
    report.seconds = time.perf_counter() - started
    return report


# -- download ----------------------------------------------------------------------------------


@dataclass
class DownloadReport:
    """What a download did."""

    local_dir: str
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    seconds: float = 0.0


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
        from tokenmill.common.atomic import atomic_write_text

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


def _fetch_http(url: str, partial: str, size: int | None, policy: TransferPolicy) -> int:
    """Append the missing bytes of `url` to `partial`; returns bytes received."""
    received = 0
    attempt = 0
    while True:
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        if size is not None and have > size:
            os.truncate(partial, 0)
            have = 0
        if size is not None and have == size:
            return received
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            response = _http_open(url, policy, headers)
        except _RangeNotSatisfiable:  # the object is shorter than our partial: start over
            if not have:
                raise ObjectStorageError(f"{url}: HTTP 416 for a request without range") from None
            os.truncate(partial, 0)
            continue
        total = _announced_size(response, have)
        if size is not None and total is not None and total != size:
            response.close()
            raise ChecksumError(f"{url}: the object has {total} bytes but the manifest says {size}")
        try:
            with response, open(partial, "ab") as stream:
                if have and response.status != 206:  # the server ignored the range
                    stream.truncate(0)
                # read1: whatever has arrived (up to 1 MiB), so a kill loses little
                while block := response.read1(_READ_BYTES):
                    stream.write(block)
                    received += len(block)
            if size is None or os.path.getsize(partial) >= size:
                return received
            raise ConnectionError(f"the body ended at byte {os.path.getsize(partial)} of {size}")
        except (ConnectionError, TimeoutError, http.client.HTTPException) as error:
            attempt += 1
            if attempt >= policy.max_attempts:
                raise ObjectStorageError(
                    f"{url}: body failed after {attempt} attempts: {type(error).__name__}: {error}"
                ) from error
            time.sleep(policy.delay(attempt - 1))


def _fetch_s3(url: str, partial: str, size: int | None, policy: TransferPolicy) -> int:
    client = _s3_client()
    info = client.stat(url)
    if size is not None and info.size != size:
        raise ChecksumError(f"{url}: the object has {info.size} bytes but the manifest says {size}")
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    if have > info.size:
        os.truncate(partial, 0)
        have = 0
    received = 0
    with open(partial, "ab") as stream:
        while have < info.size:
            stop = min(info.size, have + policy.part_bytes)
            data = client.get_range(url, have, stop, if_match=info.etag)
            stream.write(data)
            stream.flush()
            have += len(data)
            received += len(data)
    return received


def _fetch_local(path: str, partial: str) -> int:
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    received = 0
    with open(path, "rb") as source, open(partial, "ab") as stream:
        if have > os.fstat(source.fileno()).st_size:
            stream.truncate(0)
            have = 0
        source.seek(have)
        for block in iter(lambda: source.read(_READ_BYTES), b""):
            stream.write(block)
            received += len(block)
    return received


class DownloadJob:
    """A download running on background threads (see `start_download`)."""

    def __init__(
        self,
        manifest: Manifest,
        base: str,
        local_dir: str,
        policy: TransferPolicy,
        progress: Callable[[str, str], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.progress = progress
        self.base = base
        self.local_dir = local_dir
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

    def _source(self, item: ManifestObject) -> str:
        return item.url if item.url is not None else join_location(self.base, item.key)

    def _one(self, item: ManifestObject) -> str:
        final = self.path(item.key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if self._already_there(item, final):
            with self._lock:
                self.report.skipped.append(item.key)
            if self.progress is not None:
                self.progress(item.key, "present")
            return final
        partial = _partial_path(final)
        source = self._source(item)
        for attempt in range(2):
            resumed = os.path.exists(partial) and os.path.getsize(partial) > 0
            if _is_s3(source):
                received = _fetch_s3(source, partial, item.size, self.policy)
            elif _is_http(source):
                received = _fetch_http(source, partial, item.size, self.policy)
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
        os.replace(partial, final)
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
) -> DownloadJob:
    """Start downloading in the background; returns at once.

    Args:
        source: a manifest location (`.json`: local, `s3://`, `http(s)://`), a shard-list file,
            or a Manifest (then `base` says where its keys live).
        local_dir: where objects land, under their keys.
        policy: workers, retries, part size.
        keys: only these objects (default: all).
        progress: called from the worker threads with (key, "fetched" | "present").

    Raises:
        FileNotFoundError / ValueError: the manifest is missing or invalid; KeyError: an
            unknown key.
    """
    policy = policy or TransferPolicy()
    if isinstance(source, Manifest):
        if base is None and any(item.url is None for item in source.objects):
            raise ValueError("a Manifest without URLs needs base= (where its keys live)")
        manifest, where = source, base or ""
    else:
        manifest, where = load_manifest(source, policy)
    if keys is not None:
        manifest = Manifest(tuple(manifest.find(key) for key in keys), manifest.config)
    return DownloadJob(manifest, where, os.fspath(local_dir), policy, progress)


def download(
    source: str | Manifest,
    local_dir: str,
    *,
    base: str | None = None,
    policy: TransferPolicy | None = None,
    keys: Iterable[str] | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> DownloadReport:
    """Download every object (see `start_download`) and wait for all of them.

    Raises:
        ChecksumError: an object's bytes do not match the manifest.
        ObjectStorageError: a transfer failed after its retries.
        FileNotFoundError: the manifest or an object is missing.
    """
    job = start_download(source, local_dir, base=base, policy=policy, keys=keys, progress=progress)
    return job.result()
