"""The streaming parquet loader: nanochat's striding and batching, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tokenmill.errors import DataFormatError
from tokenmill.tokenize.streaming import ParquetTokenLoader, ParquetTokenStream
from tokenmill.tokenize.tokenizers import ByteTokenizer, TokenizerSpec

B, T = 2, 8


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    """Two files of 4 and 3 row groups; every document is unique text."""
    paths = []
    for number, groups in enumerate((4, 3)):
        texts = [f"f{number}d{i}:" + "xyz"[i % 3] * (i % 7) for i in range(groups * 5)]
        path = tmp_path / f"shard{number}.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=5)
        paths.append(str(path))
    return paths


def reference_stream(files: list[str], slot: int, readers: int, epochs: int) -> np.ndarray:
    """A reader's tokens, straight from the definition: its row groups in order, BOS + bytes."""
    tokens: list[int] = []
    for _ in range(epochs):
        for path in files:
            parquet = pq.ParquetFile(path)
            for group in range(slot, parquet.metadata.num_row_groups, readers):
                for text in parquet.read_row_group(group).column("text").to_pylist():
                    tokens.extend([ByteTokenizer.BOS, *text.encode("utf-8")])
    return np.asarray(tokens, dtype=np.int64)


def take(loader: ParquetTokenLoader, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_follow_the_striding_rule(files: list[str], num_workers: int) -> None:
    for rank in range(2):
        loader = ParquetTokenLoader(
            files, B, T, "bytes", num_workers=num_workers, rank=rank, world_size=2,
            tokenizer_batch_size=3, threads=2, loop=True,
        )  # fmt: skip
        readers = loader.stream.readers
        batches = take(loader, 12)
        need = B * T + 1
        per_rank = max(1, num_workers)
        for position, (inputs, targets) in enumerate(batches):
            local = position % per_rank  # the DataLoader's round robin
            slot = rank * per_rank + local
            stream = reference_stream(files, slot, readers, epochs=8)
            index = position // per_rank
            expected = stream[index * need : (index + 1) * need]
            assert inputs.dtype == torch.int64 and inputs.shape == (B, T)
            assert inputs.flatten().tolist() == expected[:-1].tolist()
            assert targets.flatten().tolist() == expected[1:].tolist()


@pytest.mark.parametrize(("num_workers", "before"), [(0, 1), (0, 9), (2, 3), (2, 10)])
def test_state_dict_resumes_exactly(files: list[str], num_workers: int, before: int) -> None:
    def make() -> ParquetTokenLoader:
        return ParquetTokenLoader(
            files, B, T, TokenizerSpec("bytes"), num_workers=num_workers, rank=1, world_size=2,
            tokenizer_batch_size=4, threads=2,
        )  # fmt: skip

    loader = make()
    iterator = iter(loader)
    for _ in range(before):
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint stores
    expected = [next(iterator) for _ in range(25)]  # crosses epochs on this small data
    resumed = make()
    resumed.load_state_dict(state)
    found = take(resumed, 25)
    for (a_in, a_out), (b_in, b_out) in zip(expected, found):
        assert torch.equal(a_in, b_in) and torch.equal(a_out, b_out)
    assert max(p["epoch"] for p in resumed.state_dict()["positions"].values()) >= 1


def test_one_pass_covers_every_document_once(files: list[str]) -> None:
    """Across ranks and workers, one pass reads every row group exactly once."""
    from collections import Counter

    seen: Counter[int] = Counter()
    batches = 0
    for rank in range(2):
        loader = ParquetTokenLoader(
            files, 1, 1, "bytes", num_workers=2, rank=rank, world_size=2, loop=False
        )
        for inputs, targets in loader:
            seen.update([int(inputs), int(targets)])
            batches += 1
    streams = [reference_stream(files, slot, 4, 1) for slot in range(4)]
    assert batches == sum(len(stream) // 2 for stream in streams)
    expected: Counter[int] = Counter()
    for stream in streams:
        expected.update(stream.tolist())
    assert not seen - expected  # nothing read twice or invented
    assert sum((expected - seen).values()) <= 4  # at most each reader's final odd token dropped
    assert seen[ByteTokenizer.BOS] >= expected[ByteTokenizer.BOS] - 4


def test_errors_name_the_problem(files: list[str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"8 readers \(2 ranks x 4 workers\) but the largest"):
        ParquetTokenStream(files, B, T, TokenizerSpec(), num_workers=4, rank=0, world_size=2)
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "other.parquet")
    with pytest.raises(DataFormatError, match=r"other.parquet: no column 'text'"):
        ParquetTokenLoader([str(tmp_path / "other.parquet")], B, T)
    with pytest.raises(FileNotFoundError, match=r"parquet file not found: .*missing.parquet"):
        ParquetTokenLoader([str(tmp_path / "missing.parquet")], B, T)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ParquetTokenLoader(files, 0, T)
    loader = ParquetTokenLoader(files, B, T, rank=0, world_size=2)
    take(loader, 2)
    state = loader.state_dict()
    other = ParquetTokenLoader(files, B, T + 1, rank=0, world_size=2)
    with pytest.raises(ValueError, match="state_dict has sequence_length=8 but this loader has"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict is rank 0's, this is rank 1"):
        ParquetTokenLoader(files, B, T, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict version must be 1, got 7"):
        loader.load_state_dict({**state, "version": 7})
    broken = {**state, "positions": {"0": {"epoch": 0}}}
    with pytest.raises(ValueError, match="state_dict position of reader 0 is malformed"):
        loader.load_state_dict(broken)
    stream = ParquetTokenStream(files, B, T, TokenizerSpec(), num_workers=2, rank=0, world_size=1)
    wrong = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="built for num_workers=2 but runs in a DataLoader with 1"):
        next(iter(wrong))
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(DataFormatError, match=r"null.parquet: row group 0, row 1: column 'text'"):
        take(ParquetTokenLoader([str(tmp_path / "null.parquet")], 1, 1), 2)


def test_batches_are_plain_memory_on_cpu_and_move_to_a_device(files: list[str]) -> None:
    loader = ParquetTokenLoader(files, B, T, "bytes", rank=0, world_size=1, device="cpu")
    inputs, targets = take(loader, 1)[0]
    assert inputs.device.type == "cpu" and targets.device.type == "cpu"
    if not torch.cuda.is_available():
        assert not loader.pin_memory and not inputs.is_pinned()
