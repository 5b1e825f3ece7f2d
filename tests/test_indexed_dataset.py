"""Round trips, edge cases and error reporting of the Megatron ``.bin/.idx`` reader and writer."""

from __future__ import annotations

import errno
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmill.errors import DataFormatError
from tokenmill.formats.megatron import (
    HEADER_SIZE,
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

ALL_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]

Documents = list[list[list[int]]]  # document -> sequences -> tokens


def write(
    prefix: Path,
    documents: Documents,
    dtype: Any = np.int32,
    multimodal: bool = False,
    use_add_document: bool = False,
) -> None:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for document_number, document in enumerate(documents):
        if use_add_document:
            tokens = [token for sequence in document for token in sequence]
            modes = [(document_number + k) % 3 for k in range(len(document))]
            builder.add_document(
                np.array(tokens, dtype=np.int64), [len(s) for s in document], modes=modes
            )
        else:
            for k, sequence in enumerate(document):
                builder.add_item(np.array(sequence, dtype=np.int64), mode=(document_number + k) % 3)
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


def flatten(documents: Documents) -> list[list[int]]:
    return [sequence for document in documents for sequence in document]


def boundaries(documents: Documents) -> list[int]:
    result = [0]
    for document in documents:
        result.append(result[-1] + len(document))
    return result


DOCUMENTS: Documents = [[[1, 2, 3]], [[4], [5, 6], []], [], [[7, 8, 9, 10]]]


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    prefix = tmp_path / "shard"
    write(prefix, DOCUMENTS)
    return prefix


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_the_index_reader_logs_megatrons_lines_only_when_they_are_kept(
    tmp_path: Path, multimodal: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """megatron-core's lines and timings of an `.idx` load, at its levels and under its logger
    name, when that logger keeps them; with its default level (WARNING) nothing, and the arrays
    are the same either way."""
    import logging

    prefix = tmp_path / "shard"
    write(prefix, DOCUMENTS, multimodal=multimodal)
    name = "megatron.core.datasets.indexed_dataset"
    with caplog.at_level(logging.WARNING, logger=name):
        quiet = IndexedDataset(str(prefix), multimodal=multimodal)
    assert [r for r in caplog.records if r.name == name] == []
    with caplog.at_level(logging.DEBUG, logger=name):
        logged = IndexedDataset(str(prefix), multimodal=multimodal)
    lines = [r.getMessage() for r in caplog.records if r.name == name]
    extracts = ["sequence lengths", "sequence pointers", "document indices"]
    extracts += ["sequence modes"] if multimodal else []
    expected = [f"\tExtract the {extract}" for extract in extracts]
    assert [line for line in lines if line.startswith("\tExtract")] == expected
    assert sum(line.startswith("\t> time elapsed:") for line in lines) == len(extracts)
    assert lines[0] == f"Load the _IndexReader from {prefix}.idx"
    assert "> total number of sequences: 5" in lines
    assert "> total number of documents: 4" in lines
    for attribute in ("sequence_lengths", "sequence_pointers", "document_indices"):
        np.testing.assert_array_equal(
            getattr(quiet.index, attribute), getattr(logged.index, attribute)
        )
    if multimodal:
        np.testing.assert_array_equal(quiet.index.sequence_modes, logged.index.sequence_modes)
    else:
        assert quiet.index.sequence_modes is None and logged.index.sequence_modes is None


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize("use_add_document", [False, True], ids=["add_item", "add_document"])
def test_round_trip(tmp_path: Path, mmap: bool, use_add_document: bool) -> None:
    prefix = tmp_path / "data"
    write(prefix, DOCUMENTS, use_add_document=use_add_document)
    dataset = IndexedDataset(str(prefix), mmap=mmap)
    sequences = flatten(DOCUMENTS)
    assert len(dataset) == len(sequences)
    assert dataset.dtype is np.int32
    assert dataset.index.dtype is np.int32
    for i, expected in enumerate(sequences):
        assert dataset[i].tolist() == expected
        assert dataset[i].dtype == np.int32
    assert dataset.document_indices.tolist() == boundaries(DOCUMENTS)
    assert dataset.get_document_indices().tolist() == boundaries(DOCUMENTS)
    assert dataset.sequence_lengths.tolist() == [len(s) for s in sequences]
    expected_pointers = np.concatenate([[0], np.cumsum([len(s) for s in sequences])[:-1]]) * 4
    assert dataset.sequence_pointers.tolist() == expected_pointers.tolist()
    assert os.path.getsize(f"{prefix}.bin") == 4 * sum(len(s) for s in sequences)


def test_mmap_items_are_read_only_views_and_pread_items_are_owned(shard: Path) -> None:
    mapped = IndexedDataset(str(shard), mmap=True)[0]
    assert not mapped.flags.writeable
    assert mapped.base is not None
    read = IndexedDataset(str(shard), mmap=False)[0]
    assert read.flags.writeable
    assert read.flags.owndata


def test_empty_dataset(tmp_path: Path) -> None:
    prefix = tmp_path / "empty"
    IndexedDatasetBuilder(f"{prefix}.bin").finalize(f"{prefix}.idx")
    for mmap in (True, False):
        dataset = IndexedDataset(str(prefix), mmap=mmap)
        assert len(dataset) == 0
        assert dataset.document_indices.tolist() == [0]
        assert dataset[:] == []
    assert os.path.getsize(f"{prefix}.idx") == HEADER_SIZE + 8


def test_only_empty_documents(tmp_path: Path) -> None:
    prefix = tmp_path / "empties"
    write(prefix, [[], [[]], []])
    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == 1
    assert dataset[0].tolist() == []
    assert dataset.get(0).tolist() == []
    assert dataset.document_indices.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_dtype_boundary_values(tmp_path: Path, dtype: Any, mmap: bool) -> None:
    prefix = tmp_path / "bounds"
    if np.dtype(dtype).kind == "f":
        info_f = np.finfo(dtype)
        values = np.array([info_f.min, -1.5, 0.0, info_f.tiny, info_f.max], dtype=dtype)
    else:
        info_i = np.iinfo(dtype)
        values = np.array([info_i.min, 0, 1, info_i.max], dtype=dtype)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    builder.add_item(values)
    builder.end_document()
    builder.finalize(f"{prefix}.idx")
    dataset = IndexedDataset(str(prefix), mmap=mmap)
    assert np.array_equal(dataset[0], values)
    assert dataset[0].dtype == np.dtype(dtype)
    with open(f"{prefix}.idx", "rb") as stream:
        assert stream.read(HEADER_SIZE)[17] == DType.code_from_dtype(dtype)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.uint16])
