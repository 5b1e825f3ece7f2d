"""PackedDataset: rows of whole documents with document masks, almost no padding.

Each row holds `sequence_length` tokens made of whole documents (long documents are cut into
windows, with an optional overlap whose repeated prefix is masked from the loss). A C++ planner
decides once which pieces fill which row (best-fit decreasing over a bounded window of the
shuffled documents; see csrc/packing.hpp); the plan is cached and shared across ranks like the
GPT index arrays (atomic writes, a lock, the cache-building rank first, then a barrier).

On a lognormal length distribution with mean ~1000 tokens and a heavy tail, at
sequence_length 2048, padding is below 0.1 % of the row tokens and nothing is dropped
(nanochat's BOS best-fit drops ~35 %); `bos_aligned=True` fills every row to the last token,
starts every row at a BOS, and reuses the remainder of a cropped document (behind one inserted
BOS token) instead of discarding it. See benchmarks/PACKING.md.

A row is a dict of tensors with static shapes:

* `input_ids` int64 [S]: the tokens, padding with `pad_token_id` at the end of the row;
* `labels` int64 [S]: the next token of the same document, or `label_ignore_index` (-100) at a
  document's last token, on a window's repeated prefix, on an inserted BOS and on padding:
  labels never cross a document boundary;
* `position_ids` int64 [S]: restarting at 0 for every piece (or 0..S-1 without resets);
* `doc_ids` int32 [S]: the piece each token belongs to, 0, 1, ...; padding belongs to the last
  piece (as megatron-core folds padding into the last document of cu_seqlens);
* `cu_seqlens` int32 [max_documents_per_row + 1]: piece boundaries, padded with S, for
  FlashAttention varlen; `document_block_mask` turns doc_ids into a FlexAttention mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common import distributed
from tokenmill.common.core_call import core_call
from tokenmill.common.threads import default_build_threads
from tokenmill.errors import DataFormatError
from tokenmill.formats.megatron import shrunk_file_error
from tokenmill.index.cache import ArraySpec, EntrySpec, IndexCache
from tokenmill.index.cache_checks import packing_checks
from tokenmill.index.packing import INSERTED_BOS, plan_packing
from tokenmill.serving.buffers import allocate
from tokenmill.serving.layout import BatchLayout, Field, PlainLayout
from tokenmill.serving.server import BatchServer

if TYPE_CHECKING:
    import torch

__all__ = ["PackedDataset", "PackingConfig", "document_block_mask"]

logger = logging.getLogger(__name__)

_PLAN_VERSION = 1
_ARRAY_NAMES = ("entries", "row_offsets", "row_order")
_ROW_SEED_SALT = 0x9E3779B9
_UNSET: Any = object()


@dataclass(frozen=True)
class PackingConfig:
    """How documents are packed into rows. Checked on construction (ValueError names the field).

    Args:
        sequence_length: tokens per row.
        seed: seeds the document order and the row order.
        bos_aligned: fill every row completely and start it at a BOS token (needs
            `bos_token_id`; documents must begin with BOS, as nanochat / modded-nanogpt data do).
        bos_token_id: the BOS id (bos_aligned mode).
        max_documents_per_row: most pieces in one row (the length of cu_seqlens minus one).
        window_overlap: tokens consecutive windows of a long document share (at most
            sequence_length / 2); the repeated prefix is masked from the loss.
        path_to_cache: directory of the cached plan (None: plan in memory on every rank).
        shuffle_documents: plan documents in a seeded random order (else in storage order).
        shuffle_rows: serve rows in a seeded random order.
        reset_position_ids: restart position ids at every piece.
        pad_token_id: the input id of padding tokens.
        label_ignore_index: the label of positions without a target.
        planning_window: pieces the best-fit planner sorts at a time (larger: less padding,
            more memory while planning).
        num_threads: planner threads (None: up to 4); the plan never depends on it.
    """

    sequence_length: int
    seed: int = 1234
    bos_aligned: bool = False
    bos_token_id: int | None = None
    max_documents_per_row: int = 64
    window_overlap: int = 0
    path_to_cache: str | None = None
    shuffle_documents: bool = True
    shuffle_rows: bool = True
    reset_position_ids: bool = True
    pad_token_id: int = 0
    label_ignore_index: int = -100
    planning_window: int = 2048
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.sequence_length < 2:
            raise ValueError(f"sequence_length must be >= 2, got {self.sequence_length}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.bos_aligned and self.bos_token_id is None:
            raise ValueError("bos_aligned=True needs bos_token_id")
        if self.max_documents_per_row < 1:
            raise ValueError(
                f"max_documents_per_row must be >= 1, got {self.max_documents_per_row}"
            )
        if not 0 <= 2 * self.window_overlap <= self.sequence_length:
            raise ValueError(
                f"window_overlap must be in [0, sequence_length / 2 = "
                f"{self.sequence_length // 2}], got {self.window_overlap}"
            )
        if self.bos_aligned and self.window_overlap:
            raise ValueError(
                "window_overlap must be 0 with bos_aligned=True (long documents are cropped and "
                f"continued behind a BOS instead), got {self.window_overlap}"
            )
        if self.planning_window < 1:
            raise ValueError(f"planning_window must be >= 1, got {self.planning_window}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def plan_identity(self) -> dict[str, Any]:
        """The fields that change the plan (the cache key), in a stable order."""
        fields = asdict(self)
        for name in ("path_to_cache", "num_threads", "reset_position_ids", "pad_token_id"):
            fields.pop(name)
        fields.pop("label_ignore_index")
        return fields


def _seeded_permutation(count: int, seed: int) -> npt.NDArray[np.int64]:
    order = np.arange(count, dtype=np.int64)
    core_call(_core.shuffle_like_numpy, order, seed)
    return order


class PackedDataset:
    """Rows of packed documents over any indexed source.

    Args:
        indexed_dataset: the documents: anything with `sequence_lengths` (one entry per
            document) and `get(idx, offset, length)`, such as `tokenmill.IndexedDataset`.
        config: the PackingConfig.
        dataset_path: identifies the data in the cache key (default: the source's
            `path_prefix`).
        indices: the document ids to pack (default: all).

    Under torch.distributed every rank must construct the dataset (there is a barrier): the
    cache-building rank plans and writes, the others map the cached plan.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        config: PackingConfig,
        *,
        dataset_path: str | None = None,
        indices: npt.ArrayLike | None = None,
    ) -> None:
        self.dataset = indexed_dataset
        self.config = config
        self.dataset_path = dataset_path or getattr(indexed_dataset, "path_prefix", None)
        all_lengths = np.asarray(indexed_dataset.sequence_lengths)
        if indices is None:
            self.indices = np.arange(all_lengths.shape[0], dtype=np.int64)
        else:
            self.indices = np.asarray(indices, dtype=np.int64)
            if self.indices.size and (
                self.indices.min() < 0 or self.indices.max() >= all_lengths.shape[0]
            ):
                raise IndexError(
                    f"indices must be document ids in [0, {all_lengths.shape[0]}), got range "
                    f"[{self.indices.min()}, {self.indices.max()}]"
                )
        self._lengths = all_lengths[self.indices].astype(np.int64)
        identity = {
            "class": type(self).__name__,
            "version": _PLAN_VERSION,
            "dataset_path": self.dataset_path,
            "documents": int(self.indices.shape[0]),
            "tokens": int(self._lengths.sum()),
            "indices_sha256": _digest(self.indices),
            "config": config.plan_identity(),
        }
        self.unique_description = json.dumps(identity, indent=4)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        arrays = self._load_or_plan()
        self.entries: npt.NDArray[np.int64] = arrays["entries"]
        self.row_offsets: npt.NDArray[np.int64] = arrays["row_offsets"]
        self.row_order: npt.NDArray[np.int64] = arrays["row_order"]

    # -- planning ----------------------------------------------------------------------------

    def _plan(self) -> dict[str, npt.NDArray[Any]]:
        started = time.perf_counter()
        config = self.config
        count = int(self.indices.shape[0])
        order = (
            _seeded_permutation(count, config.seed)
            if config.shuffle_documents
            else np.arange(count, dtype=np.int64)
        )
        check_packing_memory(
            self._lengths, config.sequence_length, config.window_overlap, self.dataset_path
        )
        plan = plan_packing(
            self._lengths[order],
            config.sequence_length,
            overlap=config.window_overlap,
            max_documents_per_row=config.max_documents_per_row,
            bos_aligned=config.bos_aligned,
            window=config.planning_window,
            num_threads=config.num_threads or default_build_threads(),
        )
        entries = plan.entries
        entries[:, 0] = self.indices[order[entries[:, 0]]]  # positions -> document ids
        row_order = (
            _seeded_permutation(plan.num_rows, (config.seed ^ _ROW_SEED_SALT) & 0xFFFFFFFF)
            if config.shuffle_rows
            else np.arange(plan.num_rows, dtype=np.int64)
        )
        logger.info(
            "planned %d rows from %d documents in %.3f s (padding %d tokens)",
            plan.num_rows,
            count,
            time.perf_counter() - started,
            plan.padding,
        )
        return {"entries": entries, "row_offsets": plan.row_offsets, "row_order": row_order}

    def _load_or_plan(self) -> dict[str, npt.NDArray[Any]]:
        if self.config.path_to_cache is None:
            return self._plan()
        cache = IndexCache.create(
            self.config.path_to_cache,
            self.unique_description_hash,
            type(self).__name__,
            "plan",
            self.unique_description,
            _ARRAY_NAMES,
        )
        int64 = (np.dtype(np.int64),)
        checks = packing_checks()
        specs = {
            "entries": ArraySpec(int64, ndim=2),
            "row_offsets": ArraySpec(int64, ndim=1, values=checks["row_offsets"]),
            "row_order": ArraySpec(int64, ndim=1, values=checks["row_order"]),
        }
        builder = distributed.is_cache_builder()
        arrays: dict[str, npt.NDArray[Any]] | None = None
        if builder:
            arrays = distributed.build_then_share(
                lambda: cache.load_or_build(EntrySpec(specs), self._plan, may_build=True)[0]
            )
        else:
            distributed.build_then_share(None)
        if arrays is None:
            arrays, _ = cache.load_or_build(EntrySpec(specs), self._plan, may_build=False)
        if arrays["row_order"].shape[0] != arrays["row_offsets"].shape[0] - 1:
            raise DataFormatError(f"{cache.array_path('row_order')}: does not match the plan")
        return arrays

    # -- statistics --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Tokens kept, padding and dropped tokens of this plan (dropped is always 0)."""
        rows = len(self)
        row_tokens = rows * self.config.sequence_length
        lengths = self.entries[:, 2]
        inserted = int(np.count_nonzero(self.entries[:, 4] & INSERTED_BOS))
        placed = int(lengths.sum())
        repeated = int(self.entries[:, 3].sum())
        padding = row_tokens - placed - inserted
        document_tokens = int(self._lengths.sum())
        return {
            "documents": int(self.indices.shape[0]),
            "document_tokens": document_tokens,
            "rows": rows,
            "row_tokens": row_tokens,
            "padding_tokens": padding,
            "inserted_bos_tokens": inserted,
            "repeated_overlap_tokens": repeated,
            "dropped_tokens": document_tokens - (placed - repeated),
            "padding_fraction": padding / row_tokens if row_tokens else 0.0,
            "waste_fraction": (padding + inserted) / row_tokens if row_tokens else 0.0,
        }

    # -- rows --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.row_order.shape[0])

    def _row_arrays(self, idx: int) -> dict[str, npt.NDArray[Any]]:
        config = self.config
        length = config.sequence_length
        ignore = config.label_ignore_index
        row = int(self.row_order[idx])
        begin, end = int(self.row_offsets[row]), int(self.row_offsets[row + 1])
        input_ids = np.full(length, config.pad_token_id, dtype=np.int64)
        labels = np.full(length, ignore, dtype=np.int64)
        positions = np.arange(length, dtype=np.int64)
        doc_ids = np.zeros(length, dtype=np.int32)
        cu_seqlens = np.full(config.max_documents_per_row + 1, length, dtype=np.int32)
        cu_seqlens[0] = 0
        if not 0 <= begin <= end <= len(self.entries) or end - begin > config.max_documents_per_row:
            raise IndexError(
                f"{self.dataset_path}: packing plan row_offsets[{row}:{row + 2}] = [{begin}, {end}] "
                f"is not a range of at most {config.max_documents_per_row} of the plan's "
                f"{len(self.entries)} entries"
            )
        position = 0
        documents = len(self.dataset.sequence_lengths)
        # the C++ gather's checks and meaning, entry for entry (csrc/packing.cpp: check_entry): a
        # corrupt cached plan raises IndexError naming the entry on both paths, never a numpy
        # error, a wrapped-around index or a row of other tokens
        for number, (document, offset, size, masked, flags) in enumerate(
            self.entries[begin:end].tolist()
        ):
            entry = begin + number
            if not 0 <= document < documents:
                raise IndexError(
                    f"{self.dataset_path}: packing plan entries[{entry}, 0] (document) = "
                    f"{document} is not a document id in [0, {documents})"
                )
            document_length = int(self.dataset.sequence_lengths[document])
            inserted = 1 if flags & INSERTED_BOS else 0
            if offset < 0 or size < 0 or offset > document_length:
                raise IndexError(
                    f"{self.dataset_path}: packing plan entry {entry} points outside its "
                    f"document: offset {offset}, length {size}, document {document} has "
                    f"{document_length} tokens"
                )
            if size > document_length - offset or size + inserted > length - position:
                raise IndexError(
                    f"{self.dataset_path}: packing plan entry {entry} points outside its "
                    f"document or row: offset {offset}, length {size}"
                    f"{' plus an inserted BOS' if inserted else ''}, document {document} has "
                    f"{document_length} tokens, {length - position} tokens of the row left"
                )
            start = position
            if inserted:
                # as the C++ gather: -1 when no BOS id is configured (a plan built with one)
                bos = config.bos_token_id
                input_ids[position] = -1 if bos is None else bos
                position += 1
            available = min(size + 1, document_length - offset)  # one more token for the label
            tokens = np.asarray(self.dataset.get(document, offset=offset, length=available))
            if tokens.dtype.kind not in "iu" or (
                tokens.dtype == np.uint64 and tokens.size and int(tokens.max()) > _INT64_MAX
            ):
                _refuse_tokens(self.dataset_path, document, tokens)
            input_ids[position : position + size] = tokens[:size]
            labels[position : position + available - 1] = tokens[1:available]
            # the first `masked` labels ignored; a negative count masks none (as in C++)
            labels[position : position + min(max(masked, 0), size)] = ignore
            position += size
            doc_ids[start:position] = number
            if config.reset_position_ids:
                positions[start:position] = np.arange(position - start)
            cu_seqlens[number] = start
        pieces = end - begin
        doc_ids[position:] = max(pieces - 1, 0)
        if config.reset_position_ids and position < length and pieces:
            last_start = int(cu_seqlens[pieces - 1])
            positions[position:] = np.arange(position - last_start, length - last_start)
        cu_seqlens[pieces:] = length
        cu_seqlens[0] = 0
        if config.bos_aligned and input_ids[0] != config.bos_token_id:
            raise DataFormatError(
                f"{self.dataset_path}: row {idx} starts with token {int(input_ids[0])}, not the BOS "
                f"id {config.bos_token_id}: bos_aligned packing needs documents that begin with BOS"
            )
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": positions,
            "doc_ids": doc_ids,
            "cu_seqlens": cu_seqlens,
        }

    def _native_source(self) -> tuple[Any, Any, Any] | None:
        """(pointers, lengths, tokens) of a memory-mapped IndexedDataset, for the C++ gather."""
        tokens = getattr(self.dataset, "_tokens", None)
        pointers = getattr(self.dataset, "sequence_pointers", None)
        if tokens is None or pointers is None or tokens.dtype.kind not in "iu":
            return None
        if tokens.dtype == np.uint64 or getattr(self.dataset, "multimodal", False):
            return None
        lengths = np.asarray(self.dataset.sequence_lengths)
        return np.asarray(pointers), lengths, tokens

    def _row_positions(self, indices: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """`indices` checked against [-len, len) and made non-negative."""
        count = len(self)
        if indices.size and (indices.min() < -count or indices.max() >= count):
            bad = int(indices[(indices < -count) | (indices >= count)][0])
            raise IndexError(f"row {bad} is out of range for {count} rows")
        return indices % count if count else indices

    # -- tokenmill.serving.Servable ------------------------------------------------------------

    def batch_layout(self) -> BatchLayout | None:
        """The layout of this dataset's served batches (`tokenmill.serving`), or None when the
        source is not a memory-mapped integer IndexedDataset (rows are then built in Python)."""
        server = self._serving()
        return None if server is None else server.layout

    def fill_batch(
        self,
        indices: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None,
        buffers: Mapping[str, npt.NDArray[Any]],
        *,
        num_threads: int = 1,
    ) -> None:
        """Gather rows `indices` into batch rows `rows` (None: 0..B-1) of `buffers`, in one C++
        call (`num_threads` is unused: the packed gather runs on the calling thread).

        Raises:
            IndexError: a row index is outside [-len, len).
            TypeError: this dataset has no batch layout (`batch_layout()` is None).
            DataFormatError: bos_aligned rows that do not start with BOS.
        """
        native = self._native_source()
        if native is None:
            raise TypeError(
                f"PackedDataset over {type(self.dataset).__name__} has no batch layout: its "
                "rows are built in Python"
            )
        indices = self._row_positions(indices)
        outputs: Mapping[str, npt.NDArray[Any]] = buffers
        if rows is not None:
            server = self._serving()
            assert server is not None
            outputs = allocate(server.fields, int(indices.shape[0]), pin_memory=False)
        config = self.config
        pointers, lengths, tokens = native
        try:
            core_call(
                _core.gather_packed_rows,
                np.ascontiguousarray(self.entries),
                np.ascontiguousarray(self.row_offsets),
                np.ascontiguousarray(self.row_order[indices], dtype=np.int64),
                pointers,
                lengths,
                tokens,
                config.sequence_length,
                config.max_documents_per_row,
                -1 if config.bos_token_id is None else config.bos_token_id,
                config.pad_token_id,
                config.label_ignore_index,
                config.reset_position_ids,
                **outputs,
            )
        except _core.MappedReadFault as fault:  # the C++ guard caught a SIGBUS: the .bin shrank
            prefix = getattr(self.dataset, "path_prefix", "<tokens>")
            raise shrunk_file_error(f"{prefix}.bin", int(tokens.nbytes), fault) from None
        if config.bos_aligned:
            bad_rows = np.flatnonzero(outputs["input_ids"][:, 0] != config.bos_token_id)
            if bad_rows.size:
                self._row_arrays(int(indices[bad_rows[0]]))  # raises the DataFormatError
        if rows is not None:
            for key, values in outputs.items():
                buffers[key][rows] = values

    def _serving(self) -> BatchServer | None:
        """The batch server of this dataset in this process, or None without a C++ gather."""
        server = self.__dict__.get("_server", _UNSET)
        if server is _UNSET:
            server = None
            if self._native_source() is not None:
                config = self.config
                length, int64 = (config.sequence_length,), np.dtype(np.int64)
                layout = PlainLayout(
                    (
                        Field("input_ids", length, int64),
                        Field("labels", length, int64),
                        Field("position_ids", length, int64),
                        Field("doc_ids", length, np.dtype(np.int32)),
                        Field(
                            "cu_seqlens", (config.max_documents_per_row + 1,), np.dtype(np.int32)
                        ),
                    )
                )
                server = BatchServer(layout)
            self._server = server
        result: BatchServer | None = server
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_server", None)  # per process (it holds torch and a buffer pool)
        return state

    def _batch(self, indices: npt.NDArray[np.int64]) -> dict[str, torch.Tensor]:
        """Rows `indices` as [B, ...] tensors: one C++ call for mapped Megatron data."""
        import torch

        server = self._serving()
        if server is not None:
            return server.serve(int(indices.shape[0]), [(self, indices, None)])
        rows = [self._row_arrays(int(i)) for i in self._row_positions(indices)]
        return {key: torch.from_numpy(np.stack([row[key] for row in rows])) for key in rows[0]}

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        batch = self._batch(np.array([idx], dtype=np.int64))
        return {key: value[0] for key, value in batch.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A whole batch as stacked tensors (the DataLoader batched-fetch protocol): one C++
        gather into [B, ...] arrays, no per-row tensors (pass `collate_fn=lambda b: b`)."""
        return self._batch(np.asarray(indices, dtype=np.int64))


_INT64_MAX = (1 << 63) - 1
# bytes a packing plan holds per piece: an entry (5 int64) plus its row's offset and order
# entries, and the planner's per-piece scratch
_PLAN_BYTES_PER_PIECE = 64


def check_packing_memory(
    lengths: npt.NDArray[Any], sequence_length: int, overlap: int, source: str | None
) -> None:
    """MemoryError before planning if the plan for documents of `lengths` cannot fit in memory:
    each document is at least ceil(length / stride) pieces, so lengths claimed by a huge (e.g.
    sparse) file are judged from the index, before the planner allocates."""
    from tokenmill.common.budget import check_allocation

    stride = max(sequence_length - overlap, 1)
    lengths64 = np.asarray(lengths, dtype=np.int64)
    pieces = int(((lengths64 + stride - 1) // stride).sum())
    check_allocation(
        pieces * _PLAN_BYTES_PER_PIECE,
        f"{source}: a packing plan of at least {pieces:,} pieces ({int(lengths64.sum()):,} tokens "
        f"in {lengths64.shape[0]:,} documents, rows of {sequence_length})",
    )


def _refuse_tokens(path: str | None, document: int, tokens: npt.NDArray[Any]) -> None:
    """Tokens the int64 rows cannot hold: float data, or uint64 ids of 2**63 and more (which
    numpy would wrap to negative ids)."""
    if tokens.dtype.kind not in "iu":
        raise TypeError(
            f"{path}: document {document} holds {tokens.dtype} tokens; packed rows need integer "
            "token ids"
        )
    bad = int(tokens.max())
    raise OverflowError(
        f"{path}: document {document} holds token {bad}, which does not fit the int64 rows "
        "(uint64 ids must be below 2**63)"
    )


def _digest(values: npt.NDArray[Any]) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def document_block_mask(doc_ids: torch.Tensor, *, causal: bool = True) -> Any:
    """A FlexAttention BlockMask letting each token attend only within its own document.

    Args:
        doc_ids: [S] or [B, S] document ids of a row (or batch), as PackedDataset returns them.
        causal: also forbid attending to later positions.

    Raises:
        RuntimeError: if this torch has no FlexAttention.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as error:  # pragma: no cover - torch >= 2.5 has it
        raise RuntimeError("document_block_mask needs torch with FlexAttention") from error
    batched = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)
    length = int(batched.shape[1])

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        same = batched[b, q] == batched[b, kv]
        return same & (q >= kv) if causal else same

    return create_block_mask(
        mask_mod, int(batched.shape[0]), None, length, length, device=str(batched.device)
    )
