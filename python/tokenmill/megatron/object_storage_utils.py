"""``megatron.core.datasets.object_storage_utils`` on tokenmill's object storage (`tokenmill.storage`).

Same names and signatures as megatron-core 0.19. Differences, all for correctness:

* `ObjectStorageConfig` is tokenmill's (megatron's two fields first; the chunk default is 4 MiB
  in an LRU of 256 MiB instead of one 256 MiB chunk, see `tokenmill.storage.object_storage`);
* `_s3_object_exists` asks ``head_object(Bucket=..., Key=...)`` and returns False for a missing
  object (megatron-core 0.19 passes lowercase keywords a real client rejects and answers True
  for a 404), so `dataset_exists` can say False;
* `parse_s3_path` raises ValueError naming the path where megatron-core asserts;
* ``msc://`` paths (NVIDIA's multi-storage client) raise NotImplementedError: tokenmill reads
  ``s3://`` (any S3-compatible service) only.

`cache_index_file` and `dataset_exists` use tokenmill's S3 client (retries, ``AWS_ENDPOINT_URL``)
rather than a bare ``boto3.client("s3")``; the helpers that take a `client` use the one given.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from tokenmill.common.distributed import get_rank
from tokenmill.storage.object_storage import (
    MSC_PREFIX,
    S3_PREFIX,
    ObjectStorageConfig,
    S3Config,
    require_s3,
)
from tokenmill.storage.object_storage import get_index_cache_path as _index_cache_path

__all__ = [
    "MSC_PREFIX",
    "S3_PREFIX",
    "ObjectStorageConfig",
    "S3Client",
    "S3Config",
    "cache_index_file",
    "dataset_exists",
    "get_index_cache_path",
    "get_object_storage_access",
    "is_object_storage_path",
    "parse_s3_path",
]


class S3Client(Protocol):
    """The boto3 client methods megatron's object-storage code calls."""

    def download_file(self, Bucket: str, Key: str, Filename: str) -> None:
        """Download the object to a local file."""
        ...

    def upload_file(self, Filename: str, Bucket: str, Key: str) -> None:
        """Upload a local file."""
        ...

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        """The object's metadata."""
        ...

    def get_object(self, Bucket: str, Key: str, Range: str) -> dict[str, Any]:
        """A byte range of the object."""
        ...

    def close(self) -> None:
        """Close the client."""
        ...


def _remove_s3_prefix(path: str) -> str:
    """`path` without its leading ``s3://``."""
    return path.removeprefix(S3_PREFIX)


def _is_s3_path(path: str) -> bool:
    """Whether `path` starts with ``s3://``."""
    return path.startswith(S3_PREFIX)


def _remove_msc_prefix(path: str) -> str:
    """`path` without its leading ``msc://``."""
    return path.removeprefix(MSC_PREFIX)


def _is_msc_path(path: str) -> bool:
    """Whether `path` starts with ``msc://``."""
    return path.startswith(MSC_PREFIX)


def _s3_download_file(client: S3Client, s3_path: str, local_path: str) -> None:
    """Download ``s3_path`` to ``local_path`` with `client` (creating the directory)."""
    directory = os.path.dirname(local_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    bucket, key = parse_s3_path(s3_path)
    client.download_file(bucket, key, local_path)


def _s3_object_exists(client: S3Client, path: str) -> bool:
    """Whether the object exists: True after a successful HEAD, False for a 404 (other errors
    propagate)."""
    bucket, key = parse_s3_path(path)
    try:
        client.head_object(Bucket=bucket, Key=key)
    except Exception as error:
        response = getattr(error, "response", None)
        code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
        if code in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def is_object_storage_path(path: str) -> bool:
    """Whether `path` is an ``s3://`` or ``msc://`` path."""
    return _is_s3_path(path) or _is_msc_path(path)


def get_index_cache_path(idx_path: str, object_storage_config: ObjectStorageConfig) -> str:
    """``<path_to_idx_cache>/<bucket>/<key>``: where the ``.idx`` of an object-storage dataset is
    cached locally (megatron-core's layout).

    Raises:
        ValueError: `idx_path` is not an object-storage path.
        NotImplementedError: it is an ``msc://`` path.
    """
    if not is_object_storage_path(idx_path):
        raise ValueError(f"not an object-storage path: {idx_path!r}")
    return _index_cache_path(idx_path, object_storage_config)


def parse_s3_path(path: str) -> tuple[str, str]:
    """(bucket, key) of an ``s3://bucket/key`` path (key "" for a bare bucket).

    Raises:
        ValueError: the path does not start with ``s3://``.
    """
    if not _is_s3_path(path):
        raise ValueError(f"not an s3:// path: {path!r}")
    bucket, _, key = _remove_s3_prefix(path).partition("/")
    return bucket, key


def get_object_storage_access(path: str) -> str:
    """The access kind: "s3" for ``s3://`` paths, else "msc" (megatron-core's rule)."""
    return "s3" if _is_s3_path(path) else "msc"


def dataset_exists(path_prefix: str, idx_path: str, bin_path: str) -> bool:
    """Whether both objects of an object-storage dataset exist (two HEAD requests).

    Raises:
        ValueError: `path_prefix` is not an object-storage path.
        NotImplementedError: it is an ``msc://`` path.
    """
    if not is_object_storage_path(path_prefix):
        raise ValueError(f"not an object-storage path: {path_prefix!r}")
    require_s3(path_prefix)
    from tokenmill.storage.s3 import get_client

    client = get_client()
    return client.exists(idx_path) and client.exists(bin_path)


def cache_index_file(remote_path: str, local_path: str) -> None:
    """Download `remote_path` to `local_path` on global rank 0 (every process without
    torch.distributed), with no barrier: as in megatron-core, the caller synchronises ranks.

    Raises:
        ValueError: `remote_path` is not an object-storage path.
        NotImplementedError: it is an ``msc://`` path.
        FileNotFoundError: the object does not exist, or (other ranks) was not downloaded yet.
    """
    if not is_object_storage_path(remote_path):
        raise ValueError(f"not an object-storage path: {remote_path!r}")
    require_s3(remote_path)
    if get_rank() == 0:
        from tokenmill.storage.s3 import get_client

        directory = os.path.dirname(local_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        get_client().download(remote_path, local_path)
    if not os.path.exists(local_path):
        raise FileNotFoundError(f"{local_path}: the index of {remote_path} was not downloaded")
