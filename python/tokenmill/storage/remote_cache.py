"""Index caches that live in a bucket: `path_to_cache` may be a manifest or an `s3://` prefix.

A trainer can point `path_to_cache` at

* a manifest written by `tokenmill publish` (`s3://…/manifest.json`, `https://…/manifest.json`
  or a local `manifest.json`): the entry's files are the objects whose file name starts with
  `<md5>-<Class>-<split>-`, wherever they sit below the manifest (e.g. `cache/`); or
* an `s3://bucket/prefix` holding the cache files themselves.

When a dataset opens its cache entry, the entry's files are downloaded (verified against the
manifest's sha256 when there is one) into a node-local directory, under a file lock, so the
ranks of a node fetch each entry once and later constructions find it in place; the local copy
is then used (memory-mapped) exactly like a local cache. An entry the location does not have is
built into the local directory as usual (by the cache-building rank).

The local directory is `$TOKENMILL_CACHE_DIR/remote-index-caches/<md5 of the location>`
(`TOKENMILL_CACHE_DIR` defaults to `~/.cache/tokenmill`); put it on a node-local disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator

from tokenmill.storage.manifest import Manifest, ManifestObject

__all__ = ["fetch_cache_entry", "is_remote_cache", "local_cache_directory"]

_manifests: dict[str, tuple[Manifest, str]] = {}
_manifests_lock = threading.Lock()


def is_remote_cache(location: str) -> bool:
    """Whether `path_to_cache` names a manifest or an object-storage prefix."""
    if location.startswith(("s3://", "http://", "https://")):
        return True
    return location.endswith(".json") and not os.path.isdir(location)


def local_cache_directory(location: str) -> str:
    """The node-local directory that mirrors the entries of a remote cache location."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill"
    )
    digest = hashlib.md5(location.encode("utf-8"), usedforsecurity=False).hexdigest()
    return os.path.join(root, "remote-index-caches", digest)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _manifest(location: str) -> tuple[Manifest, str]:
    """The manifest (read once per process) and the base its keys are relative to."""
    from tokenmill.storage.transfer import load_manifest

    with _manifests_lock:
        cached = _manifests.get(location)
    if cached is None:
        cached = load_manifest(location)
        with _manifests_lock:
            _manifests[location] = cached
    return cached


def _entry_objects(location: str, base: str) -> list[ManifestObject]:
    from tokenmill.storage.transfer import join_location

    wanted = f"{base}-"
    if location.endswith(".json"):
        from tokenmill.storage.download import check_source

        manifest, where = _manifest(location)
        # a cache manifest sits in a bucket others may write to: its objects must lie under it
        return [
            ManifestObject(
                item.key.rsplit("/", 1)[-1],
                item.size,
                item.sha256,
                check_source(
                    item.url or join_location(where, item.key), where, (), False, item.key
                ),
                item.mtime_ns,
            )
            for item in manifest.objects
            if item.key.rsplit("/", 1)[-1].startswith(wanted)
        ]
    if location.startswith("s3://"):
        from tokenmill.storage.s3 import get_client

        prefix = location.rstrip("/") + "/"
        listing = get_client().list_objects(prefix + wanted)
        return [
            ManifestObject(info.url[len(prefix) :], info.size, None, info.url)
            for info in listing
            if "/" not in info.url[len(prefix) :]
        ]
    raise ValueError(
        f"path_to_cache {location!r}: an http(s) cache location must be a manifest "
        "(…/manifest.json); plain HTTP cannot list a directory"
    )


def fetch_cache_entry(location: str, base: str) -> str:
    """Make the files of cache entry `base` available locally; returns the local directory.

    Raises:
        ChecksumError: a file does not match the manifest.
        ObjectStorageError / FileNotFoundError: the location cannot be read.
        ValueError: an http(s) location that is not a manifest.
    """
    from tokenmill.storage.download import download

    local = local_cache_directory(location)
    os.makedirs(local, exist_ok=True)
    with _locked(os.path.join(local, f".{base}.fetch.lock")):
        objects = _entry_objects(location, base)
        if objects:
            # checked against the manifest's location by _entry_objects; local paths are then
            # confined to the directory of a local manifest
            where = _manifest(location)[1] if location.endswith(".json") else ""
            download(Manifest(tuple(objects)), local, base=where or None)
    return local