def test_out_of_range_tokens_are_refused(tmp_path: Path, dtype: Any) -> None:
    info = np.iinfo(dtype)
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=dtype)
    for bad in (int(info.max) + 1, int(info.min) - 1):
        with pytest.raises(OverflowError, match=rf"token {bad} does not fit {np.dtype(dtype)}"):
            builder.add_item(np.array([0, bad], dtype=np.int64))
        with pytest.raises(OverflowError, match=str(tmp_path / "x.bin")):
            builder.add_document([bad], [1])
    builder.add_item(np.array([info.min, info.max], dtype=np.int64))
    builder.end_document()
    builder.finalize(str(tmp_path / "x.idx"))
    assert IndexedDataset(str(tmp_path / "x"))[0].tolist() == [info.min, info.max]


def test_fractional_floats_and_non_numbers_are_refused(tmp_path: Path) -> None:
    """numpy.array(x, dtype) would truncate 1.5 to 1; tokenmill refuses it (integral floats and
    digit strings are accepted: see test_indexed_dataset_megatron.py)."""
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"tokens must be whole numbers .* got 1\.5"):
        builder.add_item(np.array([1.0, 1.5]))
    with pytest.raises(ValueError, match=r"x\.bin"):
        builder.add_document([1.5], [1])
    with pytest.raises(ValueError, match="got nan"):
        builder.add_document([float("nan")], [1])
    with pytest.raises(ValueError, match="tokens are not numbers"):
        builder.add_item(np.array(["a"]))
    with pytest.raises(TypeError, match="cannot be written"):
        builder.add_item(np.array([1 + 2j]))
    builder.add_item(np.array([1.0, 2.0]))
    builder.add_item(["3", " 4"])
    builder.end_document()
    builder.finalize(str(tmp_path / "x.idx"))
    assert [item.tolist() for item in IndexedDataset(str(tmp_path / "x"))[0:2]] == [[1, 2], [3, 4]]


def test_float_overflow_and_inexact_integers_are_refused(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.float32)
    with pytest.raises(OverflowError, match="overflows float32"):
        builder.add_item(np.array([1e300]))
    with pytest.raises(OverflowError, match="16777217"):
        builder.add_item(np.array([16777217], dtype=np.int64))
    builder.add_item(np.array([16777216, -3], dtype=np.int64))
    builder.add_item([True, False])


def test_duck_typed_tensor_and_shapes(tmp_path: Path) -> None:
    class FakeTensor:
        def __init__(self, values: list[list[int]]) -> None:
            self.values = values

        def numpy(self) -> np.ndarray:
            return np.array(self.values, dtype=np.int64)

    prefix = tmp_path / "duck"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.add_item(FakeTensor([[1, 2], [3, 4]]))  # flattened in C order, as megatron does
    builder.add_item(np.int64(7))  # a 0-d array is one token
    builder.add_item([8, 9])
    builder.end_document()
    builder.add_document(FakeTensor([[10, 11]]), np.array([1, 1]))
    builder.add_document([12], (n for n in [1]))
    builder.finalize(f"{prefix}.idx")
    dataset = IndexedDataset(str(prefix))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        [1, 2, 3, 4],
        [7],
        [8, 9],
        [10],
        [11],
        [12],
    ]
    assert dataset.document_indices.tolist() == [0, 3, 5, 6]


