"""Index caches that live in a bucket: `path_to_cache` may be a manifest or an `s3://` prefix.

A trainer can point `path_to_cache` at

* a manifest written by `tokenmill publish` (`s3://…/manifest.json`, `https://…/manifest.json`
  or a local `manifest.json`): the entry's files are the objects whose file name starts with
  `<md5>-<Class>-<split>-`, wherever they sit below the manifest (e.g. `cache/`); or
* an `s3://bucket/prefix` holding the cache files themselves (directly under the prefix).

When a dataset opens its cache entry, the entry's files are downloaded (verified against the
manifest's sha256 when there is one) into a node-local directory, under a file lock, so the
ranks of a node fetch each entry once and later constructions find it in place; the local copy
is then used (memory-mapped) exactly like a local cache. The description is put in place last
(the commit point of the cache protocol), so a local entry with a description is whole. An
entry the location does not have is built into the local directory as usual (by the
cache-building rank).

Request counts for an `s3://` prefix. The prefix is listed once per node (per job, see below),
not once per entry: the first process of the node that needs the listing lists the whole prefix
(non-recursive, one LIST request per 1,000 objects) under ``.listing.lock`` and writes it
atomically to ``.listing-<job>.json`` in the local directory; every later entry, rank and
DataLoader worker of the node reads that file (each process once, then one stat per entry it
fetches to see that the file is still the node's listing; a forked worker inherits the copy).
An entry whose description and arrays are already in the local directory needs no request at
all. Fetching an entry costs a HEAD and a GET per file. A blend of 1,000 sources on 1,000 ranks
of 125 nodes thus lists 125 times instead of about 10^6.

Freshness. The listing describes the bucket when the job first needed it. It is reused by the
processes of the same job, named by ``TOKENMILL_CACHE_LISTING_ID``, else ``SLURM_JOB_ID``,
else ``TORCHELASTIC_RUN_ID``, for at most ``TOKENMILL_CACHE_LISTING_MAX_AGE`` seconds
(default 600; 0: every entry fetched lists again). An entry published after
the listing is not seen by this job: it is built locally, as an absent entry always is (the
same bytes, so nothing is wrong, only duplicated). An object listed but gone when fetched makes
the process list again once. :func:`refresh_cache_listing` drops the node's listing: the next
entry that any process of the node fetches lists again.

Without a working lock (``ENOLCK``, ``EOPNOTSUPP``: see docs/cache-protocol.md) every process
that needs the listing may list once, and every process that needs an entry downloads it into
its own temporary directory and renames the files into place: duplicate work, never a mixed or
partial entry.

The local directory is `$TOKENMILL_CACHE_DIR/remote-index-caches/<md5 of the location>`
(`TOKENMILL_CACHE_DIR` defaults to `~/.cache/tokenmill`); put it on a node-local disk.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.common.atomic import atomic_write_text, durable_replace
from tokenmill.common.locks import best_effort_lock
from tokenmill.common.owner import MAX_AGE, owner_tag, remove_abandoned
from tokenmill.storage.manifest import Manifest, ManifestObject

__all__ = [
    "DEFAULT_LISTING_MAX_AGE",
    "fetch_cache_entry",
    "is_remote_cache",
    "listing_identity",
    "local_cache_directory",
    "refresh_cache_listing",
]

logger = logging.getLogger(__name__)

DEFAULT_LISTING_MAX_AGE = 600.0
"""Seconds a node's listing of an `s3://` cache prefix is reused (TOKENMILL_CACHE_LISTING_MAX_AGE)."""

_LISTING_FORMAT = "tokenmill-remote-cache-listing/1"
_DESCRIPTION_SUFFIX = "-description.txt"

_manifests: dict[str, tuple[Manifest, str]] = {}
_manifests_lock = threading.Lock()
# location -> this process's copy of the node's listing, and the listing file it came from
# (inode, mtime, size): a copy is used only while that file is still the node's listing
_listings: dict[str, tuple[_Listing, tuple[int, int, int]]] = {}
_swept: set[str] = set()  # local directories swept for abandoned fetch directories


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


