"""Token sources for ``convert`` and ``inspect``: any supported layout as a list of shards.

A shard is a read-only token array (memory-mapped) plus, when the format knows them, its document
lengths or BOS positions. Detection is by content, never by a size guess:

* ``PREFIX`` with ``PREFIX.idx`` beside it (or ``PREFIX.bin`` / ``PREFIX.idx`` given): Megatron;
* a file with a modded-nanogpt header: nanogpt (its ``.bos.idx`` is used when present);
* a ``.npy`` file: npy, or OLMo-core's headerless tokens when it lacks numpy's magic (dtype from
  ``--dtype`` or ``tokenmill.json``, as for raw files); any other file: raw tokens;
* a directory: its ``*.bin`` files (nanogpt or raw, not mixed) or else its ``*.npy`` files (numpy
  or OLMo-core's, not mixed).

``ignore_bos_index=True`` (``convert --bos-token``, which rebuilds the index from the tokens) does
not read a shard's ``.bos.idx``, so a broken or foreign one (NeMo's processor writes byte offsets)
can be repaired instead of refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.mapping import map_file
from tokenmill.errors import DataFormatError

__all__ = ["Shard", "Source", "document_lengths", "open_source"]


@dataclass
class Shard:
    """One token array of a source."""

    name: str
    path: str
    tokens: npt.NDArray[Any]
    document_lengths: npt.NDArray[np.int64] | None = None  # Megatron: from the index
    bos_positions: npt.NDArray[Any] | None = None  # nanogpt: from the .bos.idx
    bos_index_path: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Source:
    """A detected source: its format and shards."""

    path: str
    format: str
    shards: list[Shard]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.shards[0].tokens.dtype if self.shards else np.dtype(np.uint16)

    @property
    def token_count(self) -> int:
        return sum(int(shard.tokens.shape[0]) for shard in self.shards)


def _megatron(prefix: str) -> Source:
    from tokenmill.formats.megatron import DType, IndexedDataset

    dataset = IndexedDataset(prefix)
    # mapped without keeping a descriptor (an empty file gives an empty array)
    tokens: npt.NDArray[Any] = map_file(prefix + ".bin", dataset.dtype)
    lengths = dataset.sequence_lengths.astype(np.int64)
    bounds = np.asarray(dataset.document_indices, dtype=np.int64)
    cumulative = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=cumulative[1:])
    document_lengths = np.diff(cumulative[bounds])
    info = {
        "version": 1,
        "dtype_code": DType.code_from_dtype(dataset.dtype),
        "sequences": len(dataset),
    }
    shard = Shard(os.path.basename(prefix), prefix, tokens, document_lengths, info=info)
    return Source(prefix, "megatron", [shard])


def _nanogpt(path: str, ignore_bos_index: bool = False) -> Shard:
    from tokenmill.formats.bos_index import bos_index_path, read_bos_index
    from tokenmill.formats.nanogpt import NanogptShard

    shard = NanogptShard(path)
    sidecar = bos_index_path(path)
    positions = None
    info: dict[str, Any] = {
        "version": shard.header.version,
        "magic": shard.header.magic,
        "legacy": shard.header.legacy,
    }
    if ignore_bos_index and os.path.exists(sidecar):
        info["bos_index"] = {"path": sidecar, "ignored": True}
    elif os.path.exists(sidecar):
        index = read_bos_index(sidecar, len(shard))
        positions = index.positions
        _check_against_shard(sidecar, shard.tokens, positions, index.bos_token)
        info["bos_index"] = {"path": sidecar, "layout": "int64" if index.wide else "int32"}
        if index.bos_token is not None:
            info["bos_index"]["bos_token"] = index.bos_token
    stem = Path(path).stem
    return Shard(
        stem, path, shard.tokens, None, positions, sidecar if positions is not None else None, info
    )


def _check_against_shard(
    sidecar: str, tokens: npt.NDArray[Any], positions: npt.NDArray[Any], bos: int | None
) -> None:
    """The .bos.idx against its shard (`tokenmill.formats.validate`), when the BOS id is known:
    recorded in the int64 header, or the one token every listed position holds. An index whose
    positions hold several ids is left to ``inspect``'s checks, which report it."""
    if bos is None and positions.shape[0]:
        held = tokens[positions]
        if bool((held == held[0]).all()):
            bos = int(held[0])
    if bos is not None:
        from tokenmill.formats.validate import check_bos_index_consistency

        check_bos_index_consistency(sidecar, tokens, positions, bos)


def _array(
    path: str, dtype: npt.DTypeLike | None, ignore_bos_index: bool = False, check: bool = True
) -> Shard:
    from tokenmill.formats.bos_index import bos_index_path, read_bos_index
    from tokenmill.formats.token_dir import has_npy_magic, open_token_file

    if not check and path.endswith(".npy") and has_npy_magic(path):
        dtype = None  # the header says; `dtype` was meant for headerless files only
    tokens = open_token_file(path, dtype)
    shard = Shard(Path(path).stem, path, tokens)
    sidecar = bos_index_path(path)
    # written by `tokenmill convert --to npy` from a nanogpt source
    if os.path.exists(sidecar) and not ignore_bos_index:
        index = read_bos_index(sidecar, int(tokens.shape[0]))
        _check_against_shard(sidecar, tokens, index.positions, index.bos_token)
        shard.bos_positions = index.positions
        shard.bos_index_path = sidecar
    return shard


