"""Differential tests against megatron-core 0.19.2: the same builder calls give byte-identical
``.bin/.idx`` files, and each library reads the other's files identically."""

from __future__ import annotations

import filecmp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oracles import import_oracle

megatron = import_oracle("megatron.core.datasets.indexed_dataset")
torch = pytest.importorskip("torch")
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.formats import megatron as tokenmill

pytestmark = pytest.mark.megatron

ALL_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]

Script = Callable[[Any], None]  # a sequence of calls on a builder


def build_both(tmp_path: Path, script: Script, dtype: Any, multimodal: bool) -> tuple[Path, Path]:
    """Run the same builder calls through megatron and tokenmill; return both prefixes."""
    prefixes = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, module in (("megatron", megatron), ("tokenmill", tokenmill)):
        prefix = tmp_path / name
        builder = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
        script(builder)
        builder.finalize(f"{prefix}.idx")
        prefixes.append(prefix)
    return prefixes[0], prefixes[1]


def assert_same_files(first: Path, second: Path) -> None:
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(f"{first}{suffix}", f"{second}{suffix}", shallow=False), suffix


def assert_same_reads(prefix: Path, multimodal: bool) -> None:
    """megatron and tokenmill readers (mmap and not) return identical items for ``prefix``."""
    if Path(f"{prefix}.bin").stat().st_size == 0:
        # megatron cannot open a dataset whose .bin is empty ("cannot mmap an empty file")
        assert all(length == 0 for length in tokenmill.IndexedDataset(str(prefix)).sequence_lengths)
        return
    reference = megatron.IndexedDataset(str(prefix), multimodal=multimodal)
    for mmap in (True, False):
        dataset = tokenmill.IndexedDataset(str(prefix), multimodal=multimodal, mmap=mmap)
        assert len(dataset) == len(reference)
        assert dataset.dtype is reference.index.dtype
        assert np.array_equal(dataset.sequence_lengths, reference.sequence_lengths)
        assert np.array_equal(dataset.sequence_pointers, reference.index.sequence_pointers)
        assert np.array_equal(dataset.document_indices, reference.document_indices)
        if multimodal:
            assert np.array_equal(dataset.sequence_modes, reference.index.sequence_modes)
        for i in range(-len(reference), len(reference)):
            assert_same_item(dataset[i], reference[i], multimodal)
            length = int(reference.sequence_lengths[i])
            for offset in {0, length // 2, length}:
                assert_same_item(
                    dataset.get(i, offset=offset), reference.get(i, offset=offset), multimodal
                )
            if length:
                assert_same_item(
                    dataset.get(i, 0, length - 1), reference.get(i, 0, length - 1), multimodal
                )
        count = len(reference)
        for start, stop in [(0, count), (1, count), (0, count - 1), (count // 2, count)]:
            if start < stop:  # megatron cannot slice an empty range
                ours, theirs = dataset[start:stop], reference[start:stop]
                if multimodal:
                    assert np.array_equal(ours[1], theirs[1])
                    ours, theirs = ours[0], theirs[0]
                assert len(ours) == len(theirs)
                for mine, other in zip(ours, theirs, strict=True):
                    assert np.array_equal(mine, other)
                    assert mine.dtype == other.dtype


def assert_same_item(ours: Any, theirs: Any, multimodal: bool) -> None:
    if multimodal:
        assert ours[1] == theirs[1]
        assert type(ours[1]) is type(theirs[1])
        ours, theirs = ours[0], theirs[0]
    assert ours.dtype == theirs.dtype
    assert np.array_equal(ours, theirs, equal_nan=True)


class ArrayWithNumpy:
    """A numpy array behind the ``.numpy()`` that megatron's ``add_item`` calls (torch has no
    general uint16 support)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


def mixed_script(multimodal: bool) -> Script:
    def script(builder: Any) -> None:
        builder.add_item(torch.tensor([1, 2, 3]), mode=1)
        builder.add_item(torch.tensor([4]), mode=2)
        builder.end_document()
        builder.add_document(torch.tensor([5, 6, 7, 8, 9]), [2, 0, 3], modes=[3, 4, 5])
        builder.add_document(torch.tensor([], dtype=torch.int64), [], modes=[])  # empty document
        builder.end_document()  # another empty document
        builder.add_item(torch.tensor([], dtype=torch.int64), mode=6)  # an empty sequence
        builder.end_document()
        builder.add_document(torch.tensor([10, 11, 12]), [3], modes=[7])
        builder.add_item(torch.tensor([[13, 14], [15, 16]]))  # 2-D: flattened in C order
        builder.end_document()

    return script


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_byte_identical_files(tmp_path: Path, dtype: Any, multimodal: bool) -> None:
    first, second = build_both(tmp_path, mixed_script(multimodal), dtype, multimodal)
    assert_same_files(first, second)
    assert_same_reads(first, multimodal)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.__name__)
def test_boundary_values_and_float_tokens(tmp_path: Path, dtype: Any) -> None:
    if np.dtype(dtype).kind == "f":
        values = np.array([np.finfo(dtype).min, -0.5, 0.0, np.finfo(dtype).max], dtype=dtype)
    else:
        values = np.array([np.iinfo(dtype).min, 0, np.iinfo(dtype).max], dtype=dtype)

    def script(builder: Any) -> None:
        builder.add_item(ArrayWithNumpy(values))
        builder.end_document()
        builder.add_document(values[::-1].copy(), [1, len(values) - 1])

    first, second = build_both(tmp_path, script, dtype, False)
    assert_same_files(first, second)
    assert_same_reads(first, False)


def test_empty_builders(tmp_path: Path) -> None:
    for multimodal in (False, True):
        first, second = build_both(
            tmp_path / str(multimodal), lambda _: None, np.uint16, multimodal
        )
        assert_same_files(first, second)
        assert len(tokenmill.IndexedDataset(str(first), multimodal=multimodal)) == 0


def test_add_document_with_numpy_lengths_and_default_modes(tmp_path: Path) -> None:
    # megatron 0.19.2 computes `[0] * lengths`: a TypeError for a list, but for a numpy array it
    # broadcasts to zeros of the right length, so the two agree on this input.
    def script(builder: Any) -> None:
        builder.add_document(torch.tensor([1, 2, 3]), np.array([1, 2]))

    first, second = build_both(tmp_path, script, np.int32, True)
    assert_same_files(first, second)


def test_megatron_default_modes_bug_is_fixed(tmp_path: Path) -> None:
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), multimodal=True)
    with pytest.raises(TypeError):
        builder.add_document(torch.tensor([1, 2, 3]), [1, 2])
    builder.data_file.close()  # megatron's builder has no way to abandon a build
    ours = tokenmill.IndexedDatasetBuilder(str(tmp_path / "t.bin"), multimodal=True)
    ours.add_document(torch.tensor([1, 2, 3]), [1, 2])
    ours.finalize(str(tmp_path / "t.idx"))
    dataset = megatron.IndexedDataset(str(tmp_path / "t"), multimodal=True)
    assert dataset.index.sequence_modes.tolist() == [0, 0]


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_add_index_merges_are_identical(tmp_path: Path, multimodal: bool) -> None:
    parts = []
    for number in range(3):
        prefix = tmp_path / f"part{number}"
        builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", np.uint16, multimodal)
        for document in range(number + 1):
            builder.add_document(
                torch.arange(document * 5 + number + 1), [number + 1, document * 5], modes=[1, 2]
            )
        if number == 1:
            builder.end_document()  # an empty document at the end of a part
        builder.finalize(f"{prefix}.idx")
        parts.append(prefix)
    empty = tmp_path / "empty"
    megatron.IndexedDatasetBuilder(f"{empty}.bin", np.uint16, multimodal).finalize(f"{empty}.idx")

    def script(builder: Any) -> None:
        builder.add_item(torch.tensor([7, 7]), mode=3)
        builder.end_document()
        for prefix in (parts[0], empty, parts[1], parts[2], parts[0]):
            builder.add_index(str(prefix))
        builder.add_document(torch.tensor([9]), [1], modes=[4])

    first, second = build_both(tmp_path, script, np.uint16, multimodal)
    assert_same_files(first, second)
    assert_same_reads(second, multimodal)


def test_dtype_mismatch_on_merge_both_refuse(tmp_path: Path) -> None:
    prefix = tmp_path / "part"
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    builder.add_document(torch.tensor([1]), [1])
    builder.finalize(f"{prefix}.idx")
    reference = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    with pytest.raises(AssertionError):
        reference.add_index(str(prefix))
    reference.data_file.close()
    with pytest.raises(tokenmill.DataFormatError, match=r"part\.idx: dtype int32"):
        tokenmill.IndexedDatasetBuilder(str(tmp_path / "t.bin"), np.uint16).add_index(str(prefix))


def test_dtype_enum_agrees() -> None:
    for code in range(1, 9):
        assert tokenmill.DType.dtype_from_code(code) is megatron.DType.dtype_from_code(code)
        assert tokenmill.DType.size(code) == megatron.DType.size(code)
    for dtype in ALL_DTYPES:
        assert tokenmill.DType.code_from_dtype(dtype) == megatron.DType.code_from_dtype(dtype)
        assert tokenmill.DType.size(dtype) == megatron.DType.size(dtype)
    for member in megatron.DType:
        assert tokenmill.DType[member.name].value == member.value
    for cardinality in (None, 0, 50257, 65499, 65500, 65536, 128256):
        assert tokenmill.DType.optimal_dtype(cardinality) is megatron.DType.optimal_dtype(
            cardinality
        )


def test_pickle_state_matches(tmp_path: Path) -> None:
    first, _ = build_both(tmp_path, mixed_script(False), np.int32, False)
    for kwargs in ({}, {"mmap": False}, {"fast_cache_load": True}):
        ours = tokenmill.IndexedDataset(str(first), **kwargs).__getstate__()
        theirs = megatron.IndexedDataset(str(first), **kwargs).__getstate__()
        assert ours == theirs


def test_fast_cache_load_matches(tmp_path: Path) -> None:
    first, _ = build_both(tmp_path, mixed_script(False), np.int16, False)
    kwargs: dict[str, Any] = {
        "fast_cache_load": True,
        "sequences_per_dataset": (8, 8),
        "dtype_code": 3,
    }
    ours = tokenmill.IndexedDataset(str(first), **kwargs)
    theirs = megatron.IndexedDataset(str(first), **kwargs)
    assert len(ours) == len(theirs)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(theirs)):
        assert np.array_equal(ours[i], theirs[i])


documents_strategy = st.lists(
    st.lists(st.lists(st.integers(0, 255), max_size=5), max_size=3), max_size=5
)


@settings(deadline=None, max_examples=25)
@given(
    documents=documents_strategy,
    dtype=st.sampled_from(ALL_DTYPES),
    multimodal=st.booleans(),
    use_add_document=st.booleans(),
)
def test_random_documents_identical(
    tmp_path_factory: pytest.TempPathFactory,
    documents: list[list[list[int]]],
    dtype: Any,
    multimodal: bool,
    use_add_document: bool,
) -> None:
    if np.dtype(dtype) == np.int8:
        documents = [[[token - 128 for token in s] for s in d] for d in documents]

    def script(builder: Any) -> None:
        for d, document in enumerate(documents):
            modes = [(d + k) % 5 for k in range(len(document))]
            if use_add_document:
                tokens = torch.tensor([t for s in document for t in s], dtype=torch.int64)
                builder.add_document(tokens, [len(s) for s in document], modes=modes)
            else:
                for sequence, mode in zip(document, modes, strict=True):
                    builder.add_item(torch.tensor(sequence, dtype=torch.int64), mode=mode)
                builder.end_document()

    first, second = build_both(tmp_path_factory.mktemp("diff"), script, dtype, multimodal)
    assert_same_files(first, second)
    assert_same_reads(first, multimodal)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float64])
@pytest.mark.parametrize("modes", [None, [0, 1, 1, 0, 2]])
@pytest.mark.parametrize("lengths", [[], [7], [3, 0, 5, 1, 9]])
def test_index_writer_writes_megatrons_bytes(
    tmp_path: Path, dtype: Any, modes: list[int] | None, lengths: list[int]
) -> None:
    """megatron's ``_IndexWriter`` (patched in as tokenmill.megatron.indexed_dataset's, which
    shares the one ``.idx`` serializer with the builder) writes megatron-core's bytes."""
    from tokenmill.megatron import indexed_dataset as patched

    modes = None if modes is None else modes[: len(lengths)]
    documents = [0, len(lengths)] if lengths else [0]
    for name, module in (("megatron", megatron), ("tokenmill", patched)):
        with module._IndexWriter(str(tmp_path / f"{name}.idx"), dtype) as writer:
            writer.write(lengths, modes, documents)
    assert (tmp_path / "megatron.idx").read_bytes() == (tmp_path / "tokenmill.idx").read_bytes()
