"""NanogptDataset: NeMo Automodel's iterable dataset over modded-nanogpt shards, made exact.

Sample semantics are NeMo's: a *part* of a shard (a token range) is cut into non-overlapping
windows of ``seq_len + 1`` tokens, starting at the part's first token and advancing by
``seq_len + 1``; a window never crosses the end of its part, and the remainder is dropped. Each
window gives ``input_ids = window[:-1]`` and ``labels = window[1:]``. With ``align_to_bos`` every
window starts at the next BOS token at or after the current position (from the shard's
``.bos.idx`` by binary search, or from a C++ scan of the shard when there is none).

Who reads what (the *plan*, a pure function of the files, ``seed``, epoch, the number of
readers and ``worker_split``; see :class:`~tokenmill.common.world.World`). With T readers (ranks
x DataLoader workers) and n files in epoch order (sorted, or a permutation drawn from ``seed`` and
the epoch, identical on every rank), reader g is given the files ``g, g + T, g + 2T, ...``, and:

* ``worker_split="nemo"`` (the default) is NeMo Automodel 0.7.0's rule, read from its
  ``_setup_worker_context``: a reader given no file (g >= n) takes *every* file instead; a reader
  left with exactly one file (when T > 1) reads only part g of T of it, cut by token range
  (``N // T`` tokens each, the last reader, g = T - 1, taking the remainder); any other reader
  reads its files whole. So with one file every reader reads its own T-th; with n files and
  T >= n readers, reader g < n reads just the g-th T-th of file g (e.g. 3 files and 3 readers read
  a third of each file; 3 files and 2 readers read files 0 and 2 whole and the second half of
  file 1), and readers g >= n read every file whole, again. Windows are token-identical to
  NeMo's ``NanogptDataset`` for any file and reader count (tests/test_interop_peers.py).
* ``worker_split="once"`` reads every window once per epoch: n >= T: files whole, as above;
  n < T: reader g takes part ``g // n`` of file ``g % n``, each file being split by token range
  into as many equal parts as readers share it (the last part takes the remainder).

Differences from NeMo, on purpose: samples are int64 tensors (NeMo: Python lists); the file
shuffle is seeded and the same on every rank, applied before the split (NeMo: each reader shuffles
its own files, seeded by its worker id, or by the process id outside a DataLoader worker, so it is
not reproducible); an epoch ends (``infinite=True`` loops over epochs, each with its own shuffle);
a dataset with no window at all raises ValueError instead of yielding nothing (NeMo's loops
forever without yielding), as does an ``infinite`` reader whose epoch holds no window; a
``.bos.idx`` is checked (sorted, in range, pointing at BOS tokens) instead of being trusted; and
``state_dict()`` / ``load_state_dict()`` resume exactly mid-epoch.

Resume state is the number of windows each reader has produced in the current epoch. Iterating in
the main process (``num_workers=0``), ``state_dict()`` knows it. Behind a DataLoader with workers
the main process's copy does not iterate, so ask :meth:`NanogptDataset.loader_state_dict` with the
number of samples the trainer has taken: DataLoader hands out batches round-robin over its
workers (a worker that runs out drops out of the turn), which the method replays.

Cost: construction reads each shard's 1 KiB header. A reader maps its shards lazily; with
``align_to_bos`` it loads (and checks, O(BOS count)) the ``.bos.idx`` or scans the shard once
(about 1 ns per token). A window costs one slice and two small copies.
"""

from __future__ import annotations

import glob
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from torch.utils.data import IterableDataset

from tokenmill import _core
from tokenmill.common.world import World
from tokenmill.errors import DataFormatError
from tokenmill.formats.bos_index import (
    BOS_INDEX_SUFFIX,
    bos_index_path,
    check_bos_positions,
    read_bos_index,
)
from tokenmill.formats.megatron import shrunk_file_error
from tokenmill.formats.nanogpt import (
    HEADER_BYTES,
    NanogptHeader,
    NanogptShard,
    parse_nanogpt_header,
    read_nanogpt_header,
)
from tokenmill.storage.object_storage import ObjectStorageConfig
from tokenmill.storage.s3 import client_for, is_s3_url

