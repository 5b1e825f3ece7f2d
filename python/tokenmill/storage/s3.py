"""S3-compatible object storage through boto3: URLs, a retrying client, ranged reads, uploads.

This is the only module that talks to boto3. Everything above it (the ``.bin`` chunk cache, the
local ``.idx`` cache, datasets, ``tokenize`` output) goes through :class:`S3Client`, so retries and
error messages are the same everywhere.

Credentials, region and endpoint come from the standard AWS environment and config files, read by
boto3 itself: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, ``AWS_DEFAULT_REGION``, ``~/.aws/config``, and ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for R2, MinIO, Ceph and other S3-compatible services.

Retries (:class:`RetryPolicy`): botocore's own retries are switched off so that one policy
governs every call. A call is retried on throttling (HTTP 429/503, ``SlowDown``, ``Throttling``),
any other 5xx, timeouts, dropped connections and short bodies, sleeping ``uniform(0, min(cap,
base * 2**attempt))`` between attempts (exponential backoff with full jitter, so that many ranks
hitting the same throttled prefix spread out). After ``max_attempts`` attempts the call raises
:class:`~tokenmill.errors.ObjectStorageError` naming the object, the byte range, the number of
attempts, the time spent and the last error. A missing object raises FileNotFoundError, a
refused one PermissionError, and an object that changed since it was opened (a ranged read with
``If-Match`` whose ETag no longer matches) :class:`~tokenmill.errors.ObjectChangedError`; none of
these is retried.

The policy comes from the environment so DataLoader workers inherit it:
``TOKENMILL_S3_MAX_ATTEMPTS`` (10), ``TOKENMILL_S3_BACKOFF_BASE`` (0.25 s),
``TOKENMILL_S3_BACKOFF_MAX`` (20 s), ``TOKENMILL_S3_CONNECT_TIMEOUT`` (10 s) and
``TOKENMILL_S3_READ_TIMEOUT`` (60 s).

Example (needs boto3 and a reachable bucket)::

    from tokenmill.storage.s3 import get_client
    client = get_client()
    if client.exists("s3://bucket/data/shard.idx"):
        head = client.get_range("s3://bucket/data/shard.idx", 0, 34)
    client.upload("local.bin", "s3://bucket/data/shard.bin")

Cost: one HTTP request per call (``download`` streams in 8 MiB reads and resumes an interrupted
body from the byte it reached; ``upload`` goes multipart above 64 MiB). A boto3 client is built
once per process and thread-safe; after a fork the child builds its own.

Size: about 700 lines, kept in one module on purpose: it is the only place that touches boto3
(URLs, the retry policy, the error classification and every request), so every caller gets the
same retries and messages.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tokenmill.errors import ObjectChangedError, ObjectStorageError

__all__ = [
    "ObjectInfo",
    "RetryPolicy",
    "S3Client",
    "S3Url",
    "TransferStats",
    "client_for",
    "get_client",
    "is_s3_url",
    "reset_clients",
    "set_client",
    "using_client",
]

SCHEME = "s3://"
_T = TypeVar("_T")


class Deadline(Protocol):
    """A total deadline over an object's requests (`tokenmill.storage.transfer.Deadline`, which
    imports this module: a protocol keeps the import one-way)."""

    def check(self, detail: str = "") -> None:
        """Raise DeadlinePassed (an ObjectStorageError) if it has passed."""

    def remaining(self) -> float | None:
        """Seconds left (None: no deadline)."""

    def watching(self, sock: socket.socket | None) -> contextlib.AbstractContextManager[None]:
        """Shut `sock` down if the deadline passes within the block."""


# Error codes that mean "slow down" or "try again" whatever the HTTP status says.
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
    }
)
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED_CODES = frozenset({"403", "AccessDenied", "Forbidden", "InvalidAccessKeyId"})
_CHANGED_CODES = frozenset({"412", "PreconditionFailed"})

_DOWNLOAD_READ_BYTES = 8 << 20
_MULTIPART_BYTES = 64 << 20


def is_s3_url(path: object) -> bool:
    """Whether ``path`` is a string starting with ``s3://``."""
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclass(frozen=True)
class S3Url:
    """A parsed ``s3://bucket/key`` URL (``key`` may be empty for a bucket or prefix)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str | os.PathLike[str]) -> S3Url:
        """Split an ``s3://`` URL into bucket and key.

        Raises:
            ValueError: the URL does not start with ``s3://`` or has no bucket name.
        """
        text = os.fspath(url)
        if not text.startswith(SCHEME):
            raise ValueError(f"not an s3:// URL: {text!r}")
        bucket, _, key = text[len(SCHEME) :].partition("/")
        if not bucket:
            raise ValueError(f"s3 URL has no bucket name: {text!r}")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def require_key(self) -> S3Url:
        """This URL, checked to name an object (a non-empty key that is not a directory)."""
        if not self.key or self.key.endswith("/"):
            raise ValueError(f"s3 URL does not name an object (empty key or trailing '/'): {self}")
        return self

    def join(self, name: str) -> S3Url:
        """``self/name`` (for a prefix such as ``s3://bucket/dir``)."""
        base = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return S3Url(self.bucket, base + name)


def _env_number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"environment variable {name} must be {kind}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}, got {raw!r}")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing request is retried.

    Args:
        max_attempts: attempts per call, including the first (>= 1).
        backoff_base: seconds; attempt ``n`` (from 0) sleeps ``uniform(0, min(backoff_max,
            backoff_base * 2**n))`` before the next one.
        backoff_max: the cap on one sleep, in seconds.
        connect_timeout: seconds to establish a connection.
        read_timeout: seconds without a byte from the server before a read times out.

    Raises:
        ValueError: a value is out of range.
    """

    max_attempts: int = 10
    backoff_base: float = 0.25
    backoff_max: float = 20.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("backoff_base", "backoff_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"RetryPolicy.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("connect_timeout", "read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The policy from ``TOKENMILL_S3_*`` environment variables (defaults where unset).

        Raises:
            ValueError: a variable is not a number or out of range.
        """
        default = cls()
        return cls(
            max_attempts=int(
                _env_number(
                    "TOKENMILL_S3_MAX_ATTEMPTS", default.max_attempts, integer=True, minimum=1
                )
            ),
            backoff_base=_env_number("TOKENMILL_S3_BACKOFF_BASE", default.backoff_base),
            backoff_max=_env_number("TOKENMILL_S3_BACKOFF_MAX", default.backoff_max),
            connect_timeout=_env_number(
                "TOKENMILL_S3_CONNECT_TIMEOUT", default.connect_timeout, minimum=1e-3
            ),
            read_timeout=_env_number(
                "TOKENMILL_S3_READ_TIMEOUT", default.read_timeout, minimum=1e-3
            ),
        )

    def delay(self, attempt: int, generator: random.Random) -> float:
        """The sleep after failed attempt ``attempt`` (0-based): full jitter."""
        cap = min(self.backoff_max, self.backoff_base * (2.0 ** min(attempt, 60)))
        return generator.uniform(0.0, cap)


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD request says about an object."""

    url: str
    size: int
    etag: str


@dataclass
class TransferStats:
    """Counters of one client (thread-safe increments), for benchmarks and tests."""

    requests: int = 0
    bytes_received: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requests: int = 0, bytes_received: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_received += bytes_received
            self.retries += retries

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_received": self.bytes_received,
                "retries": self.retries,
            }


class _ShortBody(Exception):
    """The server closed a ranged response before sending every byte (retryable)."""


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError as error:
        raise ImportError(
            "s3:// paths need boto3: pip install 'tokenmill[s3]' (or pip install boto3)"
        ) from error
    return boto3


def _client_error_details(error: BaseException) -> tuple[str, int] | None:
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _socket_of(body: Any) -> socket.socket | None:
    """The socket a botocore streaming body reads from, or None where there is none to be had
    (another HTTP stack, a stubbed client). Found through the http.client response under
    urllib3's (its file's raw socket: the connection drops its own reference when the server
    says it will close), else urllib3's connection (a kept-alive one)."""
    raw = getattr(body, "_raw_stream", None)
    stream = getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None)
    for sock in (
        getattr(stream, "_sock", None),
        getattr(getattr(raw, "connection", None), "sock", None),
    ):
        if isinstance(sock, socket.socket):
            return sock
    return None


