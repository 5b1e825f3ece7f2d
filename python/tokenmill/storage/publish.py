"""Publish dataset prefixes, index caches and files to a bucket or a directory, with a manifest.

Every file of the given dataset prefixes (`.bin`, `.idx`, `.tokenmill.json`), directories (an
index cache) or single files is uploaded under `destination` (an `s3://bucket/prefix` or a local
directory), then `manifest.json` listing every object's key, size and sha256 and the config they
serve is written last (the commit point: a reader never sees a manifest whose objects are not
all there). Objects already present with the same size and sha256 (stored as the object's
`sha256` metadata) are skipped, so an interrupted publish resumes where it stopped; files above
`part_bytes` go multipart with a Content-MD5 per part, and a multipart upload interrupted
half-way resumes too: parts the server already holds with the same size and MD5 ETag are kept,
the rest are sent. See `tokenmill.storage.transfer` for the shared policy and locations.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.errors import ObjectStorageError
from tokenmill.storage.download import _safe_destination
from tokenmill.storage.manifest import (
    Manifest,
    ManifestObject,
    check_key,
)
from tokenmill.storage.transfer import (
    MANIFEST_NAME,
    READ_BYTES,
    TransferPolicy,
    is_http_location,
    is_s3_location,
    join_location,
    s3_client,
    sha256_file,
)

__all__ = ["PublishReport", "collect_files", "publish"]

_DATASET_SUFFIXES = (".bin", ".idx", ".tokenmill.json")
_S3_MIN_PART_BYTES = 5 << 20


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
            for file in _directory_files(root):
                relative = file.relative_to(root)
                if not any(part.startswith(".") for part in relative.parts):
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


def _directory_files(root: Path) -> list[Path]:
    """The regular files below `root`, sorted, without following a symlink out of it: a linked
    directory is not entered (os.walk), a link to a file inside `root` is published as that
    file, a link that leaves `root` is refused (it would upload what the caller did not name).

    Raises:
        ValueError: a symlink below `root` points outside it.
    """
    real_root = os.path.realpath(root)
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        for name in [*names, *subdirectories]:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                continue
            target = os.path.realpath(path)
            if target != real_root and not target.startswith(real_root.rstrip(os.sep) + os.sep):
                raise ValueError(
                    f"refusing to publish {path}: it is a symlink to {target}, outside the "
                    f"published directory {root}"
                )
        files.extend(
            Path(directory, name) for name in names if os.path.isfile(os.path.join(directory, name))
        )
    return sorted(files)


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
            shutil.copyfileobj(stream, output.stream, READ_BYTES)
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
    if is_http_location(destination):
        raise ValueError(f"cannot publish to {destination}: use an s3:// URL or a local directory")
    if is_s3_location(destination) and policy.part_bytes < _S3_MIN_PART_BYTES:
        raise ValueError(
            f"part size {policy.part_bytes} bytes is below S3's multipart minimum of 5 MiB"
        )
    started = time.perf_counter()
    files = collect_files(paths)
    objects: dict[str, ManifestObject] = {}
    report = PublishReport(Manifest(()), join_location(destination, MANIFEST_NAME))
    lock = threading.Lock()
    client = s3_client() if is_s3_location(destination) else None

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
                _safe_destination(destination, target, key)  # no planted symlink is followed
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
