"""megatron-core's object-storage configuration, with tokenmill's chunk-cache settings added.

``ObjectStorageConfig(path_to_idx_cache, bin_chunk_nbytes)`` has megatron-core 0.19's fields and
meaning; a megatron-core ``ObjectStorageConfig`` (or its deprecated alias ``S3Config``) is
accepted wherever this one is (:meth:`ObjectStorageConfig.coerce`). The ``.idx`` of
``s3://bucket/key`` is cached at ``<path_to_idx_cache>/bucket/key.idx``, megatron-core's layout,
so the two share a cache directory.

Defaults differ from megatron-core on purpose: megatron-core keeps ONE 256 MiB chunk per reader
and replaces it on every miss, so random access downloads 256 MiB per sample; tokenmill keeps an
LRU of ``bin_cache_nbytes`` (256 MiB, the same memory) in 4 MiB chunks, so a random read costs
at most a few MiB and the hot part of the file stays cached. Passing megatron's config object
(256 MiB chunks) gives a one-chunk cache, i.e. megatron-core's behaviour.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenmill.storage.s3 import RetryPolicy, S3Url

__all__ = [
    "MSC_PREFIX",
    "S3_PREFIX",
    "ObjectStorageConfig",
    "S3Config",
    "get_index_cache_path",
    "is_object_storage_path",
    "local_cache_path",
]

S3_PREFIX = "s3://"
MSC_PREFIX = "msc://"


def is_object_storage_path(path: object) -> bool:
    """Whether ``path`` is an ``s3://`` or ``msc://`` string (megatron-core's test)."""
    return isinstance(path, str) and path.startswith((S3_PREFIX, MSC_PREFIX))


def require_s3(path: str) -> None:
    """Refuse ``msc://`` (NVIDIA multi-storage client) paths, which tokenmill does not read.

    Raises:
        NotImplementedError: the path is an ``msc://`` path.
    """
    if path.startswith(MSC_PREFIX):
        raise NotImplementedError(
            f"msc:// paths (NVIDIA multi-storage client) are not supported: {path}; use an "
            "s3:// URL (any S3-compatible service through AWS_ENDPOINT_URL)"
        )


@dataclass(frozen=True)
class ObjectStorageConfig:
    """Where the ``.idx`` cache lives and how the ``.bin`` is read from object storage.

    Args:
        path_to_idx_cache: local directory of downloaded ``.idx`` files and sidecars
            (megatron-core's field).
        bin_chunk_nbytes: the chunk size of ranged ``.bin`` reads (megatron-core's field;
            tokenmill's default is 4 MiB, megatron-core's 256 MiB).
        bin_cache_nbytes: the LRU budget per ``.bin``, in bytes (0: no cache, every read is one
            ranged GET of exactly its bytes).
        prefetch_threads: background threads per ``.bin`` fetching chunks the known sample order
            needs next (0: no prefetch).
        prefetch_samples: how many upcoming samples a GPTDataset announces to the prefetcher.
        retry: the retry policy; None reads ``TOKENMILL_S3_*`` from the environment.

    Raises:
        ValueError: a size is out of range.
    """

    path_to_idx_cache: str
    bin_chunk_nbytes: int = 4 << 20
    bin_cache_nbytes: int = 256 << 20
    prefetch_threads: int = 4
    prefetch_samples: int = 32
    retry: RetryPolicy | None = None

    def __post_init__(self) -> None:
        if not self.path_to_idx_cache:
            raise ValueError(
                f"ObjectStorageConfig.path_to_idx_cache must be a directory, got "
                f"{self.path_to_idx_cache!r}"
            )
        object.__setattr__(self, "path_to_idx_cache", os.fspath(self.path_to_idx_cache))
        if self.bin_chunk_nbytes <= 0:
            raise ValueError(
                f"ObjectStorageConfig.bin_chunk_nbytes must be > 0, got {self.bin_chunk_nbytes}"
            )
        for name in ("bin_cache_nbytes", "prefetch_threads", "prefetch_samples"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"ObjectStorageConfig.{name} must be >= 0, got {getattr(self, name)}"
                )

    @classmethod
    def coerce(cls, config: Any) -> ObjectStorageConfig:
        """This class from itself or from megatron-core's ``ObjectStorageConfig`` / ``S3Config``
        (its two fields; the cache then holds one chunk, as megatron-core does).

        Raises:
            TypeError: the object has no ``path_to_idx_cache``.
        """
        if isinstance(config, cls):
            return config
        path = getattr(config, "path_to_idx_cache", None)
        if path is None:
            raise TypeError(
                "object_storage_config must be an ObjectStorageConfig (with path_to_idx_cache), "
                f"got {config!r}"
            )
        chunk = int(getattr(config, "bin_chunk_nbytes", 256 << 20))
        return cls(
            path_to_idx_cache=os.fspath(path), bin_chunk_nbytes=chunk, bin_cache_nbytes=chunk
        )


S3Config = ObjectStorageConfig
"""megatron-core's deprecated alias."""


def local_cache_path(url: str, cache_root: str) -> str:
    """``<cache_root>/<bucket>/<key>``: where the local copy of an object lives.

    Raises:
        ValueError: the URL is not an object URL, or its key would escape the cache directory
            (``..`` components, an absolute key).
    """
    parsed = S3Url.parse(url).require_key()
    parts = parsed.key.split("/")
    if any(part in ("", ".", "..") for part in parts) or parsed.bucket in (".", ".."):
        raise ValueError(
            f"{url}: key has empty, '.' or '..' components; it cannot be mapped into the local "
            f"cache directory {cache_root}"
        )
    return os.path.join(cache_root, parsed.bucket, *parts)


def get_index_cache_path(idx_path: str, object_storage_config: Any) -> str:
    """megatron-core's name: the local cache path of an object-storage ``.idx``."""
    config = ObjectStorageConfig.coerce(object_storage_config)
    require_s3(idx_path)
    return local_cache_path(idx_path, config.path_to_idx_cache)
