"""Local copies of small objects (``.idx`` files, sidecars): downloaded once, reused after.

``cache_object(url, cache_root)`` returns ``<cache_root>/<bucket>/<key>`` after making sure it
holds the object's current version:

1. one HEAD request gives the object's size and ETag;
2. a hit needs the local file to have that size AND a record ``.<name>.tokenmill-object.json``
   beside it naming the same URL, size and ETag; a hit costs that HEAD and two ``stat`` calls;
3. otherwise the caller takes an exclusive ``fcntl`` lock on ``.<name>.lock`` in the same
   directory when the filesystem gives one (``common.locks``: without it two processes may both
   download, harmlessly), checks again (another process on the node may have finished meanwhile) and
   downloads into a temporary file with ``If-Match`` on every GET (one consistent version),
   renames it into place, then writes the record the same way.

So every rank of a node can call it at once and the node downloads once; a crash between the two
renames leaves a record that does not match and the next call downloads again; a changed object
(new ETag) is fetched again instead of silently reusing the old bytes. megatron-core, by
contrast, re-downloads the ``.idx`` on every construction on rank 0 and relies on a barrier.
"""

from __future__ import annotations

import contextlib
import json
import os

from tokenmill.common.atomic import AtomicFile
from tokenmill.common.locks import best_effort_lock
from tokenmill.storage.object_storage import local_cache_path
from tokenmill.storage.s3 import ObjectInfo, S3Client, get_client

__all__ = ["cache_object", "cache_object_if_exists", "record_path"]

_RECORD_FORMAT = "tokenmill.cached-object"


def record_path(local_path: str) -> str:
    """The record beside a cached file: ``.<name>.tokenmill-object.json``."""
    directory, name = os.path.split(local_path)
    return os.path.join(directory, f".{name}.tokenmill-object.json")


def _locked(local_path: str) -> contextlib.AbstractContextManager[bool]:
    """The node's lock on downloading `local_path`, best effort (`common.locks`): without a
    working lock two processes download the same version and rename the same bytes."""
    directory, name = os.path.split(local_path)
    return best_effort_lock(os.path.join(directory, f".{name}.lock"), f"downloading {local_path}")


def _is_fresh(local_path: str, info: ObjectInfo) -> bool:
    try:
        if os.stat(local_path).st_size != info.size:
            return False
        with open(record_path(local_path), encoding="utf-8") as stream:
            record = json.load(stream)
    except (OSError, ValueError):
        return False
    return bool(
        isinstance(record, dict)
        and record.get("format") == _RECORD_FORMAT
        and record.get("url") == info.url
        and record.get("size") == info.size
        and record.get("etag") == info.etag
    )


def _write_record(local_path: str, info: ObjectInfo) -> None:
    target = AtomicFile(record_path(local_path))
    try:
        payload = {"format": _RECORD_FORMAT, "url": info.url, "size": info.size, "etag": info.etag}
        target.stream.write((json.dumps(payload, sort_keys=True) + "\n").encode("utf-8"))
        target.commit()
    finally:
        target.abort()  # no-op after commit


def cache_object(url: str, cache_root: str, client: S3Client | None = None) -> str:
    """The local copy of ``url`` under ``cache_root``, downloaded only when missing or stale.

    Args:
        url: an ``s3://bucket/key`` object.
        cache_root: the local cache directory (created if needed).
        client: the S3 client (default: the process-wide one).

    Returns:
        ``<cache_root>/<bucket>/<key>``.

    Raises:
        FileNotFoundError: the object does not exist.
        ObjectStorageError: the retry budget was spent.
        DataFormatError: the download does not have the size HEAD announced.
    """
    client = client if client is not None else get_client()
    local_path = local_cache_path(url, cache_root)
    info = client.stat(url)
    if _is_fresh(local_path, info):
        return local_path
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    with _locked(local_path):
        if _is_fresh(local_path, info):
            return local_path
        written = client.download(url, local_path)
        size = os.stat(local_path).st_size
        if size != written.size:
            from tokenmill.errors import DataFormatError

            raise DataFormatError(
                f"{url}: downloaded {size} bytes to {local_path} but the object has {written.size}"
            )
        _write_record(local_path, written)
    return local_path


def cache_object_if_exists(url: str, cache_root: str, client: S3Client | None = None) -> str | None:
    """Like :func:`cache_object`, but None when the object does not exist (e.g. an optional
    sidecar)."""
    try:
        return cache_object(url, cache_root, client)
    except FileNotFoundError:
        return None
