"""Batched serving: `get_batch` / `__getitems__` equal stacked `__getitem__` outputs (and
megatron-core's samples stacked by torch's default collate) for every pair of settings of the
flags, the pad id, the corpus and the sequence length (covering designs, tests/covering.py; the
run prints the pairs reached); the single-sample C++ path equals the per-document Python path;
loaders, dtypes, errors, buffers."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from covering import NIGHTLY, all_pairs, pairs_of, pairwise_cases, suite

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from oracles import import_oracle

torch = pytest.importorskip("torch")

from tokenmill import _core
from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.loading.batch import make_data_loader
from tokenmill.serving import server as server_module
from tokenmill.serving.batch import SampleBatch, collate

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")

FLAGS = (
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "create_attention_mask",
    "add_extra_token_to_sequence",
    "drop_last_partial_validation_sequence",
    "inter_document_masking",
)


def make_corpus(
    tmp_path: Path, rng: np.random.Generator, kind: str, pad: int | None, sequence_length: int = 0
) -> str:
    """A corpus of `kind` with at least two samples' worth of tokens for `sequence_length`."""
    if kind == "short":
        documents = [
            [0] if rng.random() < 0.4 else [1, 2, 0][: rng.integers(1, 4)] for _ in range(80)
        ]
    elif kind == "long":
        documents = random_documents(rng, 12, max_length=3000)
    else:
        documents = random_documents(rng, 150, max_length=400)
    while sum(map(len, documents)) < 2 * (sequence_length + 1):
        documents += random_documents(rng, 16, max_length=400)
    if pad is not None:
        for document in documents[::4]:
            document[len(document) // 2] = pad
    return write_megatron_shard(tmp_path / f"corpus-{kind}", documents)


def build(
    prefix: str,
    tmp_path: Path,
    flags: dict[str, bool],
    sequence_length: int,
    split: Split = Split.valid,
    tokenizer: TinyTokenizer | None = None,
    mmap: bool = True,
    **extra: Any,
) -> GPTDataset:
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=sequence_length,
        tokenizer=tokenizer or TinyTokenizer(),
        blend=([prefix], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        mmap_bin_files=mmap,
        **flags,
        **extra,
    )
    low_level = IndexedDataset(prefix, mmap=mmap)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, prefix, indices, None, split, config)


def assert_same(batch: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert list(batch) == list(expected), where
    for key, reference in expected.items():
        value = batch[key]
        assert value.dtype == reference.dtype, f"{where} {key}"
        assert value.shape == reference.shape, f"{where} {key}"
        assert torch.equal(value, reference), f"{where} {key}"


def stacked(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


# Every pair of settings meets in some case (tests/covering.py); the nightly run three times.
SERVING_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    **{name: (False, True) for name in FLAGS},
    "pad": (None, 7, 0),  # none, a real pad id, a pad id colliding with EOD
    "corpus": ("mixed", "short", "long"),
    "sequence_length": (1, 2, 7, 64, 257),
    "allow_ambiguous_pad_tokens": (False, True),
}
SERVING_CASES = pairwise_cases(SERVING_DIMENSIONS, seed=2, repeat=3 if NIGHTLY else 1)
SERVING_COVERAGE = suite("batched serving paths (test_serving)", SERVING_DIMENSIONS)
MEGATRON_SERVING_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    **{name: (False, True) for name in FLAGS},
    "pad": (None, 7, 0),
    "corpus": ("mixed", "short", "long"),
    "sequence_length": (7, 50, 257, 2048),
}
MEGATRON_SERVING_CASES = pairwise_cases(
    MEGATRON_SERVING_DIMENSIONS, seed=4, repeat=3 if NIGHTLY else 1
)
MEGATRON_SERVING_COVERAGE = suite(
    "batches against megatron's default collate (test_serving)", MEGATRON_SERVING_DIMENSIONS
)


def test_serving_cases_cover_every_pair() -> None:
    for dimensions, cases in (
        (SERVING_DIMENSIONS, SERVING_CASES),
        (MEGATRON_SERVING_DIMENSIONS, MEGATRON_SERVING_CASES),
    ):
        covered = set().union(*(pairs_of(case, dimensions) for case in cases))
        assert covered == all_pairs(dimensions)