def test_big_endian_input_is_converted(tmp_path: Path) -> None:
    prefix = tmp_path / "endian"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    builder.add_item(np.array([1, 256, -2], dtype=">i4"))
    builder.end_document()
    builder.finalize(f"{prefix}.idx")
    assert IndexedDataset(str(prefix))[0].tolist() == [1, 256, -2]


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize("use_add_document", [False, True], ids=["add_item", "add_document"])
def test_multimodal(tmp_path: Path, mmap: bool, use_add_document: bool) -> None:
    prefix = tmp_path / "mm"
    write(prefix, DOCUMENTS, dtype=np.uint8, multimodal=True, use_add_document=use_add_document)
    dataset = IndexedDataset(str(prefix), multimodal=True, mmap=mmap)
    expected_modes = [
        (d + k) % 3 for d, document in enumerate(DOCUMENTS) for k in range(len(document))
    ]
    assert dataset.sequence_modes.tolist() == expected_modes
    for i, sequence in enumerate(flatten(DOCUMENTS)):
        tokens, mode = dataset[i]
        assert tokens.tolist() == sequence
        assert isinstance(mode, np.int8)
        assert mode == expected_modes[i]
        tokens, mode = dataset.get(i, offset=0)
        assert tokens.tolist() == sequence
    sequences, modes = dataset[1:4]
    assert [s.tolist() for s in sequences] == flatten(DOCUMENTS)[1:4]
    assert modes.tolist() == expected_modes[1:4]
    # a multimodal file read without modes ignores the trailer, as megatron does
    plain = IndexedDataset(str(prefix))
    assert plain[0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="multimodal=True"):
        _ = plain.sequence_modes


def test_add_document_multimodal_defaults_modes_to_zero(tmp_path: Path) -> None:
    prefix = tmp_path / "mm0"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int16, multimodal=True)
    builder.add_document([1, 2, 3], [2, 1])
    builder.finalize(f"{prefix}.idx")
    assert IndexedDataset(str(prefix), multimodal=True).sequence_modes.tolist() == [0, 0]


