"""Transfers between local directories, S3 and HTTP(S): what publishing and downloading share.

`tokenmill.storage.publish` uploads dataset prefixes, caches and files with a manifest (written
last, the commit point); `tokenmill.storage.download` fetches them on every node, verified
against the manifest's sizes and sha256 and resumable after a kill. Both use this module: the
`TransferPolicy` (workers, attempts, exponential backoff with full jitter, part size, timeout),
locations (`s3://`, `http(s)://`, local paths joined with a manifest key), HTTP requests retried
on connection errors, timeouts and 5xx/429 answers, sha256 of files in 1 MiB blocks, and reading
a manifest or a plain shard list (`URL [sha256]` lines) from any location.

HTTP goes through the standard library (``urllib``) with its own small retry loop rather than
requests/urllib3, so `tokenmill download` of a plain shard list works with no extra dependency;
S3 requests go through `tokenmill.storage.s3` (botocore).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import ObjectStorageError
from tokenmill.storage.manifest import (
    Manifest,
    base_location,
    parse_shard_list,
)

__all__ = [
    "DEADLINE_SECONDS_PER_BYTE",
    "MANIFEST_NAME",
    "READ_BYTES",
    "Deadline",
    "DeadlinePassed",
    "RangeNotSatisfiable",
    "TransferPolicy",
    "http_open",
    "is_http_location",
    "is_s3_location",
    "join_location",
    "load_manifest",
    "read_location",
    "s3_client",
    "sha256_file",
]

MANIFEST_NAME = "manifest.json"
READ_BYTES = 1 << 20  # block size of hashing and copying


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
        deadline: seconds an HTTP or ``s3://`` object (a download, a manifest) may take in
            all, over all its requests and attempts, however steadily its bytes trickle in,
            plus one second per MiB of its size (declared by the manifest; for an ``s3://``
            object without one, its HEAD's: a 1 MiB/s floor for large objects); then it fails.
            None: no total limit (only `timeout`, and for S3 the client's read timeout and
            retry budget). A download stopped by it resumes from its partial file when rerun.

    Raises:
        ValueError: a value out of range (names the field).
    """

    workers: int = 4
    max_attempts: int = 6
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    part_bytes: int = 8 << 20
    timeout: float = 60.0
    deadline: float | None = 600.0

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
        if self.deadline is not None and not self.deadline > 0:
            raise ValueError(f"TransferPolicy.deadline must be > 0 or None, got {self.deadline}")

    def delay(self, attempt: int) -> float:
        return random.uniform(
            0.0, min(self.backoff_max, self.backoff_base * 2.0 ** min(attempt, 30))
        )


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def is_s3_location(location: str) -> bool:
    """Whether `location` is an ``s3://`` URL."""
    return location.startswith("s3://")


def is_http_location(location: str) -> bool:
    """Whether `location` is an ``http(s)://`` URL."""
    return location.startswith(("http://", "https://"))


def join_location(base: str, key: str) -> str:
    """`base/key` for an s3:// or http(s):// prefix, or a path below a local directory."""
    if is_s3_location(base) or is_http_location(base):
        return base.rstrip("/") + "/" + key
    return os.path.join(base, *key.split("/"))


def s3_client() -> Any:
    """The process's retrying S3 client (`tokenmill.storage.s3`)."""
    from tokenmill.storage.s3 import get_client

    return get_client()


# -- reading whole small objects (manifests) ---------------------------------------------------


class RangeNotSatisfiable(Exception):
    """HTTP 416: the server's object is no longer than the bytes we already have."""


def url_within(location: str, prefix: str) -> bool:
    """Whether the http(s)/s3 URL `location` lies under the URL `prefix` as a server sees it:
    same scheme and host, no query or fragment, and a percent-decoded path below the prefix's
    without '.' or '..' segments, backslashes or NUL ('%2e%2e' is '..' to the server)."""
    here, there = urllib.parse.urlsplit(location), urllib.parse.urlsplit(prefix)
    if (here.scheme.lower(), here.netloc.lower()) != (there.scheme.lower(), there.netloc.lower()):
        return False
    if here.query or here.fragment:
        return False
    path = urllib.parse.unquote(here.path)
    if "\\" in path or "\x00" in path or any(part in (".", "..") for part in path.split("/")):
        return False
    base_path = urllib.parse.unquote(there.path).rstrip("/") + "/"
    return path.startswith(base_path) or base_path == "/"