@pytest.mark.parametrize("case", range(len(SERVING_CASES)))
def test_batch_equals_stacked_samples_for_every_flag_pair(tmp_path: Path, case: int) -> None:
    drawn = SERVING_CASES[case]
    rng = np.random.default_rng(500 + case)
    pad = drawn["pad"]
    sequence_length = drawn["sequence_length"]
    prefix = make_corpus(tmp_path, rng, drawn["corpus"], pad, sequence_length)
    flags = {name: drawn[name] for name in FLAGS}
    tokenizer = TinyTokenizer(pad=pad)
    allow = drawn["allow_ambiguous_pad_tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pad collisions
        fast = build(
            prefix,
            tmp_path,
            flags,
            sequence_length,
            tokenizer=tokenizer,
            allow_ambiguous_pad_tokens=allow,
        )
        slow = build(
            prefix,
            tmp_path,
            flags,
            sequence_length,
            tokenizer=tokenizer,
            mmap=False,
            allow_ambiguous_pad_tokens=allow,
        )
    assert fast._serving() is not None and slow._serving() is None
    if len(fast) == 0:
        SERVING_COVERAGE.record(case, drawn, "empty")
        return
    drawn_indices: list[int | None] = [
        *rng.integers(-len(fast), len(fast), 9).tolist(),
        len(fast) - 1,
        None,
    ]
    indices: list[int | None] = []
    samples = []
    for index in drawn_indices:
        try:
            samples.append(slow._getitem_python(index))
        except RuntimeError as error:
            # the Python path fails where megatron-core does (cu_seqlens with more empty
            # document parts than tokens); test_gpt_dataset_megatron compares those samples
            # with megatron's own parts (megatron_compare.expected_cu_seqlens_sample)
            failure = str(error)
            if not (flags["inter_document_masking"] and "expanded size" in failure):
                raise
            continue
        indices.append(index)
    assert indices, f"{drawn}: the Python path served none of {drawn_indices}"
    for index, sample in zip(indices, samples):
        assert_same(fast[index], sample, f"single {index} {flags}")
    expected = stacked(samples)
    assert_same(fast.get_batch(indices), expected, f"batch {flags}")
    assert_same(slow.get_batch(indices), expected, f"python batch {flags}")
    # The same batch gathered by several threads (large batches; forced here).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_module, "_PARALLEL_GATHER_BYTES", 0)
        patch.setattr(server_module, "_GATHER_THREADS", 3)
        assert_same(fast.get_batch(indices), expected, f"threaded batch {flags}")
    batch = fast.__getitems__(indices)
    assert isinstance(batch, SampleBatch) and len(batch) == len(indices)
    assert_same(collate(batch), expected, "collate pass-through")
    assert_same(torch.utils.data.default_collate(batch), expected, "default collate")
    SERVING_COVERAGE.record(case, drawn, "compared")


@pytest.mark.megatron
@pytest.mark.parametrize("case", range(len(MEGATRON_SERVING_CASES)))
def test_batch_matches_megatron_default_collate(tmp_path: Path, case: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = import_oracle("megatron.core.datasets.gpt_dataset")
        indexed = import_oracle("megatron.core.datasets.indexed_dataset")
        utils = import_oracle("megatron.core.datasets.utils")
    from megatron_compare import disable_mask_cache, documented_sample, same_outcome

    drawn = MEGATRON_SERVING_CASES[case]
    rng = np.random.default_rng(3000 + case)
    pad = drawn["pad"]
    prefix = make_corpus(tmp_path, rng, drawn["corpus"], pad, drawn["sequence_length"])
    flags = {name: drawn[name] for name in FLAGS}
    common = {
        "random_seed": 7,
        "sequence_length": drawn["sequence_length"],
        "tokenizer": TinyTokenizer(pad=pad),
        "blend": ([prefix], None),
        "split": "1",
        "allow_ambiguous_pad_tokens": True,
        **flags,
    }
    low_level = IndexedDataset(prefix)
    indices = np.arange(len(low_level), dtype=np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pad collisions
        ours = GPTDataset(
            low_level,
            prefix,
            indices,
            None,
            Split.valid,
            GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **common),
        )
        theirs = gpt.GPTDataset(
            indexed.IndexedDataset(prefix),
            prefix,
            indices,
            None,
            utils.Split.valid,
            gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), **common),
        )
    disable_mask_cache(theirs)
    assert len(ours) == len(theirs)
    if len(theirs) == 0:
        MEGATRON_SERVING_COVERAGE.record(case, drawn, "empty")
        return
    # fewer where megatron builds a dense S x S mask per sample (seconds each at S = 2048)
    count = 3 if drawn["sequence_length"] >= 2048 and flags["create_attention_mask"] else 7
    batch_indices = [*rng.integers(0, len(theirs), count).tolist(), len(theirs) - 1]
    samples = []
    for index in batch_indices:
        pair = same_outcome(
            lambda index=index: theirs[index],
            lambda index=index: ours[index],
            f"case {case} {drawn} idx {index}",
            documented=lambda index=index: documented_sample(theirs, index),
        )
        assert pair is not None
        samples.append(pair[0])
    expected = torch.utils.data.default_collate(samples)
    assert_same(ours.get_batch(batch_indices), expected, f"case {case} {drawn}")
    MEGATRON_SERVING_COVERAGE.record(case, drawn, "compared")