def test_add_document_checks_lengths_and_modes(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), multimodal=True)
    with pytest.raises(ValueError, match="lengths sum to 2 but the document has 3 tokens"):
        builder.add_document([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        builder.add_document([1, 2, 3], [4, -1])
    with pytest.raises(ValueError, match="1 modes for 2 sequences"):
        builder.add_document([1, 2, 3], [1, 2], modes=[1])
    with pytest.raises(OverflowError, match="mode 200 does not fit int8"):
        builder.add_document([1, 2, 3], [1, 2], modes=[1, 200])
    with pytest.raises(OverflowError, match="mode -129 does not fit int8"):
        builder.add_item([1], mode=-129)
    with pytest.raises(ValueError, match="lengths must be whole numbers"):
        builder.add_document([1, 2, 3], [1.5, 1.5])
    assert len(builder.sequence_lengths) == 0  # nothing was half-added


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_slices_and_get(shard: Path, mmap: bool) -> None:
    dataset = IndexedDataset(str(shard), mmap=mmap)
    sequences = flatten(DOCUMENTS)
    for start in range(-len(sequences), len(sequences) + 1):
        for stop in range(-len(sequences), len(sequences) + 2):
            got = [s.tolist() for s in dataset[start:stop]]
            assert got == sequences[start:stop], (start, stop)
    assert [s.tolist() for s in dataset[:]] == sequences
    with pytest.raises(ValueError, match="step 2"):
        dataset[::2]
    with pytest.raises(TypeError, match="integers or slices"):
        dataset["0"]  # type: ignore[index]
    assert dataset[np.int64(-1)].tolist() == sequences[-1]
    assert dataset.get(4, offset=1).tolist() == [8, 9, 10]
    assert dataset.get(4, offset=1, length=2).tolist() == [8, 9]
    assert dataset.get(4, offset=4).tolist() == []
    assert dataset.get(np.int32(0), 0, 3).tolist() == [1, 2, 3]
    assert dataset.get(-1, length=1).tolist() == [7]


def test_index_errors(shard: Path) -> None:
    dataset = IndexedDataset(str(shard))
    count = len(dataset)
    for bad in (count, -count - 1, 10**12):
        with pytest.raises(IndexError, match=rf"sequence index {bad} out of range for {count}"):
            dataset[bad]
        with pytest.raises(IndexError, match=str(shard)):
            dataset.get(bad)
    with pytest.raises(IndexError, match=r"tokens \[2, 5\) are outside sequence 0 of length 3"):
        dataset.get(0, offset=2, length=3)
    with pytest.raises(IndexError, match=r"tokens \[-1, 3\)"):
        dataset.get(0, offset=-1)
    with pytest.raises(IndexError, match=r"tokens \[4, 3\)"):
        dataset.get(0, offset=4)


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_pickle_reopens_files(tmp_path: Path, mmap: bool, multimodal: bool) -> None:
    prefix = tmp_path / "p"
    write(prefix, DOCUMENTS, multimodal=multimodal)
    dataset = IndexedDataset(str(prefix), multimodal=multimodal, mmap=mmap)
    state = dataset.__getstate__()
    assert state == (str(prefix), multimodal, mmap, None, False, None, None)
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone.mmap == mmap
    assert clone.index is not dataset.index
    for i in range(len(dataset)):
        if multimodal:
            assert clone[i][0].tolist() == dataset[i][0].tolist()
            assert clone[i][1] == dataset[i][1]
        else:
            assert clone[i].tolist() == dataset[i].tolist()


def test_pickle_in_a_new_process(shard: Path) -> None:
    payload = pickle.dumps(IndexedDataset(str(shard), mmap=False))
    script = (
        "import pickle, sys; d = pickle.loads(sys.stdin.buffer.read()); "
        "print([d[i].tolist() for i in range(len(d))])"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], input=payload, capture_output=True, check=True
    )
    assert result.stdout.decode().strip() == str(flatten(DOCUMENTS))


def test_fast_cache_load_skips_the_header(shard: Path) -> None:
    dataset = IndexedDataset(
        str(shard), fast_cache_load=True, sequences_per_dataset=(5, 5), dtype_code=4
    )
    assert [dataset[i].tolist() for i in range(len(dataset))] == flatten(DOCUMENTS)
    # the header is not read at all: a clobbered magic goes unnoticed, as in megatron
    with open(f"{shard}.idx", "r+b") as stream:
        stream.write(b"XXXXXXXXX")
    dataset = IndexedDataset(
        str(shard), fast_cache_load=True, sequences_per_dataset=(5, 5), dtype_code=4
    )
    assert dataset[4].tolist() == [7, 8, 9, 10]
    with pytest.raises(DataFormatError, match="bad magic"):
        IndexedDataset(str(shard))
    # but wrong counts still cannot read out of bounds
    with pytest.raises(DataFormatError, match="needs"):
        IndexedDataset(str(shard), fast_cache_load=True, sequences_per_dataset=(6, 5), dtype_code=4)
    with pytest.raises(ValueError, match="needs a dtype_code"):
        IndexedDataset(str(shard), fast_cache_load=True, sequences_per_dataset=(5, 5))


def test_fast_cache_load_skips_the_boundary_scan(tmp_path: Path, shard: Path) -> None:
    corrupt_document_indices(shard, [0, 4, 2, 4, 5])
    with pytest.raises(DataFormatError):
        IndexedDataset(str(shard))
    assert len(IndexedDataset(str(shard), fast_cache_load=True)) == 5


def test_exists_and_object_storage(shard: Path) -> None:
    assert IndexedDataset.exists(str(shard))
    assert not IndexedDataset.exists(str(shard) + "-missing")
    # s3:// is served by tokenmill.storage (tests/test_s3_storage.py); msc:// is refused
    with pytest.raises(TypeError, match="path_to_idx_cache"):
        IndexedDataset("s3://bucket/data", mmap=False, object_storage_config=object())
    with pytest.raises(ValueError, match="object_storage_config"):
        IndexedDataset("s3://bucket/data")
    prefix = "msc://profile/data"
    with pytest.raises(NotImplementedError, match=prefix):
        IndexedDataset(prefix, mmap=False, object_storage_config=object())
    with pytest.raises(NotImplementedError, match=prefix):
        IndexedDataset.exists(prefix)


def test_public_api_is_lazy_and_torch_free() -> None:
    script = (
        "import sys, tokenmill; assert 'torch' not in sys.modules; "
        "assert 'tokenmill.formats.megatron' not in sys.modules; "
        "tokenmill.IndexedDataset; assert 'torch' not in sys.modules; "
        "assert tokenmill.DType is tokenmill.formats.megatron.DType"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


# --- DType --------------------------------------------------------------------------------------


def test_dtype_codes() -> None:
    for code, dtype in enumerate(ALL_DTYPES, start=1):
        assert DType.code_from_dtype(dtype) == code
        assert DType.code_from_dtype(np.dtype(dtype)) == code
        assert DType.dtype_from_code(code) is dtype
        assert DType.size(code) == np.dtype(dtype).itemsize
        assert DType.size(dtype) == np.dtype(dtype).itemsize
    assert DType.optimal_dtype(65499) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(None) is np.int32
    with pytest.raises(ValueError, match="unknown megatron dtype code 9"):
        DType.dtype_from_code(9)
    with pytest.raises(ValueError, match="uint32 has no megatron code"):
        DType.code_from_dtype(np.uint32)
    with pytest.raises(ValueError, match="uint64"):
        IndexedDatasetBuilder("/nonexistent-dir/x.bin", dtype=np.uint64)


# --- writer atomicity ---------------------------------------------------------------------------


def test_nothing_appears_before_finalize(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    assert not (tmp_path / "a.bin").exists()
    builder.finalize(str(tmp_path / "a.idx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.idx"]
    (tmp_path / "plain").write_bytes(b"")
    plain_mode = (tmp_path / "plain").stat().st_mode
    assert (tmp_path / "a.bin").stat().st_mode == plain_mode  # not mkstemp's 0600
    assert (tmp_path / "a.idx").stat().st_mode == plain_mode
    with pytest.raises(ValueError, match="already finalized"):
        builder.add_item([3])


def test_abandoned_builder_leaves_nothing(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "a.bin"))
    builder.add_item([1, 2])
    del builder
    assert list(tmp_path.iterdir()) == []


def test_builder_in_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing/a\.bin"):
        IndexedDatasetBuilder(str(tmp_path / "missing" / "a.bin"))


def test_failed_merge_leaves_the_builder_consistent(
    tmp_path: Path, shard: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.formats import megatron_builder

    def failing_copy(source: int, destination: int, size: int, offset: int) -> None:
        os.pwrite(destination, b"partial", offset)
        raise OSError("disk full")

    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"))
    builder.add_document([1, 2], [2])
    with monkeypatch.context() as patch:
        patch.setattr(megatron_builder, "_copy_file", failing_copy)
        with pytest.raises(OSError, match="disk full"):
            builder.add_index(str(shard))
    builder.add_index(str(shard))
    builder.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], *flatten(DOCUMENTS)]


def test_finalize_refuses_an_unterminated_document(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "a.bin"))
    builder.add_item([1, 2])
    with pytest.raises(ValueError, match="1 sequences were added after the last document"):
        builder.finalize(str(tmp_path / "a.idx"))
    builder.end_document()
    builder.finalize(str(tmp_path / "a.idx"))


# --- add_index ------------------------------------------------------------------------------------


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_add_index_merges(tmp_path: Path, multimodal: bool) -> None:
    parts: list[Documents] = [DOCUMENTS, [], [[[11, 12]], []], DOCUMENTS[:2]]
    for number, documents in enumerate(parts):
        write(tmp_path / f"part{number}", documents, dtype=np.int16, multimodal=multimodal)
    merged = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), np.int16, multimodal)
    merged.add_item([99], mode=1)
    merged.end_document()
    for number in range(len(parts)):
        merged.add_index(str(tmp_path / f"part{number}"))
    merged.add_document([100, 101], [2], modes=[2])
    merged.finalize(str(tmp_path / "merged.idx"))

    direct = IndexedDatasetBuilder(str(tmp_path / "direct.bin"), np.int16, multimodal)
    direct.add_item([99], mode=1)
    direct.end_document()
    for documents in parts:
        for d, document in enumerate(documents):
            for k, sequence in enumerate(document):
                direct.add_item(sequence, mode=(d + k) % 3)
            direct.end_document()
    direct.add_document([100, 101], [2], modes=[2])
    direct.finalize(str(tmp_path / "direct.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (
            tmp_path / f"direct{suffix}"
        ).read_bytes()


def test_add_index_dtype_mismatch(tmp_path: Path, shard: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    with pytest.raises(DataFormatError, match=r"shard\.idx: dtype int32 does not match.*uint16"):
        builder.add_index(str(shard))


def test_add_index_missing_and_corrupt_sources(tmp_path: Path, shard: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"))
    with pytest.raises(FileNotFoundError, match=r"nope\.idx"):
        builder.add_index(str(tmp_path / "nope"))
    with open(f"{shard}.bin", "ab") as stream:
        stream.write(b"\0\0\0\0")
    with pytest.raises(DataFormatError, match=r"shard\.bin: data file is 44 bytes"):
        builder.add_index(str(shard))
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    assert len(IndexedDataset(str(tmp_path / "m"))) == 0


# --- bad input ------------------------------------------------------------------------------------


def corrupt_document_indices(prefix: Path, values: list[int]) -> None:
    data = bytearray(Path(f"{prefix}.idx").read_bytes())
    sequence_count, document_count = struct.unpack_from("<QQ", data, 18)
    assert document_count == len(values)
    offset = HEADER_SIZE + 12 * sequence_count
    struct.pack_into(f"<{len(values)}q", data, offset, *values)
    Path(f"{prefix}.idx").write_bytes(bytes(data))


def patch_index(prefix: Path, offset: int, fmt: str, value: int) -> None:
    data = bytearray(Path(f"{prefix}.idx").read_bytes())
    struct.pack_into(fmt, data, offset, value)
    Path(f"{prefix}.idx").write_bytes(bytes(data))


def test_missing_files(shard: Path) -> None:
    os.remove(f"{shard}.bin")
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*shard\.bin"):
        IndexedDataset(str(shard))
    os.remove(f"{shard}.idx")
    with pytest.raises(FileNotFoundError, match=r"index file not found: .*shard\.idx"):
        IndexedDataset(str(shard))


def test_bad_magic(shard: Path) -> None:
    patch_index(shard, 0, "<9s", b"\0" * 9)
    with pytest.raises(DataFormatError, match=r"shard\.idx: bad magic b'\\x00"):
        IndexedDataset(str(shard))


def test_bad_version(shard: Path) -> None:
    patch_index(shard, 9, "<Q", 2)
    with pytest.raises(DataFormatError, match=r"shard\.idx: unsupported index version 2"):
        IndexedDataset(str(shard))


@pytest.mark.parametrize("code", [0, 9, 255])
def test_unknown_dtype_code(shard: Path, code: int) -> None:
    patch_index(shard, 17, "<B", code)
    with pytest.raises(DataFormatError, match=rf"shard\.idx: unknown dtype code {code}"):
        IndexedDataset(str(shard))


def test_index_shorter_than_header(shard: Path) -> None:
    Path(f"{shard}.idx").write_bytes(b"MMIDIDX\x00\x00\x01")
    with pytest.raises(DataFormatError, match=r"shard\.idx: index is 10 bytes, shorter than"):
        IndexedDataset(str(shard))


@pytest.mark.parametrize("removed", [1, 8, 60])
def test_index_shorter_than_its_arrays(shard: Path, removed: int) -> None:
    data = Path(f"{shard}.idx").read_bytes()
    Path(f"{shard}.idx").write_bytes(data[:-removed])
    with pytest.raises(DataFormatError, match=rf"index is {len(data) - removed} bytes .* needs"):
        IndexedDataset(str(shard))


def test_huge_counts_in_header(shard: Path) -> None:
    patch_index(shard, 18, "<Q", 2**62)
    with pytest.raises(DataFormatError, match=str(2**62)):
        IndexedDataset(str(shard))


def test_multimodal_read_of_a_text_index(shard: Path) -> None:
    with pytest.raises(DataFormatError, match="multimodal"):
        IndexedDataset(str(shard), multimodal=True)


def test_trailing_garbage_in_index(shard: Path) -> None:
    with open(f"{shard}.idx", "ab") as stream:
        stream.write(b"\0")
    with pytest.raises(DataFormatError, match=r"index is \d+ bytes"):
        IndexedDataset(str(shard))


@pytest.mark.parametrize("delta", [-4, -1, 1, 4])
def test_bin_size_mismatch(shard: Path, delta: int) -> None:
    data = Path(f"{shard}.bin").read_bytes()
    Path(f"{shard}.bin").write_bytes(data + b"\0" * delta if delta > 0 else data[:delta])
    with pytest.raises(DataFormatError, match=rf"shard\.bin: data file is {40 + delta} bytes"):
        IndexedDataset(str(shard))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, 1, 4, 4, 5], "must start at 0, got 1"),
        ([0, 1, 4, 4, 4], "must end at the sequence count 5, got 4"),
        (
            [0, 4, 1, 4, 5],
            r"must be non-decreasing, but document_indices\[1\] = 4 > document_indices\[2\]",
        ),
    ],
)
def test_inconsistent_document_indices(shard: Path, values: list[int], message: str) -> None:
    corrupt_document_indices(shard, values)
    with pytest.raises(DataFormatError, match=rf"shard\.idx: document_indices {message}"):
        IndexedDataset(str(shard))


