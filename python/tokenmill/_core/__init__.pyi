"""Typed stub of tokenmill's compiled kernels (private; use the package API).

Checked against the built module by `python -m mypy.stubtest` in .ci/run. Test-only entry points
live in the `_testing` submodule (_testing.pyi).
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _testing as _testing

def shuffle_like_numpy(values: npt.NDArray[np.integer], seed: int) -> None: ...
def sum_selected_lengths(sizes: npt.NDArray[np.int32], indices: npt.NDArray[np.int32]) -> int: ...
def build_gpt_indices(
    sizes: npt.NDArray[np.int32],
    indices: npt.NDArray[np.int32],
    seed: int,
    num_epochs: int,
    separate_final_epoch: bool,
    shuffle_split: int,
    sequence_length: int,
    extra_token: int,
    document_index: npt.NDArray[np.int32],
    sample_index: npt.NDArray[np.integer],
    shuffle_index: npt.NDArray[np.integer],
    num_threads: int = 1,
) -> None: ...
def build_blending_indices(
    weights: npt.NDArray[np.float64],
    dataset_index: npt.NDArray[np.integer],
    dataset_sample_index: npt.NDArray[np.int64],
    *,
    threads: int = 0,
) -> None: ...
def build_exhaustive_blending_indices(
    sizes: npt.NDArray[np.int64],
    dataset_index: npt.NDArray[np.integer],
    dataset_sample_index: npt.NDArray[np.int64],
    *,
    threads: int = 0,
) -> None: ...
def plan_packing(
    lengths: npt.NDArray[np.int32],
    row_length: int,
    overlap: int,
    max_pieces_per_row: int,
    window: int,
    max_open_rows: int,
    segment: int,
    bos_aligned: bool,
    num_threads: int = 1,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int]: ...
def find_token_positions(
    tokens: npt.NDArray[np.integer], token: int, num_threads: int = 1
) -> npt.NDArray[np.int64]: ...
def count_token(tokens: npt.NDArray[np.integer], token: int, num_threads: int = 1) -> int: ...
def check_megatron_index_arrays(
    sequence_lengths: npt.NDArray[np.int32],
    sequence_pointers: npt.NDArray[np.int64],
    document_indices: npt.NDArray[np.int64],
    itemsize: int,
) -> tuple[int, int, int, int]: ...
def inode_generation(descriptor: int) -> int: ...
def read_small_file(
    path: str, limit: int, want_generation: bool = False, keep_open: bool = False
) -> tuple[int, int, bytes | int | None, int, int, int, int, int]: ...
def sync_filesystem(descriptor: int, label: str) -> int: ...

class ReadOnlyMap:
    """A read-only shared memory map (bytes, buffer protocol), unmapped when the last view of it
    is freed; made by map_readonly."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

def map_readonly(descriptor: int, length: int) -> ReadOnlyMap: ...