def open_source(
    path: str,
    dtype: npt.DTypeLike | None = None,
    *,
    ignore_bos_index: bool = False,
    check_header_dtype: bool = True,
) -> Source:
    """Detect the format of ``path`` and open it.

    Args:
        path: a Megatron prefix, a file or a directory (see the module docstring).
        dtype: the dtype of headerless files (raw, OLMo-core's); a ``.npy`` header must agree.
        ignore_bos_index: do not read ``.bos.idx`` sidecars.
        check_header_dtype: a ``.npy`` header must agree with ``dtype``; False applies ``dtype``
            to headerless files only (``convert --dtype``, which also names the output dtype).

    Raises:
        FileNotFoundError: nothing at ``path``.
        DataFormatError: a file is not valid for its format.
    """
    from tokenmill.formats.nanogpt import is_nanogpt_shard
    from tokenmill.formats.token_dir import has_npy_magic

    for suffix in (".idx", ".bin"):
        if path.endswith(suffix) and os.path.exists(path[: -len(suffix)] + ".idx"):
            return _megatron(path[: -len(suffix)])
    if os.path.exists(path + ".idx"):
        return _megatron(path)
    if os.path.isdir(path):
        bins = sorted(str(p) for p in Path(path).glob("*.bin") if p.is_file())
        if bins:
            kinds = {is_nanogpt_shard(p) for p in bins}
            if len(kinds) > 1:
                raise DataFormatError(f"{path}: mixes nanogpt shards and raw .bin files")
            if kinds == {True}:
                return Source(path, "nanogpt", [_nanogpt(p, ignore_bos_index) for p in bins])
            return Source(
                path, "raw", [_array(p, dtype, ignore_bos_index, check_header_dtype) for p in bins]
            )
        npys = sorted(str(p) for p in Path(path).glob("*.npy") if p.is_file())
        if npys:
            headers = {has_npy_magic(p) for p in npys}
            if len(headers) > 1:
                raise DataFormatError(
                    f"{path}: mixes .npy files with numpy's header and headerless ones "
                    "(OLMo-core's layout)"
                )
            kind = "npy" if headers == {True} else "olmo"
            return Source(
                path, kind, [_array(p, dtype, ignore_bos_index, check_header_dtype) for p in npys]
            )
        raise FileNotFoundError(f"{path}: no .bin, .npy or Megatron .idx files")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file, directory or Megatron prefix")
    if is_nanogpt_shard(path):
        return Source(path, "nanogpt", [_nanogpt(path, ignore_bos_index)])
    if path.endswith(".npy"):
        kind = "npy" if has_npy_magic(path) else "olmo"
        return Source(path, kind, [_array(path, dtype, ignore_bos_index, check_header_dtype)])
    return Source(path, "raw", [_array(path, dtype, ignore_bos_index, check_header_dtype)])


def document_lengths(
    shard: Shard, bos_token: int | None, eos_token: int | None
) -> tuple[npt.NDArray[np.int64] | None, str | None]:
    """The document lengths of a shard and where they come from.

    Megatron's index wins; then an explicit ``bos_token`` (a document starts at each BOS, tokens
    before the first BOS form a document of their own), then an explicit ``eos_token`` (a
    document ends after each EOS, a tail without one is a document), then the shard's
    ``.bos.idx``.
    """
    count = int(shard.tokens.shape[0])
    if shard.document_lengths is not None:
        return shard.document_lengths, "index"
    if eos_token is not None and bos_token is None:
        ends = _boundary_positions(shard, eos_token, "EOS") + 1
        if count and (ends.shape[0] == 0 or ends[-1] != count):
            ends = np.append(ends, count)
        return np.diff(np.concatenate([[0], ends])).astype(np.int64), "eos"
    if bos_token is not None or shard.bos_positions is not None:
        positions: npt.NDArray[Any] | None = shard.bos_positions
        if bos_token is not None:
            positions = _boundary_positions(shard, bos_token, "BOS")
        starts = np.asarray(positions, dtype=np.int64)
        if count and (starts.shape[0] == 0 or starts[0] != 0):
            starts = np.concatenate([[0], starts])
        return np.diff(np.append(starts, count)).astype(np.int64), "bos"
    return None, None


# Tokens scanned per step of a boundary scan: the positions found so far are checked against the
# memory available between steps, so a shard of mostly boundary tokens (a sparse file of zeros,
# with EOS 0) is refused after one step instead of allocating 8 bytes per token.
SCAN_STEP_TOKENS = 1 << 24

# Bytes a document costs from its position to the finished table: the positions and their
# concatenation (int64), the lengths (int64, then int32) and DocumentCorpus's shard and start
# columns (int32, int64).
DOCUMENT_TABLE_BYTES = 40


def _boundary_positions(shard: Shard, token: int, name: str) -> npt.NDArray[np.int64]:
    """Where `token` occurs in the shard's tokens (ascending), scanned in steps of
    SCAN_STEP_TOKENS with the document table they imply checked against the available memory
    before the next step.

    Raises:
        MemoryError: the documents found so far would not fit (names the shard and the token).
    """
    from tokenmill.common.budget import check_allocation
    from tokenmill.formats.token_scan import find_token_positions

    tokens = shard.tokens
    count = int(tokens.shape[0])
    if count <= SCAN_STEP_TOKENS:
        return find_token_positions(tokens, token)
    found: list[npt.NDArray[np.int64]] = []
    total = 0
    for start in range(0, count, SCAN_STEP_TOKENS):
        positions = find_token_positions(tokens[start : start + SCAN_STEP_TOKENS], token)
        if start:
            positions += start
        found.append(positions)
        total += int(positions.shape[0])
        check_allocation(
            total * DOCUMENT_TABLE_BYTES,
            f"{shard.path}: the document table of at least {total:,} documents ({name} token "
            f"{token} at {total:,} of the first {min(count, start + SCAN_STEP_TOKENS):,} of its "
            f"{count:,} tokens)",
        )
    return np.concatenate(found) if found else np.zeros(0, np.int64)