class RedirectRefused(ObjectStorageError):
    """An HTTP redirect to a place a manifest may not name."""


class _ConfinedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL under `prefix`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> Any:
        if not url_within(newurl, self.prefix):
            fp.close()  # the redirect response holds the socket
            raise RedirectRefused(
                f"{req.full_url}: refusing the HTTP {code} redirect to {newurl[:300]!r}: it "
                f"leaves the manifest's location {self.prefix!r}"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class DeadlinePassed(ObjectStorageError):
    """An HTTP or ``s3://`` object did not arrive within its total deadline
    (TransferPolicy.deadline)."""


# The deadline's allowance per declared byte: one second per MiB (a 1 MiB/s floor).
DEADLINE_SECONDS_PER_BYTE = 1.0 / (1 << 20)


class Deadline:
    """The moment an HTTP object's exchange is cut, whatever its per-read timeouts say: the
    socket of every connection opened for it is shut down then (a timer thread per
    connection), so a read blocked on a server that trickles a body, or never ends it, returns
    at once, and :meth:`check` raises DeadlinePassed.

    Args:
        seconds: the total; None: never.
        what: names the object in the error.
    """

    def __init__(self, seconds: float | None, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self._at = None if seconds is None else time.monotonic() + seconds
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()
        self.passed = False

    @classmethod
    def for_object(cls, policy: TransferPolicy, what: str, size: int | None = None) -> Deadline:
        """The deadline of one object: ``policy.deadline`` plus one second per MiB of `size`."""
        if policy.deadline is None:
            return cls(None, what)
        return cls(policy.deadline + (size or 0) * DEADLINE_SECONDS_PER_BYTE, what)

    def allow_size(self, size: int) -> None:
        """Add the allowance of `size` bytes, learnt after the deadline started (an ``s3://``
        object's HEAD, when no manifest declared its size)."""
        if self.seconds is not None and self._at is not None:
            extra = size * DEADLINE_SECONDS_PER_BYTE
            self.seconds += extra
            self._at += extra

    def remaining(self) -> float | None:
        return None if self._at is None else self._at - time.monotonic()

    def check(self, detail: str = "") -> None:
        """DeadlinePassed if the deadline has passed (or cut a connection)."""
        remaining = self.remaining()
        if self.passed or (remaining is not None and remaining <= 0):
            self.passed = True
            raise DeadlinePassed(
                f"{self.what}: not complete after {self.seconds:.0f} s, its total deadline "
                f"(TransferPolicy.deadline, download --deadline){detail}; stopped"
            )

    def watch(self, sock: socket.socket) -> threading.Timer | None:
        """Shut `sock` down when the deadline passes (at once if it has); the timer, if any."""
        remaining = self.remaining()
        if remaining is None:
            return None
        timer = threading.Timer(max(0.0, remaining), self._cut, (sock,))
        timer.daemon = True
        with self._lock:
            self._timers.append(timer)
        timer.start()
        return timer

    @contextlib.contextmanager
    def watching(self, sock: socket.socket | None) -> Iterator[None]:
        """Shut `sock` down if the deadline passes within the block: one exchange on a pooled
        connection (an S3 GET), which must not be cut once it is back in the pool."""
        timer = self.watch(sock) if sock is not None else None
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
                with self._lock, contextlib.suppress(ValueError):
                    self._timers.remove(timer)

    def _cut(self, sock: socket.socket) -> None:
        self.passed = True
        with contextlib.suppress(OSError):  # closed since: nothing to cut
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop the timers (the exchange is over)."""
        with self._lock:
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()


def _deadline_handlers(deadline: Deadline) -> list[Any]:
    """urllib handlers whose connections `deadline` watches from the moment they connect."""

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    class SecureConnection(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(Connection, req)

    class SecureHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            # the context HTTPSHandler was built with (urllib keeps it private)
            return self.do_open(SecureConnection, req, context=getattr(self, "_context", None))

    return [Handler(), SecureHandler()]


def http_open(
    url: str,
    policy: TransferPolicy,
    headers: Mapping[str, str] | None = None,
    confine: str | None = None,
    deadline: Deadline | None = None,
) -> Any:
    """urlopen with retries on transient failures; 404 is FileNotFoundError. With `confine`, a
    redirect to a URL outside that prefix raises RedirectRefused (never followed). With
    `deadline`, every connection is cut when it passes, and no attempt starts after it
    (DeadlinePassed)."""
    attempt = 0
    handlers: list[Any] = []
    if confine is not None:
        handlers.append(_ConfinedRedirects(confine))
    if deadline is not None:
        handlers.extend(_deadline_handlers(deadline))
    opener = urllib.request.build_opener(*handlers).open if handlers else urllib.request.urlopen
    while True:
        timeout = policy.timeout
        if deadline is not None:
            deadline.check()
            remaining = deadline.remaining()
            if remaining is not None:
                timeout = max(1e-3, min(timeout, remaining))
        try:
            request = urllib.request.Request(url, headers=dict(headers or {}))
            return opener(request, timeout=timeout)
        except urllib.error.HTTPError as error:
            error.close()  # it holds the response's socket
            if error.code == 404:
                raise FileNotFoundError(errno.ENOENT, f"not found: {url} (HTTP 404)") from None
            if error.code == 416:
                raise RangeNotSatisfiable(url) from None
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
        if deadline is not None:
            deadline.check(f" ({attempt} attempts, last: {type(last).__name__}: {last})")
        if attempt >= policy.max_attempts:
            raise ObjectStorageError(
                f"{url}: failed after {attempt} attempts: {type(last).__name__}: {last}"
            ) from last
        delay = policy.delay(attempt - 1)
        remaining = None if deadline is None else deadline.remaining()
        time.sleep(delay if remaining is None else max(0.0, min(delay, remaining)))


# a manifest (or shard list) longer than this is refused: a body that never ends, or millions of
# entries, would otherwise grow without bound (a manifest entry is about 200 bytes)
MAX_MANIFEST_BYTES = 256 << 20


def read_location(
    location: str, policy: TransferPolicy | None = None, limit: int | None = None
) -> bytes:
    """The bytes of a local file, an `s3://` object or an `http(s)://` URL, at most `limit`.

    Raises:
        FileNotFoundError: it does not exist.
        ObjectStorageError: the retries were spent.
        ValueError: it holds more than `limit` bytes (named, with the limit).
    """
    policy = policy or TransferPolicy()
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    too_long = ValueError(
        f"{location}: longer than {limit:,} bytes; refusing to read it whole (a manifest that "
        "large, or a body that never ends, is not one tokenmill wrote)"
    )
    if is_s3_location(location):
        client = s3_client()
        deadline = Deadline.for_object(policy, location)
        try:
            size = client.stat(location, deadline=deadline).size
            if size > limit:
                raise too_long
            return bytes(client.get_range(location, 0, size, deadline=deadline)) if size else b""
        finally:
            deadline.close()
    if is_http_location(location):
        deadline = Deadline.for_object(policy, location)
        try:
            with http_open(location, policy, deadline=deadline) as response:
                data: bytes = response.read(limit + 1)
        except (ConnectionError, TimeoutError, http.client.HTTPException) as error:
            deadline.check()
            raise ObjectStorageError(f"{location}: {type(error).__name__}: {error}") from error
        finally:
            deadline.close()
        deadline.check(f" (after {len(data):,} bytes)")  # a cut looks like the body's end
    else:
        with open(location, "rb") as stream:
            data = stream.read(limit + 1)
    if len(data) > limit:
        raise too_long
    return data


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