class OwnedBuffer:
    """Bytes read ahead (ReadAhead.take), read-only through the buffer protocol, freed when the
    last view of them is."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

class ReadAhead:
    """Data files read ahead of their use on a background thread without the GIL
    (csrc/read_ahead.hpp)."""

    def __init__(
        self,
        requests: Sequence[tuple[str, bool, int, int]],
        max_pending: int,
        max_pending_bytes: int,
    ) -> None: ...
    def take(
        self, index: int
    ) -> tuple[int, int, OwnedBuffer | None, int, int, int, int, int] | None: ...
    @property
    def read_by_worker(self) -> int: ...
    def __len__(self) -> int: ...

class FileWriter:
    """Small files created, written, fstat-ed and closed on background threads, and fsyncs."""

    def __init__(self, threads: int) -> None: ...
    def submit_write(self, path: str, chunks: list[object], sync: bool = False) -> int: ...
    def submit_writes(
        self, files: list[tuple[str, list[object]]], sync: bool = False
    ) -> list[int]: ...
    def submit_sync(self, path: str) -> int: ...
    def sync_all(self, paths: list[str]) -> list[tuple[int, int]]: ...
    def wait(self, ticket: int) -> tuple[int, int, int, int, int, int, int]: ...

class MappedReadFault(OSError):
    """A SIGBUS while reading a mapped file (it shrank underneath), raised by a guarded read."""

def probe_mapped(mapping: npt.NDArray[Any], begin: int, end: int, /) -> None: ...
def copy_mapped(destination: npt.NDArray[Any], mapping: npt.NDArray[Any], begin: int) -> None: ...

class MappedFile:
    """A mapped file held for guarded reads (MappedReadFault, not SIGBUS, if it shrank)."""

    def __init__(self, mapping: Any) -> None: ...
    @property
    def size(self) -> int: ...
    def probe(self) -> None: ...
    def entry(
        self, lengths_offset: int, pointers_offset: int, count: int, index: int
    ) -> tuple[int, int]: ...
    def entry_probing(
        self, also: MappedFile, lengths_offset: int, pointers_offset: int, count: int, index: int
    ) -> tuple[int, int]: ...

class Gatherer:
    """A GPTDataset's index arrays and token buffer, for batched gathers."""

    def __init__(
        self,
        shuffle_index: npt.NDArray[np.integer],
        sample_index: npt.NDArray[np.integer],
        document_index: npt.NDArray[np.int32],
        sequence_pointers: npt.NDArray[np.int64],
        sequence_lengths: npt.NDArray[np.int32],
        tokens: npt.NDArray[np.integer],
        sequence_length: int,
        extra_token: int,
        eod: int,
        pad: int,
        eod_mask_loss: bool,
        reset_position_ids: bool,
        inter_document_masking: bool,
    ) -> None: ...
    def __len__(self) -> int: ...
    def gather(
        self,
        indices: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None,
        tokens: npt.NDArray[np.integer],
        labels: npt.NDArray[np.integer],
        loss_mask: npt.NDArray[np.float32],
        position_ids: npt.NDArray[np.int64] | None,
        document_starts: npt.NDArray[np.int64] | None,
        cu_seqlens: npt.NDArray[np.int32] | None,
        max_seqlen: npt.NDArray[np.int32] | None,
        num_threads: int = 1,
    ) -> None: ...
    def gather_one(
        self,
        index: int,
        tokens: npt.NDArray[np.integer],
        labels: npt.NDArray[np.integer],
        loss_mask: npt.NDArray[np.float32],
        position_ids: npt.NDArray[np.int64] | None,
        document_starts: npt.NDArray[np.int64] | None,
        cu_seqlens: npt.NDArray[np.int32] | None,
        max_seqlen: npt.NDArray[np.int32] | None,
    ) -> None: ...

def gather_packed_rows(
    entries: npt.NDArray[np.int64],
    row_offsets: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64],
    sequence_pointers: npt.NDArray[np.int64],
    sequence_lengths: npt.NDArray[np.int32],
    tokens: npt.NDArray[np.integer],
    row_length: int,
    max_pieces_per_row: int,
    bos: int,
    pad: int,
    ignore: int,
    reset_positions: bool,
    input_ids: npt.NDArray[np.int64],
    labels: npt.NDArray[np.int64],
    position_ids: npt.NDArray[np.int64],
    doc_ids: npt.NDArray[np.int32],
    cu_seqlens: npt.NDArray[np.int32],
) -> None: ...
def draw_chunk_sources(
    thresholds: npt.NDArray[np.uint64],
    key: tuple[int, int] | list[int],
    stream: int,
    draw: int,
    first_chunk: int,
    out: npt.NDArray[np.int32],
) -> None: ...
def pack_jsonl_field(
    data: bytes | npt.NDArray[np.uint8], key: str
) -> tuple[bytes, npt.NDArray[np.int64], int]: ...
def pack_lines(data: bytes | npt.NDArray[np.uint8]) -> tuple[bytes, npt.NDArray[np.int64], int]: ...
def pack_documents(
    data: bytes | npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64]
) -> tuple[bytes, npt.NDArray[np.int64], int]: ...
def find_code_points(
    packed: bytes | npt.NDArray[np.uint8], ranges: npt.NDArray[np.uint32]
) -> npt.NDArray[np.int64]: ...
