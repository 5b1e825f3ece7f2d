"""MemoryMappedDataset: KempnerForge's windows and packing, vectorised, over .npy and raw files."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill.datasets.memory_mapped import MemoryMappedDataset
from tokenmill.errors import DataFormatError
from tokenmill.formats.token_dir import write_raw_metadata


def kempnerforge_packed(tokens: np.ndarray, eos: int) -> dict[str, list[int]]:
    """KempnerForge's _compute_packed_output, one token at a time."""
    doc_ids, doc = [], 0
    for token in tokens:
        doc_ids.append(doc)
        if token == eos:
            doc += 1
    labels = [int(t) for t in tokens[1:]]
    for i in range(len(labels)):
        if doc_ids[i] != doc_ids[i + 1]:
            labels[i] = -100
    return {"input_ids": [int(t) for t in tokens[:-1]], "labels": labels, "doc_ids": doc_ids[:-1]}


@pytest.fixture
def directory(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = []
    for i, (size, dtype) in enumerate([(103, np.uint16), (50, np.uint32), (7, np.uint16)]):
        tokens = rng.integers(0, 9, size).astype(dtype)
        np.save(tmp_path / f"part_{i}.npy", tokens)
        arrays.append(tokens)
    return tmp_path, arrays


def test_windows_are_kempnerforge(directory: tuple[Path, list[np.ndarray]]) -> None:
    path, arrays = directory
    dataset = MemoryMappedDataset(path, seq_len=10)
    assert len(dataset) == 10 + 5 + 0
    expected = [a[j * 10 : (j + 1) * 10] for a in arrays for j in range(len(a) // 10)]
    for index, window in enumerate(expected):
        sample = dataset[index]
        assert sample["input_ids"].dtype == torch.int64
        assert sample["input_ids"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
    with pytest.raises(IndexError, match="sample 15 out of range"):
        dataset[15]
    with pytest.raises(IndexError):
        dataset[-1]
    assert dataset.state_dict() == {"epoch": 0, "total_samples": 15}


def test_packing_matches_kempnerforge(directory: tuple[Path, list[np.ndarray]]) -> None:
    path, arrays = directory
    dataset = MemoryMappedDataset(path, 10, pack_sequences=True, eos_token_id=0)
    for index in range(len(dataset)):
        file, start = dataset.locate(index)
        expected = kempnerforge_packed(arrays[file][start : start + 10].astype(np.int64), 0)
        assert {k: v.tolist() for k, v in dataset[index].items()} == expected
    with pytest.raises(ValueError, match="eos_token_id is required"):
        MemoryMappedDataset(path, 10, pack_sequences=True)


def test_raw_files_need_a_dtype(tmp_path: Path) -> None:
    tokens = np.arange(40, dtype=np.uint16)
    (tmp_path / "a.bin").write_bytes(tokens.tobytes())
    with pytest.raises(DataFormatError, match=r"a\.bin.*ambiguous"):
        MemoryMappedDataset(tmp_path, 8, "*.bin")
    # KempnerForge's guess reads these 80 bytes as 20 uint32 tokens
    assert len(MemoryMappedDataset(tmp_path, 8, "*.bin", guess_dtype=True)) == 2
    assert MemoryMappedDataset(tmp_path, 8, "*.bin", dtype=np.uint16)[1]["labels"].tolist() == list(range(9, 16))  # fmt: skip
    write_raw_metadata(tmp_path, np.uint16)
    dataset = MemoryMappedDataset(tmp_path, 8, "*.bin")
    assert len(dataset) == 5
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy[4]["input_ids"].tolist() == dataset[4]["input_ids"].tolist()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        MemoryMappedDataset(tmp_path, 8)
    np.save(tmp_path / "x.npy", np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        MemoryMappedDataset(tmp_path, 1)
