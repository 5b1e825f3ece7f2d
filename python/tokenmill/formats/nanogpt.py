"""modded-nanogpt token shards (``.bin`` with a 256 x int32 header), as written by modded-nanogpt's
``data/fineweb.py`` and NeMo Automodel's ``tools/nanogpt_data_processor.py``.

Layout (little-endian; the byte-level spec with a worked example is ``formats/README.md``):

* bytes ``[0, 1024)``: 256 int32. ``header[0]`` is the magic, ``header[1]`` the version (1),
  ``header[2]`` the token count N, and with the new magic ``header[3]`` the bytes per token;
  the rest is zero.
* magic 20240520 (legacy, modded-nanogpt): tokens are uint16 and ``header[3]`` is ignored;
  magic 278895051 (NeMo's processor): ``header[3]`` is 2 (uint16) or 4 (uint32).
* bytes ``[1024, 1024 + N * itemsize)``: the tokens, nothing after them.

A sidecar ``<name>.bos.idx`` may list the BOS positions (``formats/bos_index.py``).

Shard size: modded-nanogpt's loader reads the whole payload with one unbuffered ``readinto``, and
one ``read`` on Linux returns at most 2,147,479,552 bytes (``MAX_RW_COUNT``, 2**31 - 4096), so a
larger shard fails there with "number of tokens read does not match header". Writers therefore
never put more than :data:`MAX_PAYLOAD_BYTES` of tokens in one shard (a file below 2**31 - 1
bytes; :func:`max_shard_tokens`), and the tools that split data into shards (``convert``,
``tokenize --format nanogpt``) default to :data:`DEFAULT_SHARD_TOKENS`, fineweb's 10**8.

Checks on open (each failure raises :class:`~tokenmill.errors.DataFormatError` naming the file and
the value): the file holds a whole header, the magic and version are known, the token count is
non-negative, the new magic's ``header[3]`` is 2 or 4, and the file is exactly
``1024 + N * itemsize`` bytes (modded-nanogpt only checks that it can read N tokens, so trailing
bytes are tolerated there and refused here: they mean the header and the data disagree).

Cost: opening reads 1 KiB and maps the file (O(1)); ``tokens`` is a zero-copy read-only view. The
writer streams tokens to a temporary file (constant memory), patches the count into the header
and renames the file into place; with ``bos_token`` it also writes the ``.bos.idx`` sidecar, after
the ``.bin`` (data first, index last); it keeps the BOS positions in memory until then
(8 bytes per document).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import AtomicFile, AtomicWriter
from tokenmill.common.mapping import map_readonly
from tokenmill.errors import DataFormatError

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "HEADER_BYTES",
    "HEADER_INTS",
    "LEGACY_MAGIC",
    "MAGIC",
    "MAX_PAYLOAD_BYTES",
    "MAX_TOKENS",
    "VERSION",
    "NanogptHeader",
    "NanogptShard",
    "NanogptShardWriter",
    "is_nanogpt_shard",
    "max_shard_tokens",
    "parse_nanogpt_header",
    "read_nanogpt_header",
    "shard_token_cap",
    "write_nanogpt_shard",
]

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LEGACY_MAGIC = 20240520
"""modded-nanogpt's magic: uint16 tokens."""
MAGIC = 278895051
"""NeMo Automodel's magic: ``header[3]`` gives the bytes per token."""
VERSION = 1
MAX_TOKENS = 2**31 - 1
"""The token count is an int32 header field."""
MAX_PAYLOAD_BYTES = 2**31 - 4096
"""The most token bytes one shard holds: the most one ``read`` returns on Linux (``MAX_RW_COUNT``),
so modded-nanogpt's single unbuffered ``readinto`` of the payload reads all of it. The whole file
(header included) stays below 2**31 - 1 bytes."""
DEFAULT_SHARD_TOKENS = 10**8
"""Tokens per shard when a tool splits data into shards: fineweb's shards (modded-nanogpt)."""

_ITEMSIZE_DTYPES: dict[int, np.dtype[Any]] = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


@dataclass(frozen=True)
class NanogptHeader:
    """The parsed header of a shard."""

    path: str
    magic: int
    version: int
    token_count: int
    dtype: np.dtype[Any]

    @property
    def legacy(self) -> bool:
        """True for modded-nanogpt's magic 20240520."""
        return self.magic == LEGACY_MAGIC

    @property
    def file_size(self) -> int:
        """The exact size the file must have."""
        return HEADER_BYTES + self.token_count * self.dtype.itemsize


def _header_ints(path: str, raw: bytes) -> npt.NDArray[np.int32]:
    if len(raw) < HEADER_BYTES:
        raise DataFormatError(
            f"{path}: file is {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte nanogpt header"
        )
    return np.frombuffer(raw, dtype="<i4", count=HEADER_INTS).astype(np.int32)