def listing_identity() -> str:
    """The job whose processes share a node's listing: ``TOKENMILL_CACHE_LISTING_ID``, else
    ``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (torchrun's, unless "none"), else ""."""
    for name in ("TOKENMILL_CACHE_LISTING_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name, "")
        if value and value != "none":
            return f"{name}={value}"
    return ""


def _max_age() -> float:
    name = "TOKENMILL_CACHE_LISTING_MAX_AGE"
    raw = os.environ.get(name, "")
    if not raw:
        return DEFAULT_LISTING_MAX_AGE
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"environment variable {name} must be >= 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class _Listing:
    """The objects directly under an `s3://` prefix: sorted names and their sizes."""

    location: str
    identity: str
    created: float  # time.time() just before the LIST began
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def fresh(self, identity: str, max_age: float, newer_than: float | None) -> bool:
        if self.identity != identity or (newer_than is not None and self.created <= newer_than):
            return False
        age = time.time() - self.created
        return -60.0 <= age <= max_age  # (a clock stepped far back: list again)

    def entry(self, base: str) -> list[tuple[str, int]]:
        """The names (and sizes) that start with ``<base>-``: a bisection, not a scan."""
        wanted = f"{base}-"
        found = []
        index = bisect.bisect_left(self.names, wanted)
        while index < len(self.names) and self.names[index].startswith(wanted):
            found.append((self.names[index], self.sizes[index]))
            index += 1
        return found

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _LISTING_FORMAT,
                "location": self.location,
                "identity": self.identity,
                "created": self.created,
                "names": list(self.names),
                "sizes": list(self.sizes),
            }
        )

    @classmethod
    def read(cls, path: str, location: str) -> _Listing | None:
        """The listing in `path`, or None if it is missing, unreadable or not this location's."""
        try:
            with open(path, encoding="utf-8") as stream:
                loaded = json.load(stream)
        except (OSError, ValueError):
            return None
        if not isinstance(loaded, dict) or loaded.get("format") != _LISTING_FORMAT:
            return None
        names, sizes = loaded.get("names"), loaded.get("sizes")
        created, identity = loaded.get("created"), loaded.get("identity")
        if (
            loaded.get("location") != location
            or not isinstance(identity, str)
            or not isinstance(created, (int, float))
            or not isinstance(names, list)
            or not isinstance(sizes, list)
            or len(names) != len(sizes)
            or not all(isinstance(name, str) and "/" not in name for name in names)
            or not all(isinstance(size, int) and size >= 0 for size in sizes)
        ):
            return None
        pairs = sorted(zip(names, sizes))
        return cls(
            location,
            identity,
            float(created),
            tuple(name for name, _ in pairs),
            tuple(size for _, size in pairs),
        )


def _listing_path(local: str, identity: str) -> str:
    digest = hashlib.md5(identity.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]
    return os.path.join(local, f".listing-{digest}.json")


def _locked(path: str) -> contextlib.AbstractContextManager[bool]:
    """`common.locks.best_effort_lock`: a lock that fails only means a fetch may be done twice."""
    return best_effort_lock(path, "fetching")


def _sweep(local: str) -> None:
    """Once per process and directory: remove fetch directories whose writer is provably gone
    (a process killed while downloading without the lock, `common.owner`)."""
    with _manifests_lock:
        if local in _swept:
            return
        _swept.add(local)
    try:
        remove_abandoned(local, lambda name: ".fetch.tm-" in name and name.endswith(".tmp"))
    except OSError as error:  # best effort: leftovers are hidden and harmless
        logger.debug("cannot sweep %s: %s", local, error)


def _list_prefix(location: str, identity: str) -> _Listing:
    from tokenmill.storage.s3 import get_client

    prefix = location.rstrip("/") + "/"
    created = time.time()
    found = sorted(
        (info.url[len(prefix) :], info.size)
        for info in get_client().list_objects(prefix, recursive=False)
        if info.url.startswith(prefix) and "/" not in info.url[len(prefix) :]
    )
    return _Listing(
        location,
        identity,
        created,
        tuple(name for name, _ in found),
        tuple(size for _, size in found),
    )


def _drop_old_listings(local: str, keep: str) -> None:
    """Listings of other jobs older than a day (one scan per listing written)."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(local) as entries:
        for entry in entries:
            if entry.name.startswith(".listing-") and entry.name.endswith(".json"):
                with contextlib.suppress(OSError):
                    if entry.path != keep and now - entry.stat().st_mtime > MAX_AGE:
                        os.unlink(entry.path)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns, status.st_size


def _node_listing(location: str, local: str, newer_than: float | None = None) -> _Listing:
    """This node's listing of an `s3://` cache prefix: the process's copy while the node's
    file is unchanged (one stat), else the node's file, else one LIST made under the node's
    lock and shared through that file.

    `newer_than`: a listing made before this time is not good enough (an object it names is
    gone).
    """
    identity, max_age = listing_identity(), _max_age()
    path = _listing_path(local, identity)
    signature = _signature(path)
    with _manifests_lock:
        known = _listings.get(location)
    if (
        known is not None
        and signature is not None
        and known[1] == signature
        and known[0].fresh(identity, max_age, newer_than)
    ):
        return known[0]
    shared = _Listing.read(path, location)
    if shared is None or not shared.fresh(identity, max_age, newer_than):
        with _locked(os.path.join(local, ".listing.lock")):
            signature = _signature(path)
            shared = _Listing.read(path, location)  # another process may have listed meanwhile
            if shared is None or not shared.fresh(identity, max_age, newer_than):
                shared = _list_prefix(location, identity)
                atomic_write_text(path, shared.to_json())
                signature = _signature(path)
                _drop_old_listings(local, path)
    if signature is not None:
        with _manifests_lock:
            _listings[location] = (shared, signature)
    return shared


def refresh_cache_listing(location: str) -> None:
    """Drop this node's listing of an `s3://` cache prefix (every job's): the next entry that
    any process of the node fetches lists the bucket again, once for the node. Call it on one
    process per node after publishing new entries into the prefix during a job (a new job
    lists again by itself)."""
    with _manifests_lock:
        _listings.pop(location, None)
    local = local_cache_directory(location)
    with contextlib.suppress(OSError), os.scandir(local) as entries:
        for entry in entries:
            if entry.name.startswith(".listing-") and entry.name.endswith(".json"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


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


def _manifest_objects(location: str, base: str) -> list[ManifestObject]:
    from tokenmill.storage.download import check_source
    from tokenmill.storage.transfer import join_location

    wanted = f"{base}-"
    manifest, where = _manifest(location)
    # a cache manifest sits in a bucket others may write to: its objects must lie under it
    return [
        ManifestObject(
            item.key.rsplit("/", 1)[-1],
            item.size,
            item.sha256,
            check_source(item.url or join_location(where, item.key), where, (), False, item.key),
            item.mtime_ns,
        )
        for item in manifest.objects
        if item.key.rsplit("/", 1)[-1].startswith(wanted)
    ]


def _description_last(objects: Sequence[ManifestObject]) -> list[ManifestObject]:
    return sorted(objects, key=lambda item: (item.key.endswith(_DESCRIPTION_SUFFIX), item.key))


def _complete(local: str, base: str, array_names: Sequence[str]) -> bool:
    """Whether the entry's description and every array are in the local directory."""
    names = [f"{base}{_DESCRIPTION_SUFFIX}", *(f"{base}-{name}.npy" for name in array_names)]
    return all(os.path.isfile(os.path.join(local, name)) for name in names)