@pytest.mark.parametrize("choice", ["int32", "storage"])
def test_token_output_dtype(tmp_path: Path, shard: str, choice: str) -> None:
    flags = {name: False for name in FLAGS} | {"add_extra_token_to_sequence": True}
    wide = build(shard, tmp_path / "a", flags, 33)
    narrow = build(shard, tmp_path / "b", flags, 33, token_output_dtype=choice)
    assert narrow.unique_description == wide.unique_description  # not part of the cache key
    expected_dtype = torch.int32 if choice == "int32" else torch.uint16
    for index in (0, 5, len(wide) - 1):
        sample = narrow[index]
        assert sample["tokens"].dtype == expected_dtype
        assert torch.equal(sample["tokens"].long(), wide[index]["tokens"])
        assert torch.equal(sample["labels"].long(), wide[index]["labels"])
    batch = narrow.get_batch([0, 1, 2])
    assert batch["tokens"].dtype == expected_dtype
    assert torch.equal(batch["labels"].long(), wide.get_batch([0, 1, 2])["labels"])


def test_bad_token_output_dtype_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"token_output_dtype.*'int16'"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=8,
            tokenizer=TinyTokenizer(),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            token_output_dtype="int16",
        )


def test_no_warning_on_megatrons_defaults(tmp_path: Path, shard: str) -> None:
    """megatron-core builds a dense attention mask silently (its default): so does tokenmill."""
    flags = {name: False for name in FLAGS} | {"create_attention_mask": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(shard, tmp_path / "a", flags, 16)
        build(shard, tmp_path / "b", flags | {"create_attention_mask": False}, 16)
        build(shard, tmp_path / "c", flags | {"inter_document_masking": True}, 16)


def test_index_errors_name_the_value(tmp_path: Path, shard: str) -> None:
    dataset = build(shard, tmp_path, {name: False for name in FLAGS}, 16)
    size = len(dataset)
    for bad in (size, -size - 1, 10**12):
        with pytest.raises(IndexError, match=str(bad)):
            dataset[bad]
        with pytest.raises(IndexError, match=str(bad)):
            dataset.get_batch([0, bad])
    with pytest.raises(TypeError):
        dataset[1.5]  # type: ignore[index]
    with pytest.raises(TypeError, match="integers"):
        dataset.get_batch([0.5, 1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="one-dimensional"):
        dataset.get_batch(np.zeros((2, 2), dtype=np.int64))
    assert dataset.get_batch([])["tokens"].shape == (0, 16)


def test_gatherer_rejects_bad_arrays(tmp_path: Path, shard: str) -> None:
    dataset = build(shard, tmp_path, {name: False for name in FLAGS}, 16)
    low = dataset.dataset
    arrays = [
        dataset.shuffle_index,
        dataset.sample_index,
        dataset.document_index,
        low.sequence_pointers,
        low.sequence_lengths,
        low._tokens,
    ]
    options = {
        "sequence_length": 16,
        "extra_token": 1,
        "eod": 0,
        "pad": -1,
        "eod_mask_loss": False,
        "reset_position_ids": False,
        "inter_document_masking": False,
    }
    wrong = list(arrays)
    wrong[2] = wrong[2].astype(np.int64)
    with pytest.raises(TypeError, match="document_index"):
        _core.Gatherer(*wrong, **options)
    wrong = list(arrays)
    wrong[5] = wrong[5].astype(np.float32)
    with pytest.raises(TypeError, match="tokens"):
        _core.Gatherer(*wrong, **options)
    gatherer = _core.Gatherer(*arrays, **options)
    out = np.empty((2, 16), np.int64)
    loss = np.empty((2, 16), np.float32)
    with pytest.raises(TypeError, match="indices"):
        gatherer.gather(np.zeros(2, np.int32), None, out, out.copy(), loss, None, None, None, None)
    with pytest.raises(TypeError, match="outputs"):
        gatherer.gather(
            np.zeros(2, np.int64),
            None,
            out.astype(np.int16),
            out.astype(np.int16),
            loss,
            None,
            None,
            None,
            None,
        )
    with pytest.raises(ValueError, match="rows"):
        gatherer.gather(np.zeros(3, np.int64), None, out, out.copy(), loss, None, None, None, None)
    with pytest.raises(IndexError, match="row 5"):
        gatherer.gather(
            np.zeros(1, np.int64), np.array([5]), out, out.copy(), loss, None, None, None, None
        )
    # A corrupt document index raises instead of reading out of bounds.
    corrupt = list(arrays)
    corrupt[2] = np.full_like(dataset.document_index, len(low) + 3)
    broken = _core.Gatherer(*corrupt, **options)
    with pytest.raises(IndexError, match="not a sequence id"):
        broken.gather(np.zeros(1, np.int64), None, out, out.copy(), loss, None, None, None, None)
    # ... also when the error happens in a helper thread of a threaded gather.
    wide = np.empty((4, out.shape[-1]), out.dtype)
    with pytest.raises(IndexError, match="not a sequence id"):
        broken.gather(
            np.arange(4, dtype=np.int64), None, wide, wide.copy(),
            np.empty(wide.shape, np.float32), None, None, None, None, num_threads=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_threads"):
        gatherer.gather(
            np.zeros(1, np.int64), None, out, out.copy(), loss, None, None, None, None,
            num_threads=0,
        )  # fmt: skip


def test_pooled_buffers_are_never_reused_while_referenced(tmp_path: Path, shard: str) -> None:
    dataset = build(shard, tmp_path, {name: False for name in FLAGS}, 16)
    first = dataset.get_batch([0, 1, 2, 3])
    keep = first["tokens"][1].clone()
    view = first["tokens"][1]
    del first
    for _ in range(6):
        dataset.get_batch([4, 5, 6, 7])
    assert torch.equal(view, keep)
    a, b = dataset.get_batch([0, 1]), dataset.get_batch([2, 3])
    assert a["tokens"].data_ptr() != b["tokens"].data_ptr()
    # A set handed out is owned by its arrays: never lent again while one of them (or a tensor
    # or view made from it) is alive, returned as soon as all are freed.
    server = dataset._serving()
    assert server is not None
    del a, b
    lent = server.buffers(2)
    other = server.buffers(2)
    assert lent["tokens"].ctypes.data != other["tokens"].ctypes.data
    address = lent["tokens"].ctypes.data
    tensor_view = torch.from_numpy(lent["tokens"])[1:]
    del lent
    assert server.buffers(2)["tokens"].ctypes.data != address  # the view still holds it
    del tensor_view
    reused = [server.buffers(2)["tokens"].ctypes.data for _ in range(3)]
    assert address in reused


def test_pickled_dataset_serves_the_same_batches(tmp_path: Path, shard: str) -> None:
    flags = {name: True for name in FLAGS} | {"inter_document_masking": False}
    dataset = build(shard, tmp_path, flags, 40)
    expected = dataset.get_batch([3, 1, 4])
    restored = pickle.loads(pickle.dumps(dataset))
    assert_same(restored.get_batch([3, 1, 4]), expected, "pickled")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_loader_uses_batches(tmp_path: Path, shard: str, num_workers: int) -> None:
    flags = {name: False for name in FLAGS} | {"inter_document_masking": True}
    dataset = build(shard, tmp_path, flags, 24)
    loader = make_data_loader(dataset, batch_size=5, num_workers=num_workers, drop_last=False)
    batches = list(loader)
    assert sum(int(batch["tokens"].shape[0]) for batch in batches) == len(dataset)
    position = 0
    for batch in batches:
        count = int(batch["tokens"].shape[0])
        expected = stacked([dataset._getitem_python(i) for i in range(position, position + count)])
        assert_same(batch, expected, f"batch at {position}")
        position += count


def test_blended_batch_equals_stacked_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    flags = {name: bool(rng.integers(2)) for name in FLAGS} | {"create_attention_mask": True}
    members = []
    for number in range(3):
        prefix = write_megatron_shard(
            tmp_path / f"member{number}", random_documents(rng, 40 + 10 * number)
        )
        members.append(build(prefix, tmp_path / f"m{number}", flags, 20, split=Split.train))
    config = members[0].config
    blend = BlendedDataset(members, [0.5, 0.3, 0.2], 60, config)
    indices = [*rng.integers(0, len(blend), 12).tolist(), -1]
    samples = [blend[i] for i in indices]
    expected = stacked(samples)
    batch = blend.get_batch(indices)
    assert batch["dataset_id"].dtype == torch.int16
    assert_same(batch, expected, "blend")
    assert_same(collate(blend.__getitems__(indices)), expected, "blend collate")
    assert_same(torch.utils.data.default_collate(blend.__getitems__(indices)), expected, "dc")
    with pytest.raises(IndexError, match="60"):
        blend.get_batch([60])
    # Members that need the Python path (mmap=False) give the same batch.
    slow_members = [
        build(m.dataset_path, tmp_path / f"s{n}", flags, 20, split=Split.train, mmap=False)
        for n, m in enumerate(members)
    ]
    slow = BlendedDataset(slow_members, [0.5, 0.3, 0.2], 60, slow_members[0].config)
    assert_same(slow.get_batch(indices), expected, "python blend")


def _gather_in_child(dataset: GPTDataset, indices: list[int], queue: Any) -> None:
    # A forked child of a process whose gather helpers are running has no helpers: it must
    # gather on its own thread instead of waiting for them.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_module, "_PARALLEL_GATHER_BYTES", 0)
        patch.setattr(server_module, "_GATHER_THREADS", 2)
        queue.put(dataset.get_batch(indices)["tokens"].numpy().copy())


# Python 3.12+ warns about fork() in a multi-threaded process: forking one is the point here.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_threaded_gather_after_fork(tmp_path: Path, shard: str) -> None:
    import multiprocessing

    dataset = build(shard, tmp_path, {name: False for name in FLAGS}, 16)
    indices = list(range(min(len(dataset), 12)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_module, "_PARALLEL_GATHER_BYTES", 0)
        patch.setattr(server_module, "_GATHER_THREADS", 2)
        expected = dataset.get_batch(indices)["tokens"].numpy().copy()  # helpers now running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_gather_in_child, args=(dataset, indices, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(got, expected)


def test_any_servable_dataset_is_served_through_a_batch_server() -> None:
    """The serving protocol on its own: a toy dataset with a plain layout, rows filled where
    asked, the default collate, pooled buffers lent until released, and no padding."""
    from tokenmill.serving.layout import Field, PlainLayout
    from tokenmill.serving.server import BatchServer, Servable

    layout = PlainLayout(
        (Field("values", (3,), np.dtype(np.int64)), Field("square", (), np.dtype(np.float32)))
    )

    class Squares:
        def batch_layout(self) -> PlainLayout:
            return layout

        def fill_batch(
            self, indices: Any, rows: Any, buffers: Any, *, num_threads: int = 1
        ) -> None:
            where = np.arange(len(indices)) if rows is None else rows
            buffers["values"][where] = np.stack([indices, indices + 1, indices + 2], axis=1)
            buffers["square"][where] = indices.astype(np.float32) ** 2

    dataset = Squares()
    assert isinstance(dataset, Servable)
    server = BatchServer(layout)
    batch = server.serve(3, [(dataset, np.array([4, 5, 6], dtype=np.int64), None)])
    assert list(batch) == ["values", "square"]
    assert batch["values"].tolist() == [[4, 5, 6], [5, 6, 7], [6, 7, 8]]
    assert batch["square"].tolist() == [16.0, 25.0, 36.0]
    # two parts into one batch, as a blend serves its members
    mixed = server.serve(
        3,
        [
            (dataset, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64)),
            (dataset, np.array([7, 8], dtype=np.int64), np.array([0, 1], dtype=np.int64)),
        ],
    )
    assert mixed["square"].tolist() == [49.0, 64.0, 1.0]
    assert mixed["values"].data_ptr() != batch["values"].data_ptr()  # `batch` still holds its set
    with pytest.raises(TypeError, match="must be integers"):
        server.serve(1, [(dataset, np.array([0]), None)], padding=np.array([True]))
    assert layout == PlainLayout(layout.fields()) and hash(layout) == hash(
        PlainLayout(layout.fields())
    )


def test_blend_members_share_a_layout_only_when_their_batches_agree(
    tmp_path: Path, shard: str
) -> None:
    flags = {name: False for name in FLAGS}
    plain = build(shard, tmp_path / "a", flags, 16)
    same = build(shard, tmp_path / "b", flags | {"reset_position_ids": True}, 16)
    longer = build(shard, tmp_path / "c", flags, 24)
    masked = build(shard, tmp_path / "d", flags | {"create_attention_mask": True}, 16)
    python_path = build(shard, tmp_path / "e", flags, 16, mmap=False)
    assert plain.batch_layout() == same.batch_layout()  # position ids do not change the layout
    assert plain.batch_layout() != longer.batch_layout()
    assert plain.batch_layout() != masked.batch_layout()
    assert python_path.batch_layout() is None
    with pytest.raises(TypeError, match="no batch layout"):
        python_path.fill_batch(np.array([0]), None, {})
