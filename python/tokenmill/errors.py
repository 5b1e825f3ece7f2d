"""Exception types raised by tokenmill.

Every error names the file, field and value it is about. The types derive from the builtin
exception a caller would expect (ValueError for bad data, RuntimeError for cache problems), so
``except ValueError`` keeps working for code written against megatron-core.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of tokenmill's own exceptions."""


class DataFormatError(TokenmillError, ValueError):
    """A file on disk does not match its format (bad magic, version, size or contents)."""


class MegatronAssertionError(TokenmillError, ValueError, AssertionError):
    """A config or input megatron-core refuses with a failed ``assert``: an AssertionError, which
    megatron's callers (and Megatron-LM's own tests) catch, and a ValueError, tokenmill's type for
    bad input, with a message naming the field and value (megatron's bare assert names none)."""


class CacheError(TokenmillError, RuntimeError):
    """An index cache is unusable: truncated, foreign, or inconsistent with its description."""


class CacheMissingError(CacheError, FileNotFoundError):
    """A cache entry that a run is told to trust (fast_cache_load, defer_npy_index_mmap) does not
    exist: a FileNotFoundError, as megatron-core raises when it maps the missing file."""


class PerformanceWarning(UserWarning):
    """A setting that keeps results correct but is known to be slow (e.g. dense attention masks)."""


class TokenizerMismatchError(DataFormatError):
    """Datasets (or a dataset and a tokenizer) come from different tokenizers: their fingerprints
    (kind, file sha256, vocabulary size, special ids) differ, so their token ids mean different
    things and must not be mixed."""


class StaleCacheError(CacheError):
    """An index cache was built from data that has since changed: a `.bin`/`.idx` differs from the
    fingerprint recorded beside the cache entry (size, mtime or sampled contents), or is newer
    than an entry that has no fingerprint. See `tokenmill.index.fingerprint`."""


class ObjectStorageError(TokenmillError, OSError):
    """An object-storage request failed for good: a non-retryable error, or the retry budget
    was spent (the message names the object, the request, the attempts and the last error)."""


class ObjectChangedError(ObjectStorageError):
    """An object was replaced on the server while it was being read (its ETag changed)."""


class ChecksumError(DataFormatError):
    """A downloaded or uploaded object's bytes do not hash to the checksum its manifest records
    (the message names the object, the local file and both sha256 digests)."""


class ResourceLimitError(TokenmillError, OSError):
    """Opening, mapping or writing a file failed because the process or machine ran out of a
    resource (descriptors: EMFILE/ENFILE, memory maps or address space: ENOMEM, disk space:
    ENOSPC/EDQUOT), or the filesystem refused a map (EPERM). The file itself is fine; the message names the limit to raise (``ulimit -n``,
    ``vm.max_map_count``). Never taken for a corrupt file, never a reason to rebuild a cache."""


class SharedCacheDirectoryError(CacheError):
    """A cache directory is writable by every user of the machine (mode ``o+w``): another user
    could plant valid-looking index arrays in it that every rank would then serve. The message
    names the directory, its mode and owner, and the opt-in
    (``TOKENMILL_ALLOW_SHARED_CACHE_DIR=1``). See `tokenmill.common.cache_directory`."""
