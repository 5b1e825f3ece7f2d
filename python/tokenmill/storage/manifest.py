"""Manifests: the list of objects a published dataset or cache consists of.

``manifest.json`` sits beside the objects it lists (keys are relative to its directory)::

    {"format": "tokenmill.manifest", "version": 1,
     "objects": [{"key": "web_text_document.bin", "size": 123456, "sha256": "9f86...",
                  "mtime_ns": 1763771000000000000},
                 {"key": "cache/0a1b...-GPTDataset-train-description.txt", ...}],
     "config": {...}}            # the dataset config the objects serve (or null)

Plain HTTP(S) shard lists (nanochat-style) become manifests too: one ``URL [sha256]`` per line
(``#`` starts a comment); such objects carry their absolute ``url`` and may lack a size or
checksum, in which case the downloader cannot verify them and says so in its report.

Keys are relative POSIX paths without ``..``; a manifest that breaks this, or lists a key twice,
raises ValueError naming the manifest and the key, so a download can never write outside its
directory. Sizes, mtimes and URLs are bounded and type-checked; *where* an object may come from
(only under the manifest's own location, or an explicit allow-list) is checked by
`tokenmill.storage.download.check_source`.
"""

from __future__ import annotations

import json
import posixpath
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.common.sidecar import check_header

__all__ = [
    "FORMAT",
    "VERSION",
    "Manifest",
    "ManifestObject",
    "base_location",
    "check_key",
    "parse_shard_list",
]

FORMAT = "tokenmill.manifest"
VERSION = 1
MAX_SIZE = 1 << 50
"""The largest object size a manifest may state (1 PiB): a bigger one is corruption."""
MAX_MTIME_NS = (1 << 63) - 1
MAX_URL = 4096


def check_key(key: Any, where: str) -> str:
    """`key` if it is a safe relative object key, else ValueError naming `where`."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: object key must be a non-empty string, got {key!r}")
    import urllib.parse

    # a key also becomes a URL path (join_location): '%2e%2e' is '..' to the server
    decoded = urllib.parse.unquote(key)
    parts = key.split("/") + decoded.split("/")
    if (
        key.startswith("/")
        or decoded.startswith("/")
        or "\\" in decoded
        or "\x00" in decoded
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise ValueError(
            f"{where}: object key {key[:200]!r} must be a relative path without '.', '..' or "
            "empty parts (also once percent-decoded), backslashes or NUL"
        )
    return key


@dataclass(frozen=True)
class ManifestObject:
    """One object: its key (relative to the manifest), size in bytes and sha256 hex digest.

    `url` is set for objects of plain shard lists, which may lack `size` and `sha256`.
    """

    key: str
    size: int | None
    sha256: str | None
    url: str | None = None
    mtime_ns: int | None = None
    """The published file's modification time; downloads restore it, so the data fingerprints
    recorded beside index cache entries (size, mtime, sampled bytes) still match."""

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"key": self.key, "size": self.size, "sha256": self.sha256}
        if self.url is not None:
            entry["url"] = self.url
        if self.mtime_ns is not None:
            entry["mtime_ns"] = self.mtime_ns
        return entry


@dataclass(frozen=True)
class Manifest:
    """The objects of a published dataset or cache, and the config they serve."""

    objects: tuple[ManifestObject, ...]
    config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for item in self.objects:
            check_key(item.key, "manifest")
            if item.key in seen:
                raise ValueError(f"manifest: object key {item.key!r} appears twice")
            seen.add(item.key)

    def find(self, key: str) -> ManifestObject:
        """The object with this key.

        Raises:
            KeyError: no such object.
        """
        for item in self.objects:
            if item.key == key:
                return item
        raise KeyError(f"manifest has no object {key!r}")

    @property
    def total_bytes(self) -> int:
        return sum(item.size or 0 for item in self.objects)

    def to_json(self) -> str:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "objects": [item.to_json() for item in self.objects],
            "config": self.config,
        }
        return json.dumps(payload, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse and validate a manifest.

        Raises:
            ValueError: not JSON, not a tokenmill manifest, or an invalid entry (names `where`,
                the entry and the field).
        """
        try:
            payload = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{where}: manifest is not valid JSON: {error}") from None
        payload = check_header(payload, where, FORMAT, VERSION, "manifest", ValueError)
        entries = payload.get("objects")
        if not isinstance(entries, list):
            raise ValueError(f"{where}: 'objects' must be a list, got {entries!r:.80}")
        objects = []
        for number, entry in enumerate(entries):
            label = f"{where}: objects[{number}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{label} must be an object, got {entry!r:.80}")
            key = check_key(entry.get("key"), label)
            size, digest, url = entry.get("size"), entry.get("sha256"), entry.get("url")
            if size is not None and (
                not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE
            ):
                raise ValueError(
                    f"{label} ({key}): size must be an integer in [0, {MAX_SIZE}], got {size!r:.80}"
                )
            if digest is not None and not _is_sha256(digest):
                raise ValueError(f"{label} ({key}): sha256 must be 64 hex digits, got {digest!r}")
            if url is not None and (not isinstance(url, str) or len(url) > MAX_URL):
                raise ValueError(
                    f"{label} ({key}): url must be a string of at most {MAX_URL} characters, "
                    f"got {url!r:.80}"
                )
            if url is None and (size is None or digest is None):
                raise ValueError(f"{label} ({key}): size and sha256 are required")
            mtime_ns = entry.get("mtime_ns")
            if mtime_ns is not None and (
                not isinstance(mtime_ns, int)
                or isinstance(mtime_ns, bool)
                or not 0 <= mtime_ns <= MAX_MTIME_NS
            ):
                raise ValueError(
                    f"{label} ({key}): mtime_ns must be an integer in [0, {MAX_MTIME_NS}], got "
                    f"{mtime_ns!r:.80}"
                )
            objects.append(ManifestObject(key, size, digest, url, mtime_ns))
        config = payload.get("config")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"{where}: 'config' must be an object or null, got {config!r:.80}")
        try:
            return cls(tuple(objects), config)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def _is_sha256(value: Any) -> bool:
    return (
        isinstance(value, str)
        and len(value) == 64
        and all(c in "0123456789abcdef" for c in value.lower())
    )


def base_location(manifest_location: str) -> str:
    """The directory (URL prefix or local directory) a manifest's keys are relative to."""
    return manifest_location.rsplit("/", 1)[0] if "/" in manifest_location else "."


def parse_shard_list(lines: Iterable[str], where: str) -> Manifest:
    """A manifest from ``URL [sha256]`` lines (nanochat-style shard lists).

    Keys are the URLs' file names.

    Raises:
        ValueError: a line is not an http(s) URL with an optional sha256, or two URLs share a
            file name.
    """
    objects = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        url = fields[0]
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc or len(fields) > 2:
            raise ValueError(f"{where}:{number}: expected 'URL [sha256]', got {line!r}")
        digest = fields[1].lower() if len(fields) == 2 else None
        if digest is not None and not _is_sha256(digest):
            raise ValueError(f"{where}:{number}: {fields[1]!r} is not a sha256 hex digest")
        name = posixpath.basename(urllib.parse.unquote(parsed.path))
        objects.append(ManifestObject(check_key(name, f"{where}:{number}"), None, digest, url))
    if not objects:
        raise ValueError(f"{where}: the shard list has no URLs")
    try:
        return Manifest(tuple(objects))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
