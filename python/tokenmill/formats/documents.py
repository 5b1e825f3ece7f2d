"""Documents of any token source, for consumers that work document by document (packing).

`DocumentCorpus(path)` opens any layout tokenmill reads (see `tokenmill.formats.sources`:
Megatron prefixes, modded-nanogpt shards, `.npy` / raw directories) and exposes its documents
with the two members PackedDataset needs, as an IndexedDataset does: `sequence_lengths`
(int32, one per document, over all shards in order) and `get(document, offset, length)`
(a zero-copy view). Document boundaries come from the Megatron index, else from a BOS or EOS
token (the C++ token scan) or a `.bos.idx` sidecar; without any of them the corpus has no
documents and construction fails with a clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.formats.sources import document_lengths, open_source

__all__ = ["DocumentCorpus"]

_INT32_MAX = np.iinfo(np.int32).max


class DocumentCorpus:
    """The documents of a token source.

    Args:
        path: a Megatron prefix, a nanogpt shard, a `.npy`/raw file, or a directory of them.
        bos_token: documents start at this token (nanogpt data).
        eos_token: documents end after this token (KempnerForge-style `.npy` data).
        dtype: dtype of raw headerless `.bin` files without a metadata sidecar.

    Raises:
        FileNotFoundError, DataFormatError: as `open_source`.
        ValueError: the source has no document boundaries (give bos_token or eos_token), or a
            document longer than 2^31 - 1 tokens.
    """

    def __init__(
        self,
        path: str,
        *,
        bos_token: int | None = None,
        eos_token: int | None = None,
        dtype: npt.DTypeLike | None = None,
    ) -> None:
        self.path_prefix = path
        self.source = open_source(path, dtype)
        lengths, shards, starts = [], [], []
        for number, shard in enumerate(self.source.shards):
            shard_lengths, _ = document_lengths(shard, bos_token, eos_token)
            if shard_lengths is None:
                raise ValueError(
                    f"{shard.path}: no document boundaries (no index or .bos.idx): pass "
                    "bos_token or eos_token"
                )
            if shard_lengths.size and int(shard_lengths.max()) > _INT32_MAX:
                raise ValueError(f"{shard.path}: a document exceeds 2^31 - 1 tokens")
            lengths.append(shard_lengths)
            shards.append(np.full(shard_lengths.shape[0], number, dtype=np.int32))
            offsets = np.zeros(shard_lengths.shape[0], dtype=np.int64)
            np.cumsum(shard_lengths[:-1], out=offsets[1:])
            starts.append(offsets)
        self.sequence_lengths: npt.NDArray[np.int32] = (
            np.concatenate(lengths).astype(np.int32) if lengths else np.zeros(0, np.int32)
        )
        self._shard = np.concatenate(shards) if shards else np.zeros(0, np.int32)
        self._start = np.concatenate(starts) if starts else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> npt.NDArray[Any]:
        """Tokens [offset, offset + length) of document `idx` (a view of the mapped shard)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"document {idx} is out of range for {len(self)} documents")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) are outside document {idx} of {size} tokens"
            )
        tokens = self.source.shards[int(self._shard[idx])].tokens
        start = int(self._start[idx]) + offset
        return tokens[start : start + length]

    def __getitem__(self, idx: int) -> npt.NDArray[Any]:
        return self.get(idx)