def _is_transient(error: BaseException) -> bool:
    """Throttling, 5xx, timeouts, dropped connections, short bodies."""
    if isinstance(error, _ShortBody):
        return True
    details = _client_error_details(error)
    if details is not None:
        code, status = details
        return code in _RETRYABLE_CODES or status == 429 or status >= 500
    try:
        from botocore import exceptions as botocore_errors
    except ImportError:  # pragma: no cover - boto3 always brings botocore
        return False
    if isinstance(
        error,
        (
            botocore_errors.HTTPClientError,
            botocore_errors.ConnectionError,
            botocore_errors.IncompleteReadError,
        ),
    ):
        return True
    with contextlib.suppress(ImportError):
        import urllib3.exceptions

        if isinstance(error, urllib3.exceptions.HTTPError):
            return True
    # socket-level failures while streaming a body (reset, timeout); not file-system errors
    return isinstance(error, (ConnectionError, TimeoutError))


class S3Client:
    """A retrying S3 client: HEAD, exists, ranged GET, download, upload and listing.

    Thread-safe; fork-safe (a forked child builds its own boto3 client on first use).

    Args:
        retry: the retry policy; None reads it from the environment (:meth:`RetryPolicy.from_env`).
        endpoint_url: overrides ``AWS_ENDPOINT_URL``; None lets boto3 read the environment.
        max_pool_connections: HTTP connections kept per process (prefetch threads share them).
    """

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        *,
        endpoint_url: str | None = None,
        max_pool_connections: int = 32,
    ) -> None:
        self.retry = retry if retry is not None else RetryPolicy.from_env()
        self.endpoint_url = endpoint_url
        self.max_pool_connections = max_pool_connections
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._boto: Any = None
        self._boto_pid = -1
        self._random = random.Random()
        _live_clients.add(self)

    def _after_fork_in_child(self) -> None:
        # a lock held by a parent thread at fork time would never be released in the child
        self._lock = threading.Lock()
        self.stats._lock = threading.Lock()
        self._boto = None
        self._random = random.Random()

    # -- plumbing --------------------------------------------------------------------------

    def _client(self) -> Any:
        pid = os.getpid()
        if self._boto is None or self._boto_pid != pid:
            with self._lock:
                if self._boto is None or self._boto_pid != pid:
                    boto3 = _import_boto3()
                    from botocore.config import Config

                    config = Config(
                        connect_timeout=self.retry.connect_timeout,
                        read_timeout=self.retry.read_timeout,
                        retries={"total_max_attempts": 1, "mode": "standard"},
                        max_pool_connections=self.max_pool_connections,
                    )
                    session = boto3.session.Session()
                    self._boto = session.client("s3", endpoint_url=self.endpoint_url, config=config)
                    self._boto_pid = pid
        return self._boto

    def _sleep(self, attempt: int, deadline: Deadline | None = None) -> None:
        with self._lock:
            delay = self.retry.delay(attempt, self._random)
        remaining = deadline.remaining() if deadline is not None else None
        time.sleep(delay if remaining is None else max(0.0, min(delay, remaining)))

    def call(
        self,
        what: str,
        url: S3Url,
        operation: Callable[[Any], _T],
        deadline: Deadline | None = None,
    ) -> _T:
        """Run ``operation(boto_client)`` under the retry policy, translating final errors.

        The escape hatch for S3 operations this class has no method for (multipart uploads,
        HEAD with metadata): ``what`` names the operation in errors. With `deadline` (a
        `tokenmill.storage.transfer.Deadline`), no attempt starts, and no retry sleeps, past it.

        Raises:
            FileNotFoundError: the object does not exist.
            PermissionError: access is denied.
            ObjectChangedError: a conditional request failed (the object changed).
            ObjectStorageError: a permanent error, or the retry budget is spent.
            DeadlinePassed: `deadline` passed (an ObjectStorageError).
        """
        started = time.monotonic()
        attempt = 0
        while True:
            if deadline is not None:
                deadline.check(f" ({what})")
            client = self._client()  # outside the try: a missing boto3 is an ImportError
            try:
                self.stats.add(requests=1)
                return operation(client)
            except Exception as error:
                details = _client_error_details(error)
                if details is not None:
                    code, status = details
                    if code in _MISSING_CODES or status == 404:
                        raise FileNotFoundError(
                            errno.ENOENT, f"object not found: {url} ({what})"
                        ) from None
                    if code in _DENIED_CODES or status == 403:
                        raise PermissionError(
                            errno.EACCES, f"access denied to {url} ({what}): {code}"
                        ) from None
                    if code in _CHANGED_CODES or status == 412:
                        raise ObjectChangedError(
                            f"{url} changed on the server since it was opened ({what}: the ETag "
                            "no longer matches); restart to read the new version consistently"
                        ) from None
                if not _is_transient(error):
                    raise ObjectStorageError(f"{url}: {what} failed: {error}") from error
                attempt += 1
                if deadline is not None:  # a cut at the deadline looks like a dropped body
                    last = f"{type(error).__name__}: {error}"
                    deadline.check(f" ({what}: {attempt} attempts, last: {last})")
                if attempt >= self.retry.max_attempts:
                    elapsed = time.monotonic() - started
                    raise ObjectStorageError(
                        f"{url}: {what} failed after {attempt} attempts in {elapsed:.1f} s (retry "
                        f"budget spent; TOKENMILL_S3_MAX_ATTEMPTS={self.retry.max_attempts}); "
                        f"last error: {type(error).__name__}: {error}"
                    ) from error
                self.stats.add(retries=1)
                self._sleep(attempt - 1, deadline)

    # -- reading ---------------------------------------------------------------------------

    def stat(self, url: str | S3Url, *, deadline: Deadline | None = None) -> ObjectInfo:
        """Size and ETag of an object (one HEAD request; `deadline`: see :meth:`call`).

        Raises:
            FileNotFoundError: the object (or bucket) does not exist.
            PermissionError: access is denied.
            ObjectStorageError: the retry budget was spent, or the deadline passed.
        """
        parsed = _as_url(url).require_key()
        response = self.call(
            "HEAD",
            parsed,
            lambda c: c.head_object(Bucket=parsed.bucket, Key=parsed.key),
            deadline,
        )
        return ObjectInfo(str(parsed), int(response["ContentLength"]), str(response["ETag"]))

    def exists(self, url: str | S3Url) -> bool:
        """Whether the object exists: False for a missing object or bucket (a HEAD returning 404).

        Raises:
            PermissionError: access is denied (existence cannot be told).
            ObjectStorageError: the retry budget was spent.
        """
        try:
            self.stat(url)
        except FileNotFoundError:
            return False
        return True

    def get_range(
        self,
        url: str | S3Url,
        start: int,
        stop: int,
        *,
        if_match: str | None = None,
        deadline: Deadline | None = None,
    ) -> bytes:
        """Bytes ``[start, stop)`` of an object (one ranged GET, retried as a whole).

        Args:
            url: the object.
            start: first byte.
            stop: one past the last byte; must be > ``start``.
            if_match: an ETag; the read fails with ObjectChangedError if the object has another.
            deadline: no attempt starts past it (:meth:`call`), and the connection of a body
                still arriving when it passes is shut down (botocore's read timeout is per
                read: a body trickling a byte at a time never reaches it).

        Raises:
            ValueError: an empty or negative range.
            FileNotFoundError: the object does not exist.
            ObjectChangedError: ``if_match`` no longer matches.
            ObjectStorageError: the retry budget was spent, or the deadline passed.
        """
        parsed = _as_url(url).require_key()
        if start < 0 or stop <= start:
            raise ValueError(f"{parsed}: byte range [{start}, {stop}) is empty or negative")
        expected = stop - start
        arguments: dict[str, Any] = {
            "Bucket": parsed.bucket,
            "Key": parsed.key,
            "Range": f"bytes={start}-{stop - 1}",
        }
        if if_match is not None:
            arguments["IfMatch"] = if_match

        def fetch(client: Any) -> bytes:
            body = client.get_object(**arguments)["Body"]
            watched = _socket_of(body) if deadline is not None else None
            cut = deadline.watching(watched) if deadline is not None else contextlib.nullcontext()
            try:
                with cut:
                    data: bytes = body.read()
            finally:
                body.close()
            self.stats.add(bytes_received=len(data))
            if len(data) != expected:
                raise _ShortBody(f"got {len(data)} of {expected} bytes")
            return data

        return self.call(f"GET bytes={start}-{stop - 1}", parsed, fetch, deadline)

    def download(self, url: str | S3Url, local_path: str | os.PathLike[str]) -> ObjectInfo:
        """Copy an object to ``local_path`` atomically (temporary file, then rename).

        The object's ETag is read first and every GET carries ``If-Match``, so the file is one
        consistent version; an interrupted body resumes from the byte it reached.

        Returns:
            The size and ETag of the version written.

        Raises:
            FileNotFoundError: the object does not exist.
            ObjectChangedError: the object was replaced during the download.
            DataFormatError: fewer bytes arrived than HEAD announced.
            ObjectStorageError: the retry budget was spent.
        """
        from tokenmill.common.atomic import AtomicFile

        parsed = _as_url(url).require_key()
        info = self.stat(parsed)
        target = AtomicFile(local_path)
        try:
            written = 0
            while written < info.size:
                chunk = self.get_range(
                    parsed,
                    written,
                    min(info.size, written + _DOWNLOAD_READ_BYTES),
                    if_match=info.etag,
                )
                target.stream.write(chunk)
                written += len(chunk)
            target.commit()
        finally:
            target.abort()  # no-op after commit
        return info

    def list_objects(self, url: str | S3Url, *, recursive: bool = True) -> list[ObjectInfo]:
        """Every object whose key starts with the URL's key, sorted by key.

        Args:
            url: the prefix to list.
            recursive: False lists only the objects directly under the prefix (the server is
                asked with ``Delimiter="/"``, so deeper keys are not even sent).

        Cost: one LIST request per 1,000 objects (S3's page size).

        Raises:
            FileNotFoundError: the bucket does not exist.
            ObjectStorageError: the retry budget was spent.
        """
        parsed = _as_url(url)
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            arguments: dict[str, Any] = {"Bucket": parsed.bucket, "Prefix": parsed.key}
            if not recursive:
                arguments["Delimiter"] = "/"
            if token:
                arguments["ContinuationToken"] = token
            page: dict[str, Any] = self.call(
                "LIST", parsed, functools.partial(_list_page, arguments=arguments)
            )
            for item in page.get("Contents", []):
                found.append(
                    ObjectInfo(
                        str(S3Url(parsed.bucket, item["Key"])),
                        int(item["Size"]),
                        str(item.get("ETag", "")),
                    )
                )
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        return sorted(found, key=lambda info: info.url)

    def glob(self, pattern: str) -> list[str]:
        """Object URLs matching a shell pattern (``*``, ``?``, ``[...]``), sorted.

        The listing prefix is the key up to the first wildcard; ``*`` may cross ``/`` (as
        ``fnmatch`` does).
        """
        parsed = _as_url(pattern)
        cut = min((parsed.key.find(c) for c in "*?[" if c in parsed.key), default=-1)
        if cut < 0:
            return [str(parsed)] if self.exists(parsed) else []
        listing = self.list_objects(S3Url(parsed.bucket, parsed.key[:cut]))
        return [info.url for info in listing if fnmatch.fnmatchcase(info.url, str(parsed))]

    # -- writing ---------------------------------------------------------------------------

    def upload(self, local_path: str | os.PathLike[str], url: str | S3Url) -> ObjectInfo:
        """Upload a local file; the object appears whole or not at all (S3 PUTs are atomic).

        Files above 64 MiB go multipart; a failed attempt is retried from the start.

        Returns:
            The size and ETag of the uploaded object.

        Raises:
            FileNotFoundError: the local file does not exist.
            ObjectStorageError: the retry budget was spent.
        """
        parsed = _as_url(url).require_key()
        path = os.fspath(local_path)
        size = os.stat(path).st_size

        def put(client: Any) -> None:
            if size <= _MULTIPART_BYTES:
                with open(path, "rb") as stream:
                    client.put_object(Bucket=parsed.bucket, Key=parsed.key, Body=stream)
            else:
                from boto3.s3.transfer import TransferConfig

                transfer = TransferConfig(
                    multipart_threshold=_MULTIPART_BYTES, multipart_chunksize=_MULTIPART_BYTES
                )
                client.upload_file(path, parsed.bucket, parsed.key, Config=transfer)

        self.call(f"PUT from {path}", parsed, put)
        info = self.stat(parsed)
        if info.size != size:
            raise ObjectStorageError(
                f"{parsed}: uploaded {size} bytes from {path} but the object has {info.size}"
            )
        return info

    def delete(self, url: str | S3Url) -> None:
        """Delete an object (no error if it is already gone)."""
        parsed = _as_url(url).require_key()
        self.call("DELETE", parsed, lambda c: c.delete_object(Bucket=parsed.bucket, Key=parsed.key))