def test_empty_document_indices(shard: Path) -> None:
    data = bytearray(Path(f"{shard}.idx").read_bytes())
    struct.pack_into("<Q", data, 26, 0)
    Path(f"{shard}.idx").write_bytes(bytes(data[: HEADER_SIZE + 12 * 5]))
    with pytest.raises(DataFormatError, match="document_indices is empty"):
        IndexedDataset(str(shard))


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_corrupt_pointer_never_reads_out_of_bounds(shard: Path, mmap: bool) -> None:
    pointer_offset = HEADER_SIZE + 4 * 5
    patch_index(shard, pointer_offset + 8, "<q", 10**9)  # sequence 1
    patch_index(shard, pointer_offset + 16, "<q", 2)  # sequence 2, off the 4-byte grid
    patch_index(shard, HEADER_SIZE + 12, "<i", -5)  # length of sequence 3
    # refused on open by the structural check every reader shares
    with pytest.raises(DataFormatError, match=r"shard\.idx: sequence_lengths\[3\] = -5"):
        IndexedDataset(str(shard), mmap=mmap)
    # fast_cache_load skips that scan (as megatron does); every access is still bounds-checked
    dataset = IndexedDataset(str(shard), mmap=mmap, fast_cache_load=True)
    assert dataset[0].tolist() == [1, 2, 3]
    for sequence in (1, 2):
        with pytest.raises(DataFormatError, match=rf"shard\.bin: sequence {sequence} points at"):
            dataset[sequence]
    with pytest.raises(IndexError, match="sequence 3 of length -5"):
        dataset.get(3)
    with pytest.raises(DataFormatError, match="sequence 1 points at"):
        dataset[1:3]
    with pytest.raises(DataFormatError, match="sequence 3 has length -5"):
        dataset[3:]


