"""Packing: the C++ planner against its slow references, and the invariants of packed rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill import IndexedDataset, _core
from tokenmill.datasets.packed import PackedDataset, PackingConfig, document_block_mask
from tokenmill.errors import DataFormatError
from tokenmill.index.packing import plan_packing

from conftest import random_documents, write_megatron_shard
from reference import best_fit_reference, bos_aligned_reference, pieces_reference

torch = pytest.importorskip("torch")


def plan_rows(plan_entries: np.ndarray, row_offsets: np.ndarray) -> list[list[list[int]]]:
    return [
        plan_entries[row_offsets[r] : row_offsets[r + 1]].tolist()
        for r in range(len(row_offsets) - 1)
    ]


lengths_strategy = st.lists(st.integers(0, 70), min_size=0, max_size=60)


@given(
    lengths=lengths_strategy,
    row_length=st.integers(2, 40),
    overlap_fraction=st.floats(0, 0.5),
    max_pieces=st.integers(1, 6),
    window=st.integers(1, 12),
    max_open=st.integers(1, 8),
)
def test_best_fit_equals_reference(
    lengths: list[int],
    row_length: int,
    overlap_fraction: float,
    max_pieces: int,
    window: int,
    max_open: int,
) -> None:
    overlap = int(overlap_fraction * row_length) // 1
    overlap = min(overlap, row_length // 2)
    entries, offsets, padding, inserted = _core.plan_packing(
        np.array(lengths, dtype=np.int32), row_length, overlap, max_pieces, window, max_open,
        1 << 20, False, 1,
    )  # fmt: skip
    pieces = pieces_reference(lengths, row_length, overlap)
    expected = best_fit_reference(pieces, row_length, max_pieces, window, max_open)
    assert plan_rows(entries, offsets) == expected
    assert padding == sum(row_length - sum(p[2] for p in row) for row in expected)
    assert inserted == 0


@given(
    lengths=lengths_strategy,
    row_length=st.integers(2, 40),
    max_pieces=st.integers(1, 6),
    window=st.integers(1, 12),
)
def test_bos_aligned_equals_reference(
    lengths: list[int], row_length: int, max_pieces: int, window: int
) -> None:
    entries, offsets, _, inserted = _core.plan_packing(
        np.array(lengths, dtype=np.int32), row_length, 0, max_pieces, window, 2 * window,
        1 << 20, True, 1,
    )  # fmt: skip
    pieces = pieces_reference(lengths, row_length, 0, windows=False)
    expected = bos_aligned_reference(pieces, row_length, max_pieces, window)
    assert plan_rows(entries, offsets) == expected
    assert inserted == sum(p[4] & 1 for row in expected for p in row)


@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=400), threads=st.integers(1, 4))
def test_plan_is_identical_for_any_thread_count(lengths: list[int], threads: int) -> None:
    array = np.array(lengths, dtype=np.int32)
    for bos_aligned in (False, True):
        one = _core.plan_packing(array, 64, 8, 8, 16, 32, 37, bos_aligned, 1)
        many = _core.plan_packing(array, 64, 8, 8, 16, 32, 37, bos_aligned, threads)
        np.testing.assert_array_equal(one[0], many[0])
        np.testing.assert_array_equal(one[1], many[1])
        assert one[2:] == many[2:]


@given(
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=80),
    row_length=st.integers(4, 64),
    overlap_half=st.booleans(),
    bos_aligned=st.booleans(),
)
def test_every_token_is_covered_exactly_once(
    lengths: list[int], row_length: int, overlap_half: bool, bos_aligned: bool
) -> None:
    """Each document is tiled by its pieces: unmasked parts cover [0, L) exactly once."""
    overlap = 0 if bos_aligned or not overlap_half else row_length // 2
    plan = plan_packing(
        lengths, row_length, overlap=overlap, max_documents_per_row=5, bos_aligned=bos_aligned,
        window=7,
    )  # fmt: skip
    coverage = [np.zeros(length, dtype=np.int64) for length in lengths]
    for document, offset, size, masked, _ in plan.entries.tolist():
        coverage[document][offset + masked : offset + size] += 1
    for document, counts in enumerate(coverage):
        assert (counts == 1).all(), f"document {document}: {counts.tolist()}"
    for row in range(plan.num_rows):
        entries = plan.entries[plan.row_offsets[row] : plan.row_offsets[row + 1]]
        used = int(entries[:, 2].sum() + (entries[:, 4] & 1).sum())
        assert used <= row_length
        assert len(entries) <= 5


def shard_with(tmp_path: Path, documents: list[list[int]], name: str = "corpus") -> str:
    return write_megatron_shard(tmp_path / name, documents)


def check_row(dataset: PackedDataset, documents: list[list[int]], idx: int) -> None:
    """Row idx against the source documents: tokens, labels, positions, doc ids, cu_seqlens."""
    config = dataset.config
    row = {k: v.numpy() for k, v in dataset[idx].items()}
    row_id = int(dataset.row_order[idx])
    entries = dataset.entries[dataset.row_offsets[row_id] : dataset.row_offsets[row_id + 1]]
    position = 0
    for number, (document, offset, size, masked, flags) in enumerate(entries.tolist()):
        assert row["cu_seqlens"][number] == position
        start = position
        if flags & 1:
            assert row["input_ids"][position] == config.bos_token_id
            assert row["labels"][position] == -100
            position += 1
        source = documents[document]
        np.testing.assert_array_equal(
            row["input_ids"][position : position + size], source[offset : offset + size]
        )
        for j in range(size):
            target = offset + j + 1
            expected = source[target] if target < len(source) and j >= masked else -100
            assert row["labels"][position + j] == expected, (idx, number, j)
        position += size
        assert (row["doc_ids"][start:position] == number).all()
        np.testing.assert_array_equal(
            row["position_ids"][start:position], np.arange(position - start)
        )
    pieces = len(entries)
    assert (row["cu_seqlens"][pieces:] == config.sequence_length).all()
    assert (row["labels"][position:] == -100).all()
    assert (row["input_ids"][position:] == config.pad_token_id).all()
    assert (row["doc_ids"][position:] == pieces - 1).all()
    # cu_seqlens and doc_ids agree everywhere
    boundaries = np.searchsorted(row["cu_seqlens"][: pieces + 1], np.arange(position), "right") - 1
    np.testing.assert_array_equal(boundaries, row["doc_ids"][:position])


@given(seed=st.integers(0, 1000), overlap=st.sampled_from([0, 4, 16]))
def test_rows_match_the_source_documents(
    tmp_path_factory: pytest.TempPathFactory, seed: int, overlap: int
) -> None:
    rng = np.random.default_rng(seed)
    documents = random_documents(rng, int(rng.integers(1, 40)), max_length=100)
    path = shard_with(tmp_path_factory.mktemp("rows"), documents)
    config = PackingConfig(
        sequence_length=32, seed=seed, window_overlap=overlap, max_documents_per_row=6
    )
    dataset = PackedDataset(IndexedDataset(path), config)
    for idx in range(len(dataset)):
        check_row(dataset, documents, idx)


def test_bos_aligned_rows_are_full_and_start_with_bos(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    bos = 1
    documents = [[bos, *d] for d in random_documents(rng, 80, max_length=150)]
    path = shard_with(tmp_path, documents)
    config = PackingConfig(sequence_length=64, bos_aligned=True, bos_token_id=bos)
    dataset = PackedDataset(IndexedDataset(path), config)
    stats = dataset.stats()
    assert stats["dropped_tokens"] == 0
    full_rows = 0
    for idx in range(len(dataset)):
        check_row(dataset, documents, idx)
        row = dataset[idx]
        assert int(row["input_ids"][0]) == bos
        full_rows += int((row["labels"] != -100).sum() > 0)
    assert stats["padding_tokens"] < config.sequence_length  # only the last row can be short


def test_bos_aligned_needs_documents_that_start_with_bos(tmp_path: Path) -> None:
    path = shard_with(tmp_path, [[5, 6, 7, 0], [8, 9, 0]])
    dataset = PackedDataset(
        IndexedDataset(path), PackingConfig(sequence_length=4, bos_aligned=True, bos_token_id=1)
    )
    starts = [int(dataset.entries[dataset.row_offsets[int(r)], 4]) for r in dataset.row_order]
    first_plain_row = starts.index(0)  # a row that starts at a document start, not a remainder
    with pytest.raises(DataFormatError, match="not the BOS id 1"):
        dataset[first_plain_row]


def test_waste_is_small_on_a_realistic_length_distribution(tmp_path: Path) -> None:
    """Lognormal lengths, mean ~1000 tokens, heavy tail, rows of 2048: waste <= 2 %."""
    rng = np.random.default_rng(0)
    sigma = 1.2
    lengths = np.maximum(1, rng.lognormal(np.log(1000) - sigma**2 / 2, sigma, 20000)).astype(
        np.int32
    )
    for bos_aligned in (False, True):
        plan = plan_packing(lengths, 2048, bos_aligned=bos_aligned)
        row_tokens = plan.num_rows * 2048
        waste = plan.padding + plan.inserted_bos
        assert waste / row_tokens <= 0.02, (bos_aligned, waste / row_tokens)
        assert int(plan.entries[:, 2].sum()) == int(lengths.sum())


def test_plan_is_cached_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    documents = random_documents(rng, 50, max_length=80)
    path = shard_with(tmp_path, documents)
    config = PackingConfig(sequence_length=32, path_to_cache=str(tmp_path / "cache"))
    first = PackedDataset(IndexedDataset(path), config)
    assert len(list((tmp_path / "cache").glob("*-PackedDataset-plan-*.npy"))) == 3

    def no_plan(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned again despite a valid cache")

    monkeypatch.setattr("tokenmill.datasets.packed.plan_packing", no_plan)
    second = PackedDataset(IndexedDataset(path), config)
    np.testing.assert_array_equal(first.entries, second.entries)
    np.testing.assert_array_equal(first.row_order, second.row_order)
    other = PackingConfig(sequence_length=32, seed=99, path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(AssertionError, match="planned again"):
        PackedDataset(IndexedDataset(path), other)  # a different seed is a different plan


def test_batched_rows_equal_single_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    path = shard_with(tmp_path, random_documents(rng, 40, max_length=60))
    dataset = PackedDataset(IndexedDataset(path), PackingConfig(sequence_length=24))
    batch = dataset.__getitems__([3, 0, 5])
    for slot, idx in enumerate([3, 0, 5]):
        for key, value in dataset[idx].items():
            assert torch.equal(batch[key][slot], value)


def test_flex_attention_mask_follows_documents(tmp_path: Path) -> None:
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], dtype=torch.int32)
    mask = document_block_mask(doc_ids)
    assert tuple(mask.shape[-2:]) == (8, 8)
    dense = mask.mask_mod(
        torch.tensor(0), torch.tensor(0), torch.arange(8)[:, None], torch.arange(8)[None, :]
    )
    expected = (doc_ids[:, None] == doc_ids[None, :]) & (
        torch.arange(8)[:, None] >= torch.arange(8)[None, :]
    )
    assert torch.equal(dense, expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sequence_length": 1}, "sequence_length must be >= 2"),
        ({"sequence_length": 8, "window_overlap": 5}, r"window_overlap must be in \[0, "),
        ({"sequence_length": 8, "bos_aligned": True}, "needs bos_token_id"),
        ({"sequence_length": 8, "max_documents_per_row": 0}, "max_documents_per_row"),
        ({"sequence_length": 8, "seed": -1}, "seed must be in"),
        ({"sequence_length": 8, "planning_window": 0}, "planning_window"),
        (
            {"sequence_length": 8, "bos_aligned": True, "bos_token_id": 1, "window_overlap": 2},
            "window_overlap must be 0 with bos_aligned",
        ),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackingConfig(**fields)  # type: ignore[arg-type]


def test_bad_inputs(tmp_path: Path) -> None:
    path = shard_with(tmp_path, [[1, 2, 0], [3, 0]])
    with pytest.raises(IndexError, match=r"document ids in \[0, 2\)"):
        PackedDataset(IndexedDataset(path), PackingConfig(sequence_length=4), indices=[0, 5])
    dataset = PackedDataset(IndexedDataset(path), PackingConfig(sequence_length=4))
    with pytest.raises(IndexError, match="out of range"):
        dataset[len(dataset)]
    with pytest.raises(ValueError, match="is negative"):
        _core.plan_packing(np.array([3, -1], np.int32), 4, 0, 4, 4, 8, 16, False, 1)
    with pytest.raises(TypeError, match="lengths must have dtype int32"):
        _core.plan_packing(np.array([3, 1], np.int64), 4, 0, 4, 4, 8, 16, False, 1)


def nanogpt_shard_from_spec(path: Path, documents: list[list[int]]) -> str:
    """A modded-nanogpt shard (magic 20240520, uint16) written straight from the spec."""
    tokens = np.concatenate([np.asarray(d) for d in documents])
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    return str(path)


@pytest.mark.parametrize("layout", ["nanogpt", "npy"])
def test_packs_other_formats_by_document(tmp_path: Path, layout: str) -> None:
    from tokenmill.formats.documents import DocumentCorpus

    bos, eos = 1, 0
    rng = np.random.default_rng(12)
    documents = [
        [bos, *(2 if t == bos else t for t in d)]  # BOS only at document starts
        for d in random_documents(rng, 60, max_length=90, eod=eos)
    ]
    if layout == "nanogpt":
        directory = tmp_path / "shards"
        directory.mkdir()
        nanogpt_shard_from_spec(directory / "a.bin", documents[:30])
        nanogpt_shard_from_spec(directory / "b.bin", documents[30:])
        corpus = DocumentCorpus(str(directory), bos_token=bos)
    else:
        directory = tmp_path / "npy"
        directory.mkdir()
        np.save(directory / "0.npy", np.concatenate(documents[:25]).astype(np.uint32))
        np.save(directory / "1.npy", np.concatenate(documents[25:]).astype(np.uint32))
        corpus = DocumentCorpus(str(directory), eos_token=eos)
    assert corpus.sequence_lengths.tolist() == [len(d) for d in documents]
    dataset = PackedDataset(corpus, PackingConfig(sequence_length=48, window_overlap=8))
    for idx in range(len(dataset)):
        check_row(dataset, documents, idx)
    aligned = PackedDataset(
        corpus, PackingConfig(sequence_length=48, bos_aligned=True, bos_token_id=bos)
    )
    for idx in range(len(aligned)):
        check_row(aligned, documents, idx)
        assert int(aligned[idx]["input_ids"][0]) == bos


def test_corpus_without_document_boundaries_is_an_error(tmp_path: Path) -> None:
    from tokenmill.formats.documents import DocumentCorpus

    np.save(tmp_path / "0.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match="no document boundaries"):
        DocumentCorpus(str(tmp_path))
    corpus = DocumentCorpus(str(tmp_path), eos_token=4)
    with pytest.raises(IndexError, match="outside document 0"):
        corpus.get(0, 3, 5)


def test_inspect_reports_packing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tokenmill.cli.main import main

    rng = np.random.default_rng(2)
    prefix = shard_with(tmp_path, random_documents(rng, 200, max_length=300))
    code = main(["inspect", prefix, "--packing", "--sequence-length", "256", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    packing = report["packing"]
    assert packing["dropped_tokens"] == 0
    assert packing["padding_fraction"] < 0.05
    assert packing["rows"] == len(PackedDataset(IndexedDataset(prefix), PackingConfig(256)))
    assert main(["inspect", prefix, "--packing"]) == 2
    assert "--packing needs --sequence-length" in capsys.readouterr().err


@given(seed=st.integers(0, 500), bos_aligned=st.booleans(), reset=st.booleans())
def test_cpp_gather_equals_the_python_rows(
    tmp_path_factory: pytest.TempPathFactory, seed: int, bos_aligned: bool, reset: bool
) -> None:
    rng = np.random.default_rng(seed)
    dtype = [np.uint16, np.int32, np.int64, np.uint8][seed % 4]
    documents = [[1, *(2 + t % 200 for t in d)] for d in random_documents(rng, 30, 90)]
    path = write_megatron_shard(tmp_path_factory.mktemp("gather") / "c", documents, dtype=dtype)
    config = PackingConfig(
        sequence_length=40,
        seed=seed,
        bos_aligned=bos_aligned,
        bos_token_id=1,
        window_overlap=0 if bos_aligned else 6,
        max_documents_per_row=5,
        reset_position_ids=reset,
        pad_token_id=3,
    )
    dataset = PackedDataset(IndexedDataset(path), config)
    assert dataset._native_source() is not None
    indices = list(range(len(dataset)))
    batch = dataset.__getitems__(indices)
    for slot, idx in enumerate(indices):
        expected = dataset._row_arrays(idx)
        for key, value in expected.items():
            np.testing.assert_array_equal(batch[key][slot].numpy(), value, err_msg=key)


def test_gather_checks_indices_and_plans(tmp_path: Path) -> None:
    path = shard_with(tmp_path, [[1, 2, 0], [3, 0], [4, 5, 6, 0]])
    dataset = PackedDataset(IndexedDataset(path), PackingConfig(sequence_length=4))
    with pytest.raises(IndexError, match="out of range"):
        dataset.__getitems__([0, len(dataset) + 3])
    assert torch.equal(dataset[-1]["input_ids"], dataset[len(dataset) - 1]["input_ids"])
    dataset.entries = dataset.entries.copy()
    dataset.entries[:, 2] = 99  # a corrupt plan: pieces longer than their documents
    with pytest.raises(IndexError, match="points outside its document"):
        dataset[0]


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        (0, 99, r"entries\[\d+, 0\] \(document\) = 99 is not a document id in \[0, 3\)"),
        (0, -1, r"entries\[\d+, 0\] \(document\) = -1 is not a document id"),
        (1, -2, r"points outside its document: offset -2"),
        (2, 99, r"points outside its document or row: offset \d+, length 99"),
    ],
)
def test_the_python_row_path_refuses_a_corrupt_plan_as_the_gather_does(
    tmp_path: Path, column: int, value: int, message: str
) -> None:
    """A source that is not mapped is served by `_row_arrays`: each corrupt entry of a cached plan
    raises IndexError naming it, as the C++ gather does for a mapped source."""
    path = shard_with(tmp_path, [[1, 2, 0], [3, 0], [4, 5, 6, 0]])
    config = PackingConfig(sequence_length=4)
    served = [PackedDataset(IndexedDataset(path, mmap=mmap), config) for mmap in (False, True)]
    for dataset in served:
        dataset.entries = dataset.entries.copy()
        dataset.entries[:, column] = value
    python, gathered = served
    with pytest.raises(IndexError, match=message):
        python[0]
    with pytest.raises(IndexError):
        gathered[0]


def test_the_python_row_path_agrees_with_the_gather_on_odd_entries(tmp_path: Path) -> None:
    """Entries that are odd but servable (an inserted-BOS flag with no BOS id configured, a
    negative or oversized masked count) give the same row on both paths; a row holding more
    entries than max_documents_per_row is refused by both."""
    path = shard_with(tmp_path, [[1, 2, 0], [3, 0], [4, 5, 6, 0]])
    config = PackingConfig(sequence_length=8, max_documents_per_row=2)
    served = [PackedDataset(IndexedDataset(path, mmap=mmap), config) for mmap in (False, True)]
    original = served[0].entries.copy()
    assert np.array_equal(original, served[1].entries) and len(original) > 2
    for change in ({3: -5}, {3: 50}, {4: 1}):
        entries = original.copy()
        for column, value in change.items():
            entries[:, column] = value
        entries[:, 2] = np.minimum(entries[:, 2], 1)  # room in every row for an inserted BOS
        rows = []
        for dataset in served:
            dataset.entries = entries
            rows.append([dataset[i] for i in range(len(dataset))])
        python, gathered = rows
        for row, other in zip(python, gathered):
            for key in row:
                np.testing.assert_array_equal(row[key], other[key], err_msg=f"{change} {key}")
    first = int(np.flatnonzero(served[0].row_order == 0)[0])
    for dataset in served:
        dataset.entries = original
        dataset.row_offsets = dataset.row_offsets.copy()
        dataset.row_offsets[1:] = len(original)  # the first row holds every entry
    with pytest.raises(IndexError, match="of at most 2 of the plan's"):
        served[0][first]
    with pytest.raises(IndexError):
        served[1][first]


def test_served_rows_land_in_the_rows_asked_for(tmp_path: Path) -> None:
    """`fill_batch` with `rows` (the Servable protocol's scatter, as a blend uses it) writes each
    row where it is asked; batches come from reused buffers without changing values; the dataset
    pickles without its per-process server."""
    import pickle

    from tokenmill.serving.buffers import allocate
    from tokenmill.serving.server import Servable

    documents = [[1, *range(2, 2 + n)] for n in (5, 9, 3, 12, 7, 4, 8, 2)]
    dataset = PackedDataset(
        IndexedDataset(shard_with(tmp_path, documents)), PackingConfig(sequence_length=8)
    )
    assert isinstance(dataset, Servable)
    layout = dataset.batch_layout()
    assert layout is not None and layout == dataset.batch_layout()
    count = len(dataset)
    buffers = allocate(layout.fields(), count + 2, pin_memory=False)
    for array in buffers.values():
        array.fill(-7)
    rows = np.arange(count, dtype=np.int64)[::-1] + 2  # rows 2.. in reverse
    dataset.fill_batch(np.arange(count, dtype=np.int64), rows, buffers)
    for idx in range(count):
        for key, value in dataset._row_arrays(idx).items():
            np.testing.assert_array_equal(buffers[key][rows[idx]], value, err_msg=key)
    assert (buffers["input_ids"][:2] == -7).all()  # rows not asked for are untouched
    first = {key: value.clone() for key, value in dataset.__getitems__([0, 1]).items()}
    for _ in range(8):  # pooled buffers are reused once the tensors are gone
        again = dataset.__getitems__([0, 1])
    for key, value in first.items():
        assert torch.equal(again[key], value), key
    restored = pickle.loads(pickle.dumps(dataset))
    assert "_server" not in restored.__dict__
    assert torch.equal(restored[1]["labels"], dataset[1]["labels"])