def is_nanogpt_shard(path: str | os.PathLike[str]) -> bool:
    """Whether a file starts with a nanogpt magic (either one) and holds a whole header.

    Used to refuse reading such a file as headerless raw tokens; the rest of the header is not
    checked here (:func:`read_nanogpt_header` does that).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as stream:
            raw = stream.read(HEADER_BYTES)
    except IsADirectoryError:
        return False
    if len(raw) < HEADER_BYTES:
        return False
    return int(np.frombuffer(raw, dtype="<i4", count=1)[0]) in (LEGACY_MAGIC, MAGIC)


def read_nanogpt_header(path: str | os.PathLike[str]) -> NanogptHeader:
    """Read and check the header of a shard against the file size.

    Args:
        path: the ``.bin`` shard.

    Returns:
        The header.

    Raises:
        FileNotFoundError: no such file.
        DataFormatError: the header is unknown or disagrees with the file size.
    """
    path = os.fspath(path)
    with open(path, "rb") as stream:
        raw = stream.read(HEADER_BYTES)
        size = os.fstat(stream.fileno()).st_size
    return _parse_header(path, raw, size)


def parse_nanogpt_header(path: str, raw: bytes, size: int) -> NanogptHeader:
    """Check the first ``HEADER_BYTES`` of a shard (``raw``) against its size in bytes.

    For shards that are not local files (an ``s3://`` object: one ranged read of the header and
    a HEAD for the size). Raises what :func:`read_nanogpt_header` raises.
    """
    return _parse_header(path, raw, size)


def _parse_header(path: str, raw: bytes, size: int) -> NanogptHeader:
    header = _header_ints(path, raw)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in (LEGACY_MAGIC, MAGIC):
        raise DataFormatError(
            f"{path}: header[0] (magic) is {magic}, expected {LEGACY_MAGIC} (modded-nanogpt) or "
            f"{MAGIC} (NeMo nanogpt_data_processor); not a nanogpt shard"
        )
    if version != VERSION:
        raise DataFormatError(f"{path}: header[1] (version) is {version}, expected {VERSION}")
    if count < 0:
        raise DataFormatError(f"{path}: header[2] (token count) is {count}, must be >= 0")
    if magic == LEGACY_MAGIC:
        dtype = _ITEMSIZE_DTYPES[2]
    else:
        itemsize = int(header[3])
        if itemsize not in _ITEMSIZE_DTYPES:
            raise DataFormatError(
                f"{path}: header[3] (bytes per token) is {itemsize}, expected 2 (uint16) or 4 "
                "(uint32)"
            )
        dtype = _ITEMSIZE_DTYPES[itemsize]
    parsed = NanogptHeader(path, magic, version, count, dtype)
    if size != parsed.file_size:
        kind = "truncated" if size < parsed.file_size else "longer than its header says"
        raise DataFormatError(
            f"{path}: file is {size} bytes but its header says {count} {dtype.name} tokens, "
            f"i.e. {parsed.file_size} bytes ({HEADER_BYTES}-byte header + tokens); the file is "
            f"{kind}"
        )
    return parsed


class NanogptShard:
    """A shard mapped read-only: ``shard.tokens`` is a zero-copy numpy view of its tokens.

    Picklable: a copy re-maps the file.

    Args:
        path: the ``.bin`` shard.

    Raises:
        FileNotFoundError: no such file.
        DataFormatError: the header is unknown or disagrees with the file size.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            raw = stream.read(HEADER_BYTES)
            self.header = _parse_header(self.path, raw, size)
            if self.header.token_count:
                # keeps no descriptor (the file is closed on leaving this block)
                mapping = map_readonly(stream.fileno(), size, self.path)
                self.tokens: npt.NDArray[Any] = np.frombuffer(
                    mapping,
                    dtype=self.header.dtype,
                    count=self.header.token_count,
                    offset=HEADER_BYTES,
                )
            else:
                self.tokens = np.empty(0, dtype=self.header.dtype)
                self.tokens.flags.writeable = False

    @property
    def dtype(self) -> np.dtype[Any]:
        """uint16 or uint32."""
        return self.header.dtype

    def __len__(self) -> int:
        return self.header.token_count

    def __getstate__(self) -> str:
        return self.path

    def __setstate__(self, state: str) -> None:
        self.__init__(state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"NanogptShard({self.path!r}, tokens={len(self)}, dtype={self.dtype.name})"


def max_shard_tokens(dtype: npt.DTypeLike) -> int:
    """The most tokens of ``dtype`` one shard may hold (:data:`MAX_PAYLOAD_BYTES` of them):
    1,073,739,776 uint16 or 536,869,888 uint32 tokens."""
    return MAX_PAYLOAD_BYTES // np.dtype(dtype).itemsize


def shard_token_cap(dtype: npt.DTypeLike, shard_tokens: int | None = None) -> int:
    """Tokens per shard for a tool that splits data: ``shard_tokens`` (default
    :data:`DEFAULT_SHARD_TOKENS`), checked against :func:`max_shard_tokens`.

    Raises:
        ValueError: ``shard_tokens`` is below 1 or above what the loaders can read.
    """
    cap = DEFAULT_SHARD_TOKENS if shard_tokens is None else int(shard_tokens)
    largest = max_shard_tokens(dtype)
    if not 1 <= cap <= largest:
        raise ValueError(
            f"tokens per nanogpt shard must be in [1, {largest}] for {np.dtype(dtype).name} "
            f"(modded-nanogpt reads a shard's tokens with one read of at most "
            f"{MAX_PAYLOAD_BYTES} bytes), got {cap}"
        )
    return cap


def _check_fits(path: str, array: npt.NDArray[Any], dtype: np.dtype[Any]) -> None:
    if array.dtype.kind not in "iu":
        raise TypeError(f"{path}: tokens must be integers, got {array.dtype}")
    if array.shape[0] == 0 or np.can_cast(array.dtype, dtype, casting="safe"):
        return
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise OverflowError(f"{path}: token {bad} does not fit {dtype.name} [0, {info.max}]")


class NanogptShardWriter(AtomicWriter):
    """Streams tokens into a shard; the file appears only when :meth:`finalize` succeeds.

    Use as a context manager (``finalize`` on success, nothing left behind on an exception).

    Args:
        path: the ``.bin`` to write.
        dtype: ``uint16`` or ``uint32``.
        legacy: write modded-nanogpt's magic (uint16 only) instead of NeMo's. None picks the
            legacy magic for uint16, which both modded-nanogpt and NeMo read, and NeMo's for uint32.
        bos_token: also write ``<name>.bos.idx`` with the positions of this token (int32, NeMo's
            layout, or tokenmill's int64 variant when a position exceeds 2**31 - 1).

    Raises:
        ValueError: an unsupported dtype, or ``legacy=True`` with uint32.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dtype: npt.DTypeLike = np.uint16,
        *,
        legacy: bool | None = None,
        bos_token: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise ValueError(
                f"{self.path}: nanogpt shards hold uint16 or uint32 tokens, got {self.dtype}"
            )
        if legacy is None:
            legacy = self.dtype == np.dtype(np.uint16)
        if legacy and self.dtype != np.dtype(np.uint16):
            raise ValueError(f"{self.path}: the legacy magic {LEGACY_MAGIC} means uint16 tokens")
        self.magic = LEGACY_MAGIC if legacy else MAGIC
        self.max_tokens = max_shard_tokens(self.dtype)
        self.bos_token = bos_token
        self.token_count = 0
        self._file = AtomicFile(self.path)
        self._file.stream.write(bytes(HEADER_BYTES))  # patched by finalize
        self._bos: list[npt.NDArray[np.int64]] = []

    def write(self, tokens: npt.ArrayLike) -> None:
        """Append tokens.

        Raises:
            OverflowError: a token does not fit the dtype, or the shard would exceed
                :func:`max_shard_tokens` (more than modded-nanogpt's loader reads in one call).
            TypeError: the tokens are not integers.
        """
        array = np.asarray(tokens).reshape(-1)
        if array.shape[0] == 0:
            return
        _check_fits(self.path, array, self.dtype)
        if self.token_count + array.shape[0] > self.max_tokens:
            raise OverflowError(
                f"{self.path}: a nanogpt shard holds at most {self.max_tokens} {self.dtype.name} "
                f"tokens ({MAX_PAYLOAD_BYTES} bytes, the most modded-nanogpt's loader reads in "
                "its one read of the payload); split the data into several shards"
            )
        if self.bos_token is not None:
            from tokenmill.formats.token_scan import find_token_positions

            positions = find_token_positions(array, self.bos_token) + self.token_count
            self._bos.append(positions)
        data = np.ascontiguousarray(array, dtype=self.dtype.newbyteorder("<"))
        self._file.stream.write(data.data.cast("B"))
        self.token_count += array.shape[0]

    def finalize(self) -> None:
        """Patch the header, rename the shard into place, then write the ``.bos.idx``."""
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[0] = self.magic
        header[1] = VERSION
        header[2] = self.token_count
        header[3] = self.dtype.itemsize
        self._file.stream.seek(0)
        self._file.stream.write(header.tobytes())
        self._file.commit()
        if self.bos_token is not None:
            from tokenmill.formats.bos_index import bos_index_path, write_bos_index

            positions = np.concatenate(self._bos) if self._bos else np.zeros(0, np.int64)
            write_bos_index(
                bos_index_path(self.path),
                positions,
                token_count=self.token_count,
                bos_token=self.bos_token,
            )


def write_nanogpt_shard(
    path: str | os.PathLike[str],
    tokens: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    *,
    legacy: bool | None = None,
    bos_token: int | None = None,
) -> None:
    """Write a whole shard at once (see :class:`NanogptShardWriter`).

    Args:
        path: the ``.bin`` to write.
        tokens: the tokens.
        dtype: uint16 or uint32; None picks uint16 when every token fits, else uint32.
        legacy: see :class:`NanogptShardWriter`.
        bos_token: see :class:`NanogptShardWriter`.
    """
    array = np.asarray(tokens).reshape(-1)
    if dtype is None:
        fits16 = array.shape[0] == 0 or (array.dtype.kind in "iu" and int(array.max()) < 2**16)
        dtype = np.uint16 if fits16 else np.uint32
    with NanogptShardWriter(path, dtype, legacy=legacy, bos_token=bos_token) as writer:
        writer.write(array)