__all__ = ["NanogptDataset"]

_STATE_FORMAT = "tokenmill.NanogptDataset"
_STATE_VERSION = 1
WORKER_SPLITS = ("nemo", "once")


@dataclass(frozen=True)
class _Part:
    """A token range ``[start, end)`` of file ``file``."""

    file: int
    start: int
    end: int


def _read_window(shard: NanogptShard, start: int, count: int) -> npt.NDArray[Any]:
    """`count` tokens of a mapped shard from `start`, copied by the C++ guard: a shard truncated
    while mapped raises DataFormatError naming it (not SIGBUS, and not the zeros a partial last
    page reads as; see docs/reliability.md for the one cut that stays unseen)."""
    tokens = shard.tokens
    window = np.empty(min(count, max(tokens.shape[0] - start, 0)), dtype=tokens.dtype)
    try:
        _core.copy_mapped(window, tokens, start * tokens.dtype.itemsize)
    except _core.MappedReadFault as fault:
        raise shrunk_file_error(shard.path, shard.header.file_size, fault) from None
    return window


class NanogptDataset(IterableDataset):  # type: ignore[misc]
    """Windows of ``seq_len + 1`` tokens from modded-nanogpt shards, split over ranks x workers.

    Args:
        file_pattern: a glob pattern (sorted matches) or an explicit list of ``.bin`` shards.
        seq_len: tokens per sample (a window is ``seq_len + 1`` tokens).
        bos_token: the BOS token id; required by ``align_to_bos``.
        shuffle_files: permute the files every epoch (seeded by ``seed`` and the epoch).
        align_to_bos: start every window at a BOS token.
        seed: the file-shuffle seed.
        infinite: loop over epochs instead of ending after one.
        world: override the rank/worker detection (see :meth:`World.current`).
        scan_threads: threads of the BOS scan used when a shard has no ``.bos.idx``.
        worker_split: ``"nemo"``, NeMo Automodel's split of the files over readers (some windows
            read by several readers, some by none when there are no more files than readers),
            or ``"once"``, every window read by exactly one reader (see the module docstring).
        object_storage_config: required for ``s3://`` shards (a pattern such as
            ``s3://bucket/fineweb_train_*.bin`` is listed with one LIST request): an
            :class:`~tokenmill.storage.object_storage.ObjectStorageConfig`. Windows are read with
            ranged GETs through the chunk cache, with read-ahead along the shard; a ``.bos.idx``
            is fetched into ``path_to_idx_cache`` and each window's first token is checked
            against it as it is read; a shard without ``.bos.idx`` under ``align_to_bos`` is
            downloaded whole into that directory (once per version) and scanned there.

    Raises:
        FileNotFoundError: no file matches.
        ValueError: ``seq_len < 1``, ``align_to_bos`` without ``bos_token``, or an unknown
            ``worker_split``.
        DataFormatError: a shard's header is bad (raised here, naming the file).
    """

    def __init__(
        self,
        file_pattern: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        seq_len: int,
        *,
        bos_token: int | None = None,
        shuffle_files: bool = False,
        align_to_bos: bool = False,
        seed: int = 0,
        infinite: bool = False,
        world: World | None = None,
        scan_threads: int | None = None,
        object_storage_config: Any = None,
        worker_split: Literal["nemo", "once"] = "nemo",
    ) -> None:
        super().__init__()
        if worker_split not in WORKER_SPLITS:
            raise ValueError(f"worker_split must be one of {WORKER_SPLITS}, got {worker_split!r}")
        self.worker_split = worker_split
        self.object_storage_config = object_storage_config
        if isinstance(file_pattern, (str, os.PathLike)):
            pattern = os.fspath(file_pattern)
            if is_s3_url(pattern):
                self.files = _remote_glob(pattern, self._storage(pattern))
            else:
                self.files = sorted(glob.glob(pattern))
        else:
            self.files = [os.fspath(path) for path in file_pattern]
        if not self.files:
            raise FileNotFoundError(f"no files matched {file_pattern!r}")
        for path in self.files:
            if is_s3_url(path):
                self._storage(path)
        self.seq_len = operator.index(seq_len)
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if align_to_bos and bos_token is None:
            raise ValueError("bos_token must be given when align_to_bos is True")
        self.bos_token = None if bos_token is None else operator.index(bos_token)
        self.shuffle_files = bool(shuffle_files)
        self.align_to_bos = bool(align_to_bos)
        self.seed = operator.index(seed)
        self.infinite = bool(infinite)
        self.world = world
        self.scan_threads = scan_threads
        self.token_counts = [self._header(path).token_count for path in self.files]
        self.epoch = 0
        self._consumed: dict[int, int] = {}  # global worker id -> windows produced this epoch
        self._resume: dict[int, int] = {}  # windows to skip at the start of the next iteration
        self._shards: dict[int, Any] = {}  # NanogptShard, or _RemoteShard for s3:// files
        self._bos: dict[int, npt.NDArray[Any]] = {}
        # files whose .bos.idx is checked window by window as it is read (remote shards)
        self._check_window_bos: set[int] = set()

    # --- object storage ------------------------------------------------------------------------

    def _storage(self, path: str) -> ObjectStorageConfig:
        if self.object_storage_config is None:
            raise ValueError(
                f"{path} is an object-storage path: pass object_storage_config="
                "ObjectStorageConfig(path_to_idx_cache=<local directory>)"
            )
        return ObjectStorageConfig.coerce(self.object_storage_config)

    def _header(self, path: str) -> NanogptHeader:
        if not is_s3_url(path):
            return read_nanogpt_header(path)
        client = client_for(self._storage(path).retry)
        size = client.stat(path).size
        raw = client.get_range(path, 0, min(HEADER_BYTES, size)) if size else b""
        return parse_nanogpt_header(path, raw, size)

    # --- the plan ------------------------------------------------------------------------------

    def file_order(self, epoch: int) -> list[int]:
        """File indices in the order of ``epoch`` (a seeded permutation with ``shuffle_files``)."""
        if not self.shuffle_files:
            return list(range(len(self.files)))
        generator = np.random.default_rng([self.seed, epoch])
        return [int(i) for i in generator.permutation(len(self.files))]

    def parts(self, epoch: int, global_worker_id: int, total_workers: int) -> list[_Part]:
        """The token ranges reader ``global_worker_id`` of ``total_workers`` reads in ``epoch``."""
        order = self.file_order(epoch)
        n = len(order)
        if self.worker_split == "nemo":
            return self._nemo_parts(order, global_worker_id, total_workers)
        if n >= total_workers:
            return [
                _Part(f, 0, self.token_counts[f]) for f in order[global_worker_id::total_workers]
            ]
        file = order[global_worker_id % n]
        sharing = len(range(global_worker_id % n, total_workers, n))
        part = global_worker_id // n
        tokens = self.token_counts[file]
        size = tokens // sharing
        start = part * size
        end = tokens if part == sharing - 1 else start + size
        return [_Part(file, start, end)]

    def _nemo_parts(self, order: list[int], reader: int, total: int) -> list[_Part]:
        """NeMo Automodel 0.7.0's split (the module docstring states the rule)."""
        files = order[reader::total] or order
        if len(files) == 1 and total > 1:
            tokens = self.token_counts[files[0]]
            size = tokens // total
            start = reader * size
            end = tokens if reader == total - 1 else start + size
            return [_Part(files[0], start, end)]
        return [_Part(f, 0, self.token_counts[f]) for f in files]

    def _shard(self, file: int) -> Any:
        shard = self._shards.get(file)
        if shard is None:
            path = self.files[file]
            shard = self._shards[file] = (
                _RemoteShard(path, self._storage(path)) if is_s3_url(path) else NanogptShard(path)
            )
        return shard

    def _remote_bos_positions(self, file: int) -> npt.NDArray[Any]:
        from tokenmill.storage.local_cache import cache_object, cache_object_if_exists

        assert self.bos_token is not None  # checked in __init__
        path = self.files[file]
        config = self._storage(path)
        client = client_for(config.retry)
        sidecar = os.path.splitext(path)[0] + BOS_INDEX_SUFFIX
        local = cache_object_if_exists(sidecar, config.path_to_idx_cache, client)
        if local is not None:
            self._check_window_bos.add(file)
            return read_bos_index(local, self.token_counts[file]).positions
        # no sidecar: the scan needs every token, so fetch the shard once and map it
        shard = NanogptShard(cache_object(path, config.path_to_idx_cache, client))
        self._shards[file] = shard
        from tokenmill.formats.token_scan import find_token_positions

        return find_token_positions(shard.tokens, self.bos_token, self.scan_threads)

    def _bos_positions(self, file: int) -> npt.NDArray[Any]:
        positions = self._bos.get(file)
        if positions is None and is_s3_url(self.files[file]):
            positions = self._bos[file] = self._remote_bos_positions(file)
        if positions is None:
            assert self.bos_token is not None  # checked in __init__
            shard = self._shard(file)
            sidecar = bos_index_path(self.files[file])
            if os.path.exists(sidecar):
                positions = read_bos_index(sidecar, len(shard)).positions
                check_bos_positions(sidecar, shard.tokens, positions, self.bos_token)
            else:
                from tokenmill.formats.token_scan import find_token_positions

                positions = find_token_positions(shard.tokens, self.bos_token, self.scan_threads)
            self._bos[file] = positions
        return positions

    def _window_starts(self, part: _Part) -> npt.NDArray[np.int64]:
        step = self.seq_len + 1
        if not self.align_to_bos:
            count = max(part.end - part.start, 0) // step
            return part.start + step * np.arange(count, dtype=np.int64)
        positions = self._bos_positions(part.file)
        low = int(np.searchsorted(positions, part.start, side="left"))
        high = int(np.searchsorted(positions, part.end - step, side="right"))
        candidates = positions[low:high]  # BOS positions whose window fits in the part
        starts: list[int] = []
        i, count = 0, candidates.shape[0]
        while i < count:
            start = int(candidates[i])
            starts.append(start)
            i = int(np.searchsorted(candidates, start + step, side="left"))
        return np.asarray(starts, dtype=np.int64)

    def windows_per_reader(self, total_workers: int, epoch: int | None = None) -> list[int]:
        """How many windows each reader produces in an epoch (by global worker id)."""
        epoch = self.epoch if epoch is None else epoch
        return [
            sum(self._window_starts(part).shape[0] for part in self.parts(epoch, g, total_workers))
            for g in range(total_workers)
        ]

    # --- iteration -----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration reads; a new epoch forgets the resume position."""
        epoch = operator.index(epoch)
        if epoch != self.epoch:
            self._consumed.clear()
            self._resume.clear()
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        world = World.current(self.world)
        reader, total = world.global_worker_id, world.total_workers
        resume_total = getattr(self, "_resume_total", None)
        if self._resume and resume_total is not None and resume_total != total:
            # The per-reader positions only mean something for the same split of the files.
            raise ValueError(
                f"this state was taken with {resume_total} readers (ranks x DataLoader workers) "
                f"but the dataset now runs with {total}; resuming NanogptDataset under a "
                "different number of readers is not supported"
            )
        self._total_readers = total
        skip = self._resume.pop(reader, 0)
        epoch = self.epoch
        while True:
            self._consumed[reader] = skip
            plan = [(part, self._window_starts(part)) for part in self.parts(epoch, reader, total)]
            if not any(starts.shape[0] for _, starts in plan):
                self._refuse_empty(epoch, reader, total)
            for part, starts in plan:
                if skip >= starts.shape[0]:
                    skip -= starts.shape[0]
                    continue
                shard = self._shard(part.file)
                tokens = shard.tokens
                check_bos = part.file in self._check_window_bos
                mapped = isinstance(shard, NanogptShard)
                for start in starts[skip:].tolist():
                    if mapped:
                        values = _read_window(shard, start, self.seq_len + 1)
                    else:
                        values = tokens[start : start + self.seq_len + 1]
                    if check_bos and int(values[0]) != self.bos_token:
                        raise DataFormatError(
                            f"{self.files[part.file]}: its .bos.idx lists position {start}, "
                            f"which holds token {int(values[0])}, not the BOS token "
                            f"{self.bos_token}; rebuild the index"
                        )
                    window = torch.from_numpy(values.astype(np.int64))
                    self._consumed[reader] += 1
                    yield {"input_ids": window[:-1], "labels": window[1:]}
                skip = 0
            if not self.infinite:
                return
            epoch += 1
            self.epoch = epoch
            self._consumed.clear()
            skip = 0

    def _refuse_empty(self, epoch: int, reader: int, total: int) -> None:
        """Called when reader ``reader`` has no window in ``epoch``: fine for one reader of a
        finite epoch while others have windows; an error when no reader has any (the dataset
        would yield nothing, or loop forever with ``infinite``), or when an ``infinite`` reader
        would spin through empty epochs without ever yielding.

        Raises:
            ValueError: naming the files, ``seq_len`` and the reader.
        """
        what = (
            f"{len(self.files)} file(s) ({self.files[0]}{', ...' if len(self.files) > 1 else ''})"
        )
        if sum(self.windows_per_reader(total, epoch)) == 0:
            tokens = sum(self.token_counts)
            aligned = f" starting at BOS token {self.bos_token}" if self.align_to_bos else ""
            raise ValueError(
                f"NanogptDataset over {what} has no window of seq_len + 1 = {self.seq_len + 1} "
                f"tokens{aligned} ({tokens} tokens in all, {total} reader(s)): it would yield "
                "nothing; use a shorter seq_len or more data"
            )
        if self.infinite:
            raise ValueError(
                f"NanogptDataset over {what}: reader {reader} of {total} (ranks x DataLoader "
                f"workers) gets no window of {self.seq_len + 1} tokens in epoch {epoch}; with "
                "infinite=True it would loop without ever yielding. Use fewer readers, "
                "worker_split='once', or a shorter seq_len"
            )

    # --- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of the readers that iterated in this process (exact mid-epoch)."""
        consumed = dict(self._resume)
        consumed.update(self._consumed)
        total = getattr(self, "_total_readers", None) or getattr(self, "_resume_total", None)
        return self._state(consumed, total)

    def _state(self, consumed: dict[int, int], total_workers: int | None) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "files": len(self.files),
            "total_workers": total_workers,
            "worker_split": self.worker_split,
            "consumed": {str(reader): count for reader, count in sorted(consumed.items())},
        }

    def loader_state_dict(
        self,
        samples_consumed: int,
        *,
        batch_size: int | None,
        num_workers: int,
        drop_last: bool = False,
    ) -> dict[str, Any]:
        """The resume position of this rank after the trainer took ``samples_consumed`` samples
        from a DataLoader over this dataset (iterated since its last ``iter()``).

        Args:
            samples_consumed: samples taken from the loader (batches x batch size, counting a
                short final batch of a worker as its length).
            batch_size: the loader's batch size (None: one sample per item).
            num_workers: the loader's ``num_workers`` (0 = main process).
            drop_last: the loader's ``drop_last``.

        Returns:
            A state for :meth:`load_state_dict`.

        Raises:
            ValueError: more samples than this rank's workers produce in the epoch.
        """
        base = World.current(self.world)
        workers = max(num_workers, 1)
        world = World(base.rank, base.world_size, 0, workers)
        per_reader = self.windows_per_reader(world.total_workers)
        readers = list(world.rank_workers())
        batch = 1 if batch_size is None else batch_size
        taken = {reader: self._resume.get(reader, 0) for reader in readers}
        remaining = {reader: per_reader[reader] - taken[reader] for reader in readers}
        if drop_last:
            remaining = {r: n - n % batch for r, n in remaining.items()}
        left = operator.index(samples_consumed)
        active = [r for r in readers if remaining[r] > 0]
        while left > 0 and active:
            still = []
            for reader in active:
                if left <= 0:
                    still.append(reader)
                    continue
                size = min(batch, remaining[reader], left)
                taken[reader] += size
                remaining[reader] -= size
                left -= size
                if remaining[reader] > 0:
                    still.append(reader)
            active = still
        if left > 0:
            raise ValueError(
                f"samples_consumed={samples_consumed} exceeds the samples this rank's "
                f"{workers} worker(s) produce in epoch {self.epoch}"
            )
        return self._state(taken, world.total_workers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state: the next iteration skips the windows already produced.

        Raises:
            ValueError: the state is not a NanogptDataset state, or was taken with another seed
                or file list.
        """
        if state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a NanogptDataset state (version {_STATE_VERSION}): {state!r}")
        if state["seed"] != self.seed or state["files"] != len(self.files):
            raise ValueError(
                f"state was taken with seed {state['seed']} over {state['files']} files; this "
                f"dataset has seed {self.seed} and {len(self.files)} files"
            )
        # states from before worker_split existed were taken with the "once" plan
        split = state.get("worker_split", "once")
        if split != self.worker_split:
            raise ValueError(
                f"state was taken with worker_split={split!r}, this dataset has "
                f"worker_split={self.worker_split!r}: its per-reader positions would point into "
                f"other parts of the files; construct the dataset with worker_split={split!r}"
            )
        self.epoch = int(state["epoch"])
        total = state.get("total_workers")
        self._resume_total = None if total is None else int(total)
        self._consumed.clear()
        self._resume = {int(reader): int(count) for reader, count in state["consumed"].items()}

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One state from the states of several readers (e.g. every rank's)."""
        if not states:
            raise ValueError("no states to merge")
        merged = dict(states[0])
        consumed: dict[str, int] = {}
        for state in states:
            if state["epoch"] != merged["epoch"] or state["seed"] != merged["seed"]:
                raise ValueError("states from different epochs or seeds cannot be merged")
            consumed.update(state["consumed"])
        merged["consumed"] = consumed
        return merged

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_shards"] = {}
        state["_bos"] = {}
        state["_check_window_bos"] = set()
        return state


class _RemoteShard:
    """A nanogpt shard in S3: ``tokens`` reads windows through the chunk cache, prefetching the
    next chunks along the shard (readers walk their part of a shard in order)."""

    def __init__(self, url: str, config: ObjectStorageConfig) -> None:
        from tokenmill.storage.remote import RemoteArray, S3BinReader

        reader = S3BinReader(url, config, client_for(config.retry))
        raw = reader.cache.read(0, min(HEADER_BYTES, reader.size)) if reader.size else b""
        self.header = parse_nanogpt_header(url, raw, reader.size)
        self.reader = reader
        self.tokens = RemoteArray(
            reader,
            self.header.dtype.newbyteorder("<"),
            self.header.token_count,
            HEADER_BYTES,
            readahead_bytes=2 * config.bin_chunk_nbytes,
        )

    def __len__(self) -> int:
        return self.header.token_count


def _remote_glob(pattern: str, config: ObjectStorageConfig) -> list[str]:
    return client_for(config.retry).glob(pattern)
