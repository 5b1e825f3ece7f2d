"""Outputs to ``s3://``: written locally first (by the ordinary, atomic writers), then uploaded.

A producer that writes ``<prefix>.bin`` / ``.idx`` / sidecars (``tokenize``) or a directory of
shards (``convert``) writes them into a *staging* path, ``<staging root>/<bucket>/<key>``, and
:func:`upload_prefix` / :func:`upload_directory` put them in the bucket. The staging root is
``$TOKENMILL_STAGING_DIR``, else ``<system temp dir>/tokenmill-staging``; the path depends only on
the URL, so re-running a killed job finds its staged work again (``tokenize`` resumes its parts).

Atomicity: every PUT is atomic (an object is visible whole or not at all), and files go up data
first, index next and the tokenizer sidecar last, so a reader that sees an index finds its data,
and the sidecar marks a complete dataset. The staged files are removed after a successful upload.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tokenmill.storage.object_storage import local_cache_path
from tokenmill.storage.s3 import ObjectInfo, S3Client, S3Url, get_client

__all__ = [
    "fetch_source",
    "remove_staged_prefix",
    "staged_path",
    "staging_root",
    "upload_directory",
    "upload_prefix",
]


def staging_root() -> str:
    """``$TOKENMILL_STAGING_DIR`` or ``<system temp dir>/tokenmill-staging``."""
    return os.environ.get("TOKENMILL_STAGING_DIR") or os.path.join(
        tempfile.gettempdir(), "tokenmill-staging"
    )


def staged_path(url: str, root: str | None = None) -> str:
    """The local path where the output for ``url`` is staged (its parent directory is created).

    Raises:
        ValueError: the URL does not name an object, or its key cannot be mapped to a path.
    """
    path = local_cache_path(url, root if root is not None else staging_root())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _upload_rank(name: str) -> tuple[int, str]:
    # data first, then indices, then the sidecar that marks a finished dataset
    if name.endswith(".tokenmill.json"):
        return 2, name
    if name.endswith((".idx", ".json")):
        return 1, name
    return 0, name


def upload_prefix(
    local_prefix: str, url_prefix: str, client: S3Client | None = None
) -> list[ObjectInfo]:
    """Upload every file ``<local_prefix><suffix>`` to ``<url_prefix><suffix>``.

    Directories (e.g. ``<prefix>.parts``) are not uploaded.

    Returns:
        The uploaded objects, in upload order.

    Raises:
        FileNotFoundError: no file starts with ``local_prefix``.
        ObjectStorageError: an upload failed after its retries.
    """
    client = client if client is not None else get_client()
    S3Url.parse(url_prefix).require_key()
    directory, name = os.path.split(os.path.abspath(local_prefix))
    suffixes = sorted(
        (entry[len(name) :] for entry in os.listdir(directory) if entry.startswith(name)),
        key=_upload_rank,
    )
    files = [s for s in suffixes if os.path.isfile(os.path.join(directory, name + s))]
    if not files:
        raise FileNotFoundError(f"nothing to upload: no file starts with {local_prefix}")
    return [
        client.upload(os.path.join(directory, name + suffix), url_prefix + suffix)
        for suffix in files
    ]


def upload_directory(
    local_directory: str, url_prefix: str, client: S3Client | None = None
) -> list[ObjectInfo]:
    """Upload every file under ``local_directory`` to ``<url_prefix>/<relative path>``.

    Returns:
        The uploaded objects, in upload order (data files first, indices after).
    """
    client = client if client is not None else get_client()
    base = S3Url.parse(url_prefix)
    relative: list[str] = []
    for root, _, names in os.walk(local_directory):
        for name in names:
            relative.append(os.path.relpath(os.path.join(root, name), local_directory))
    relative.sort(key=lambda path: (_upload_rank(os.path.basename(path))[0], path))
    return [
        client.upload(os.path.join(local_directory, path), base.join(path.replace(os.sep, "/")))
        for path in relative
    ]


def remove_staged_prefix(local_prefix: str) -> None:
    """Delete the staged files (and directories such as ``.parts``) of ``local_prefix``."""
    directory, name = os.path.split(os.path.abspath(local_prefix))
    if not os.path.isdir(directory):
        return
    for entry in os.listdir(directory):
        if entry.startswith(name):
            path = os.path.join(directory, entry)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def fetch_source(url: str, client: S3Client | None = None, root: str | None = None) -> str:
    """Download the objects an input URL stands for and return its local equivalent.

    ``s3://bucket/data/corpus`` stands for every object ``data/corpus``, ``data/corpus.*`` (a
    Megatron prefix with its ``.bin``/``.idx``/sidecars, or a single file) and ``data/corpus/*``
    (a directory of shards). Each is fetched through the local object cache under
    ``<staging root>/sources`` (once per object version), so the returned path works with every
    local reader.

    Raises:
        FileNotFoundError: no object matches.
        ObjectStorageError: a download failed after its retries.
    """
    from tokenmill.storage.local_cache import cache_object

    client = client if client is not None else get_client()
    parsed = S3Url.parse(url)
    key = parsed.key.rstrip("/")
    if not key:
        raise ValueError(f"{url}: name a prefix or object inside the bucket, not the bucket")
    root = root if root is not None else os.path.join(staging_root(), "sources")
    matches = [
        info.url
        for info in client.list_objects(S3Url(parsed.bucket, key))
        if (found := S3Url.parse(info.url).key) == key or found.startswith((key + ".", key + "/"))
    ]
    if not matches:
        raise FileNotFoundError(f"no object matches {url} (as a file, prefix or directory)")
    for match in matches:
        cache_object(match, root, client)
    return os.path.join(root, parsed.bucket, *key.split("/"))