def test_pread_detects_truncation_after_open(shard: Path) -> None:
    dataset = IndexedDataset(str(shard), mmap=False)
    os.truncate(f"{shard}.bin", 30)
    with pytest.raises(
        DataFormatError, match="data file ended at byte 30 while reading sequence 4"
    ):
        dataset[4]


# --- properties ------------------------------------------------------------------------------


documents_strategy = st.lists(
    st.lists(st.lists(st.integers(0, 65535), max_size=6), max_size=4), max_size=6
)


@settings(deadline=None, max_examples=40)
@given(
    documents=documents_strategy,
    dtype=st.sampled_from([np.uint16, np.int32, np.int64, np.float32]),
    multimodal=st.booleans(),
    use_add_document=st.booleans(),
    mmap=st.booleans(),
)
def test_random_documents_round_trip(
    tmp_path_factory: pytest.TempPathFactory,
    documents: Documents,
    dtype: Any,
    multimodal: bool,
    use_add_document: bool,
    mmap: bool,
) -> None:
    prefix = tmp_path_factory.mktemp("hypothesis") / "data"
    write(prefix, documents, dtype, multimodal, use_add_document)
    dataset = IndexedDataset(str(prefix), multimodal=multimodal, mmap=mmap)
    sequences = flatten(documents)
    assert len(dataset) == len(sequences)
    assert dataset.document_indices.tolist() == boundaries(documents)
    items = dataset[:]
    got = items[0] if multimodal else items
    assert [s.tolist() for s in got] == sequences
    for i, sequence in enumerate(sequences):
        item = dataset.get(i, offset=len(sequence) // 2)
        tokens = item[0] if multimodal else item
        assert tokens.tolist() == sequence[len(sequence) // 2 :]


@st.composite
def _index_arrays(draw: Any) -> tuple[list[int], list[int], list[int], int]:
    """A consistent .idx's arrays, then a few random corruptions of them."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    lengths = draw(st.lists(st.integers(0, 50), max_size=12))
    pointers = [0]
    for length in lengths[:-1]:
        pointers.append(pointers[-1] + length * itemsize)
    pointers = pointers[: len(lengths)]
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=5)))
    boundaries = [0, *cuts, len(lengths)]
    for _ in range(draw(st.integers(0, 3))):
        which = draw(st.sampled_from(["length", "pointer", "boundary", "drop"]))
        if which == "length" and lengths:
            lengths[draw(st.integers(0, len(lengths) - 1))] = draw(st.integers(-(2**31), 2**31 - 1))
        elif which == "pointer" and pointers:
            pointers[draw(st.integers(0, len(pointers) - 1))] = draw(
                st.integers(-(2**63), 2**63 - 1)
            )
        elif which == "boundary" and boundaries:
            boundaries[draw(st.integers(0, len(boundaries) - 1))] = draw(st.integers(-5, 20))
        elif which == "drop":
            boundaries = boundaries[: draw(st.integers(0, len(boundaries)))]
    return lengths, pointers, boundaries, itemsize


@settings(max_examples=400, deadline=None)
@given(_index_arrays())
def test_index_check_kernel_matches_its_reference(
    arrays: tuple[list[int], list[int], list[int], int],
) -> None:
    from tokenmill import _core

    from reference import index_violation_reference

    lengths, pointers, boundaries, itemsize = arrays
    verdict = _core.check_megatron_index_arrays(
        np.array(lengths, dtype=np.int32),
        np.array(pointers, dtype=np.int64),
        np.array(boundaries, dtype=np.int64),
        itemsize,
    )
    assert verdict == index_violation_reference(lengths, pointers, boundaries, itemsize)


def test_index_check_reads_unaligned_arrays_and_catches_offset_overflow() -> None:
    from tokenmill import _core

    # the arrays of a .idx sit at odd offsets of its map (a 34-byte header)
    raw = bytearray(1 + 4 * 3 + 8 * 3 + 8 * 2)
    lengths = np.frombuffer(raw, dtype="<i4", count=3, offset=1)
    assert lengths.ctypes.data % 4 != 0
    source = np.ndarray(3, dtype=np.int32, buffer=raw, offset=1)
    source[:] = [2**31 - 1, 2**31 - 1, 1]
    pointers = np.ndarray(3, dtype=np.int64, buffer=raw, offset=13)
    pointers[:] = [0, (2**31 - 1) * 8, 2**62]
    boundaries = np.ndarray(2, dtype=np.int64, buffer=raw, offset=37)
    boundaries[:] = [0, 3]
    assert _core.check_megatron_index_arrays(lengths, pointers, boundaries, 8)[:3] == (
        3,
        2,
        (2**31 - 1) * 16,
    )
    pointers[2] = (2**31 - 1) * 16
    assert _core.check_megatron_index_arrays(lengths, pointers, boundaries, 8) == (
        0, 0, 0, (2**31 - 1) * 16 + 8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"itemsize must be 1\.\.8 bytes, got 16"):
        _core.check_megatron_index_arrays(lengths, pointers, boundaries, 16)
    with pytest.raises(TypeError, match="sequence_lengths must have dtype int32"):
        _core.check_megatron_index_arrays(pointers, pointers, boundaries, 8)


def _maps_of(path: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(path))


def test_the_bin_is_mapped_on_its_first_read(shard: Path) -> None:
    """Opening costs a stat of the .bin; the map (no descriptor kept) comes with the first read,
    so a blend of thousands of sources maps only the sources it reads."""
    bin_path = os.path.realpath(f"{shard}.bin")
    dataset = IndexedDataset(str(shard))
    assert _maps_of(bin_path) == 0
    first = np.array(dataset[0])
    assert _maps_of(bin_path) == 1
    np.testing.assert_array_equal(dataset[0], first)
    assert _maps_of(bin_path) == 1  # mapped once
    reopened = pickle.loads(pickle.dumps(dataset))
    np.testing.assert_array_equal(reopened[0], first)


def test_a_bin_that_shrinks_before_its_first_read_is_an_error(shard: Path) -> None:
    dataset = IndexedDataset(str(shard))
    size = os.path.getsize(f"{shard}.bin")
    os.truncate(f"{shard}.bin", size - 4)
    with pytest.raises(DataFormatError, match=rf"shard\.bin: data file is {size - 4} bytes, but"):
        dataset[0]


@pytest.mark.parametrize("documents", [50, 5000], ids=["small", "large"])
def test_a_small_idx_is_read_and_a_large_one_mapped(
    tmp_path: Path, documents: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An .idx of READ_BELOW bytes or less is read into memory (one pread, no map: a blend of
    thousands of small sources would pay a map and its page faults for each); a larger one is
    mapped. The arrays are the same read-only views either way."""
    from tokenmill.common.mapping import READ_BELOW

    rng = np.random.default_rng(documents)
    sequences = [
        rng.integers(0, 1000, int(n), dtype=np.int32) for n in rng.integers(1, 9, documents)
    ]
    prefix = tmp_path / "shard"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for sequence in sequences:
        builder.add_document(sequence, lengths=[len(sequence)])
    builder.finalize(f"{prefix}.idx")
    idx_path = os.path.realpath(f"{prefix}.idx")
    small = os.path.getsize(idx_path) <= READ_BELOW
    assert small == (documents == 50)
    real_open, opens = os.open, []

    def counting(path: str, *args: Any, **kwargs: Any) -> int:
        opens.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    dataset = IndexedDataset(str(prefix))
    monkeypatch.undo()
    assert opens == []  # one open either way, by the one-call read (which hands a large one on)
    assert _maps_of(idx_path) == (0 if small else 1)
    lengths = dataset.index.sequence_lengths
    assert not lengths.flags.writeable
    np.testing.assert_array_equal(lengths, [len(sequence) for sequence in sequences])
    for number in (0, documents // 2, documents - 1):
        np.testing.assert_array_equal(dataset[number], sequences[number])


def test_read_or_map_names_a_file_shorter_than_asked(tmp_path: Path) -> None:
    from tokenmill.common.mapping import read_or_map

    path = tmp_path / "short.idx"
    path.write_bytes(b"x" * 100)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        assert bytes(read_or_map(descriptor, 100, str(path))) == b"x" * 100
        with pytest.raises(OSError, match=r"short\.idx: file ended after 100 of 200 bytes"):
            read_or_map(descriptor, 200, str(path))
        with pytest.raises(ValueError, match="cannot map 0 bytes"):
            read_or_map(descriptor, 0, str(path))
    finally:
        os.close(descriptor)


def test_a_map_outlives_its_descriptor_is_read_only_and_is_unmapped_with_its_last_view(
    tmp_path: Path,
) -> None:
    """map_readonly (the compiled core's mmap): the caller closes the descriptor at once; the
    bytes stay readable and cannot be written; the map goes when the last array viewing it is
    freed, not before."""
    import gc

    from tokenmill.common.mapping import map_readonly

    path = tmp_path / "data.bin"
    payload = bytes(range(256)) * 40
    path.write_bytes(payload)
    real = os.path.realpath(path)
    descriptor = os.open(path, os.O_RDONLY)
    view = map_readonly(descriptor, len(payload), str(path))
    os.close(descriptor)
    assert view.readonly and view.format == "B" and view.nbytes == len(payload)
    array = np.frombuffer(view, dtype=np.uint8, count=100, offset=10)
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 1
    del view
    gc.collect()
    assert _maps_of(real) == 1  # the array still views it
    assert bytes(array) == payload[10:110]
    del array
    gc.collect()
    assert _maps_of(real) == 0


def test_map_readonly_reports_a_failed_mmap_with_its_errno(tmp_path: Path) -> None:
    from tokenmill.common.mapping import map_readonly

    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    descriptor = os.open(path, os.O_RDONLY)
    os.close(descriptor)
    with pytest.raises(OSError) as raised:
        map_readonly(descriptor, 100, str(path))  # closed: EBADF, not a resource limit
    assert raised.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="cannot map 0 bytes"):
        map_readonly(descriptor, 0, str(path))
    from tokenmill import _core

    with pytest.raises(ValueError, match=r"cannot map 0 bytes"):
        _core.map_readonly(0, 0)


def test_the_interpreter_exits_cleanly_while_a_daemon_thread_runs_a_kernel_on_mapped_data(
    tmp_path: Path,
) -> None:
    """A daemon thread (a prefetcher, the blend computed ahead) may still be inside a kernel,
    without the GIL, when the main thread exits. Before Python 3.14 taking the GIL back then ends
    the thread with pthread_exit, whose unwinding through pybind11's GIL guard aborted the
    process (SIGABRT, "terminate called without an active exception"); the bindings' guard
    (ReleasedGil) parks such a thread instead. Its maps stay: it still holds their arrays."""
    rng = np.random.default_rng(11)
    prefix = tmp_path / "data"
    write(prefix, [rng.integers(1, 900, int(n)).tolist() for n in rng.integers(1, 8, 6000)])
    assert os.path.getsize(f"{prefix}.idx") > (1 << 16)  # mapped, not read
    child = textwrap.dedent(
        f"""
        import sys, threading
        import numpy as np
        from tokenmill.formats.megatron import IndexedDataset
        from tokenmill.index.gpt_index import num_tokens_per_epoch

        dataset = IndexedDataset({str(prefix)!r})
        lengths = dataset.index.sequence_lengths
        # 3 million ids: the thread spends nearly all its time in the kernel, without the GIL
        ids = np.tile(np.arange(len(lengths), dtype=np.int32), 500)
        started = threading.Event()

        def count_forever():
            while True:
                num_tokens_per_epoch(lengths, ids)
                started.set()

        threading.Thread(target=count_forever, daemon=True).start()
        started.wait()
        sys.exit(0)
        """
    )
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_the_finalizing_main_thread_still_runs_kernels(tmp_path: Path) -> None:
    """The guard parks only other threads: the main thread, finalizing the interpreter, still
    gets the GIL back after a kernel (an object freed at exit whose finalizer reads a file)."""
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 100)
    child = textwrap.dedent(
        f"""
        import os, sys
        from tokenmill import _core

        class ReadsWhenFreed:
            def __init__(self):
                # a binding that releases the GIL and needs no import (shutdown refuses those)
                self.read, self.write = _core.read_small_file, os.write

            def __del__(self):
                found = self.read({str(path)!r}, 1 << 10)[2]
                self.write(1, b"read %d bytes at exit" % len(found))  # sys.stdout may be gone

        last = ReadsWhenFreed()
        sys.exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode() == "read 100 bytes at exit", done.stderr.decode()[-2000:]