def _download_private(objects: Sequence[ManifestObject], local: str, base: str, where: str) -> None:
    """Download into a directory of this process's own, then rename each file into place,
    the description last: correct with no lock, and never mixes files of two versions."""
    from tokenmill.storage.download import download

    private = tempfile.mkdtemp(prefix=f".{base}.fetch.{owner_tag()}.", suffix=".tmp", dir=local)
    try:
        download(Manifest(tuple(objects)), private, base=where or None)
        for item in _description_last(objects):
            durable_replace(os.path.join(private, item.key), os.path.join(local, item.key))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _fetch_from_prefix(location: str, local: str, base: str) -> None:
    prefix = location.rstrip("/") + "/"
    listing = _node_listing(location, local)

    def objects(found: _Listing) -> list[ManifestObject]:
        return [ManifestObject(name, size, None, prefix + name) for name, size in found.entry(base)]

    wanted = objects(listing)
    if not wanted:
        return  # absent from the bucket (when listed): built locally
    try:
        _download_private(wanted, local, base, "")
    except FileNotFoundError:
        # an object listed is gone: list again (once) and fetch what is there now
        wanted = objects(_node_listing(location, local, newer_than=listing.created))
        if wanted:
            _download_private(wanted, local, base, "")


def fetch_cache_entry(location: str, base: str, array_names: Sequence[str] | None = None) -> str:
    """Make the files of cache entry `base` available locally; returns the local directory.

    Args:
        location: the remote cache (a manifest, or an `s3://` prefix).
        base: the entry, ``<md5>-<Class>-<split>``.
        array_names: the entry's arrays. With them, an `s3://` entry whose description and
            arrays are already in the local directory is used without any request.

    Raises:
        ChecksumError: a file does not match the manifest.
        ObjectStorageError / FileNotFoundError: the location cannot be read.
        ValueError: an http(s) location that is not a manifest.
    """
    from tokenmill.storage.download import download

    is_manifest = location.endswith(".json")
    if not is_manifest and not location.startswith("s3://"):
        raise ValueError(
            f"path_to_cache {location!r}: an http(s) cache location must be a manifest "
            "(…/manifest.json); plain HTTP cannot list a directory"
        )
    local = local_cache_directory(location)
    known = array_names is not None and not is_manifest
    if known and _complete(local, base, array_names or ()):
        return local
    os.makedirs(local, exist_ok=True)
    _sweep(local)
    with _locked(os.path.join(local, f".{base}.fetch.lock")) as locked:
        if known and _complete(local, base, array_names or ()):
            return local  # another process of the node fetched it while we waited
        if not is_manifest:
            _fetch_from_prefix(location, local, base)
            return local
        objects = _manifest_objects(location, base)
        if not objects:
            return local
        # checked against the manifest's location by _manifest_objects; local paths are then
        # confined to the directory of a local manifest
        where = _manifest(location)[1]
        if not locked:
            _download_private(objects, local, base, where)
            return local
        # under the lock: resumable `.partial` files in place; the description last
        ordered = _description_last(objects)
        last = 1 if ordered[-1].key.endswith(_DESCRIPTION_SUFFIX) else 0
        for batch in (ordered[: len(ordered) - last], ordered[len(ordered) - last :]):
            if batch:
                download(Manifest(tuple(batch)), local, base=where or None)
    return local