def _list_page(client: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    page: dict[str, Any] = client.list_objects_v2(**arguments)
    return page


_live_clients: weakref.WeakSet[S3Client] = weakref.WeakSet()


def _reinitialize_after_fork() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    for client in list(_live_clients):
        client._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinitialize_after_fork)


def _as_url(url: str | S3Url | os.PathLike[str]) -> S3Url:
    return url if isinstance(url, S3Url) else S3Url.parse(url)


_default_client: S3Client | None = None
_default_lock = threading.Lock()


def get_client() -> S3Client:
    """The process-wide client (built on first use from the environment)."""
    global _default_client
    client = _default_client
    if client is None:
        with _default_lock:
            if _default_client is None:
                _default_client = S3Client()
            client = _default_client
    return client


_policy_clients: dict[RetryPolicy, S3Client] = {}


def client_for(retry: RetryPolicy | None) -> S3Client:
    """The process-wide client for ``retry`` (None: :func:`get_client`), built once per policy."""
    if retry is None:
        return get_client()
    with _default_lock:
        client = _policy_clients.get(retry)
        if client is None:
            client = _policy_clients[retry] = S3Client(retry)
    return client


def set_client(client: S3Client | None) -> S3Client | None:
    """Replace the process-wide client (None: rebuild from the environment on next use).

    Returns:
        The previous client, so a caller (a test) can restore it.
    """
    global _default_client
    with _default_lock:
        previous, _default_client = _default_client, client
    return previous


def reset_clients() -> None:
    """Forget every process-wide client, so the next use rebuilds them from the environment."""
    set_client(None)
    with _default_lock:
        _policy_clients.clear()


@contextlib.contextmanager
def using_client(client: S3Client) -> Iterator[S3Client]:
    """Use ``client`` as the process-wide client inside a ``with`` block."""
    previous = set_client(client)
    try:
        yield client
    finally:
        set_client(previous)
