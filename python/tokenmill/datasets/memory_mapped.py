"""MemoryMappedDataset: KempnerForge's map-style dataset over a directory of token files.

Semantics are KempnerForge's: the files of ``data_dir`` matching ``file_pattern`` are sorted and
memory-mapped; file f contributes ``len(f) // seq_len`` samples (the remainder is unused, samples
never span files); sample k is found by a binary search of the cumulative sample counts and is
the window ``tokens[j * seq_len : (j + 1) * seq_len]`` of its file, returned as
``{"input_ids": window[:-1], "labels": window[1:]}`` (int64). As in KempnerForge, ``seq_len``
counts the extra label token: pass ``seq_len + 1`` for inputs of length ``seq_len``.

With ``pack_sequences=True`` a window may hold several documents, each ending with
``eos_token_id``: ``doc_ids`` numbers the documents of the window (0 from its first token, +1
after every EOS) and ``labels`` is -100 where the input token and its label belong to different
documents (that is, where the input token is an EOS), which ``CrossEntropyLoss`` ignores. This is
computed with a cumulative sum, not KempnerForge's per-token Python loop.

Formats (``formats/token_dir.py``): ``.npy`` files carry their dtype; raw ``.bin`` files need
``dtype=``, a ``tokenmill.json`` sidecar, or ``guess_dtype=True`` (KempnerForge's file-size
guess, which tokenmill never applies on its own).

Cost: construction maps every file (O(files)); a sample is one binary search, one slice and one
copy to int64 (plus one cumulative sum with packing).
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import Dataset

from tokenmill.formats.token_dir import list_token_files, open_token_file

__all__ = ["IGNORE_INDEX", "MemoryMappedDataset", "packed_sample"]

IGNORE_INDEX = -100


def packed_sample(window: npt.NDArray[np.int64], eos_token_id: int) -> dict[str, Any]:
    """``input_ids``, ``labels`` (-100 across document boundaries) and ``doc_ids`` of a window."""
    import torch

    is_eos = window == eos_token_id
    doc_ids = np.zeros(window.shape[0], dtype=np.int64)
    np.cumsum(is_eos[:-1], out=doc_ids[1:])
    labels = window[1:].copy()
    labels[doc_ids[:-1] != doc_ids[1:]] = IGNORE_INDEX
    return {
        "input_ids": torch.from_numpy(window[:-1]),
        "labels": torch.from_numpy(labels),
        "doc_ids": torch.from_numpy(doc_ids[:-1]),
    }


class MemoryMappedDataset(Dataset):  # type: ignore[misc]
    """Fixed windows over a sorted directory of token files (KempnerForge's layout).

    Args:
        data_dir: the directory.
        seq_len: tokens per window, including the extra label token (>= 2).
        file_pattern: glob pattern of the files, ``"*.npy"`` or ``"*.bin"`` for raw files.
        pack_sequences: return ``doc_ids`` and mask labels across documents.
        eos_token_id: the EOS token, required by ``pack_sequences``.
        dtype: the dtype of raw files (see ``formats/token_dir.py``).
        guess_dtype: allow KempnerForge's size guess for raw files without a dtype.

    Raises:
        FileNotFoundError: no file matches.
        ValueError: ``seq_len < 2`` or packing without ``eos_token_id``.
        DataFormatError: a file is not a 1-D integer token array or its dtype is ambiguous.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        seq_len: int,
        file_pattern: str = "*.npy",
        pack_sequences: bool = False,
        eos_token_id: int | None = None,
        *,
        dtype: npt.DTypeLike | None = None,
        guess_dtype: bool = False,
    ) -> None:
        self.seq_len = operator.index(seq_len)
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (it includes the label token), got {seq_len}")
        if pack_sequences and eos_token_id is None:
            raise ValueError("eos_token_id is required when pack_sequences=True")
        self.data_dir = os.fspath(data_dir)
        self.file_pattern = file_pattern
        self.pack_sequences = pack_sequences
        self.eos_token_id = eos_token_id
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.guess_dtype = guess_dtype
        self.files: list[Path] = list_token_files(data_dir, file_pattern)
        self._open()
        self._epoch = 0

    def _open(self) -> None:
        self._arrays = [
            open_token_file(path, self.dtype, guess_dtype=self.guess_dtype) for path in self.files
        ]
        counts = np.array([a.shape[0] // self.seq_len for a in self._arrays], dtype=np.int64)
        self.cumulative_samples = np.zeros(len(self._arrays) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.cumulative_samples[1:])
        self.total_tokens = int(sum(a.shape[0] for a in self._arrays))

    def __len__(self) -> int:
        return int(self.cumulative_samples[-1])

    def locate(self, idx: int) -> tuple[int, int]:
        """(file index, first token) of sample ``idx``.

        Raises:
            IndexError: ``idx`` is outside ``[0, len(self))``.
        """
        index = operator.index(idx)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.data_dir}: sample {index} out of range [0, {len(self)})")
        file = int(np.searchsorted(self.cumulative_samples, index, side="right")) - 1
        return file, (index - int(self.cumulative_samples[file])) * self.seq_len

    def __getitem__(self, idx: int) -> dict[str, Any]:
        import torch

        file, start = self.locate(idx)
        window = self._arrays[file][start : start + self.seq_len].astype(np.int64)
        if self.pack_sequences:
            assert self.eos_token_id is not None  # checked in __init__
            return packed_sample(window, self.eos_token_id)
        tensor = torch.from_numpy(window)
        return {"input_ids": tensor[:-1], "labels": tensor[1:]}

    def state_dict(self) -> dict[str, int]:
        """KempnerForge's state: ``epoch`` and ``total_samples`` (positions live in the sampler)."""
        return {"epoch": self._epoch, "total_samples": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the epoch (KempnerForge's behaviour)."""
        self._epoch = int(state.get("epoch", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_arrays"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()
