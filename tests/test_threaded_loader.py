"""ThreadedBatchLoader: the batches of a torch DataLoader over the same sampler, in order, from
worker threads; shuffling, drop_last, exact resume, errors, and thread safety of the batch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import TinyTokenizer, random_documents, write_megatron_shard

torch = pytest.importorskip("torch")

from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.loading.batch import make_data_loader
from tokenmill.loading.threaded import ThreadedBatchLoader


def build(prefix: str, tmp_path: Path, sequence_length: int = 32, **flags: Any) -> GPTDataset:
    config = GPTDatasetConfig(
        random_seed=3,
        sequence_length=sequence_length,
        tokenizer=TinyTokenizer(),
        blend=([prefix], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        **(
            {
                "reset_position_ids": False,
                "reset_attention_mask": False,
                "eod_mask_loss": False,
                "create_attention_mask": False,
            }
            | flags
        ),
    )
    low_level = IndexedDataset(prefix)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, prefix, indices, None, Split.train, config)


@pytest.fixture
def dataset(tmp_path: Path) -> GPTDataset:
    rng = np.random.default_rng(5)
    prefix = write_megatron_shard(tmp_path / "corpus", random_documents(rng, 300, max_length=200))
    return build(
        prefix, tmp_path, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=False
    )


def assert_batches_equal(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(got) == len(expected)
    for number, (batch, reference) in enumerate(zip(got, expected)):
        assert list(batch) == list(reference), number
        for key in reference:
            assert batch[key].dtype == reference[key].dtype, (number, key)
            assert torch.equal(batch[key], reference[key]), (number, key)


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_a_torch_data_loader(
    dataset: GPTDataset, num_workers: int, drop_last: bool
) -> None:
    sampler = np.random.default_rng(1).permutation(len(dataset)).tolist()
    expected = list(make_data_loader(dataset, 7, sampler=sampler, drop_last=drop_last))
    loader = ThreadedBatchLoader(
        dataset, 7, num_workers=num_workers, sampler=sampler, drop_last=drop_last
    )
    assert len(loader) == len(expected)
    assert_batches_equal(list(loader), expected)
    assert_batches_equal(list(loader), expected)  # a second epoch: the same order


def test_many_threads_never_share_buffers(dataset: GPTDataset) -> None:
    # Eight threads and a deep prefetch over many small batches: every batch must equal the one
    # fetched alone (a shared buffer would mix samples of two batches).
    sampler = np.random.default_rng(2).integers(0, len(dataset), 4000).tolist()
    expected = [dataset.get_batch(sampler[k : k + 5]) for k in range(0, len(sampler), 5)]
    expected = [{key: value.clone() for key, value in batch.items()} for batch in expected]
    loader = ThreadedBatchLoader(dataset, 5, num_workers=8, prefetch=32, sampler=sampler)
    assert_batches_equal(list(loader), expected)


def test_blended_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    members = [
        build(
            write_megatron_shard(tmp_path / f"m{n}", random_documents(rng, 60)), tmp_path / f"c{n}"
        )
        for n in range(3)
    ]
    blend = BlendedDataset(members, [0.2, 0.5, 0.3], 90, members[0].config)
    expected = list(make_data_loader(blend, 8))
    assert_batches_equal(list(ThreadedBatchLoader(blend, 8, num_workers=2)), expected)


def test_dataset_without_getitems() -> None:
    class Squares:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"tokens": torch.tensor([index, index * index])}

    batches = list(ThreadedBatchLoader(Squares(), 4, num_workers=2))
    assert [batch["tokens"][:, 0].tolist() for batch in batches] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]


def test_shuffle_is_seeded_per_epoch(dataset: GPTDataset) -> None:
    def first_tokens(loader: ThreadedBatchLoader) -> list[list[int]]:
        return [batch["tokens"][:, 0].tolist() for batch in loader]

    loader = ThreadedBatchLoader(dataset, 16, num_workers=2, shuffle=True, seed=4)
    again = ThreadedBatchLoader(dataset, 16, num_workers=2, shuffle=True, seed=4)
    epoch0 = first_tokens(loader)
    assert epoch0 == first_tokens(again)
    loader.set_epoch(1)
    assert first_tokens(loader) != epoch0
    ordered = first_tokens(ThreadedBatchLoader(dataset, 16, num_workers=2))
    assert sorted(x for batch in epoch0 for x in batch) == sorted(
        x for batch in ordered for x in batch
    )


@pytest.mark.parametrize("stop", [0, 1, 5, 13])
def test_resume_from_state_dict(dataset: GPTDataset, stop: int) -> None:
    sampler = np.random.default_rng(3).permutation(len(dataset)).tolist()
    expected = list(ThreadedBatchLoader(dataset, 6, num_workers=2, sampler=sampler))
    loader = ThreadedBatchLoader(dataset, 6, num_workers=2, sampler=sampler)
    iterator = iter(loader)
    seen = [next(iterator) for _ in range(stop)]
    state = loader.state_dict()  # taken after `stop` batches were handed out
    assert state == {"epoch": 0, "batches_yielded": stop}
    resumed = ThreadedBatchLoader(dataset, 6, num_workers=1, sampler=sampler)
    resumed.load_state_dict(state)
    assert_batches_equal(seen + list(resumed), expected)
    assert resumed.state_dict()["batches_yielded"] == len(expected)


def test_errors_reach_the_consumer_in_order(dataset: GPTDataset) -> None:
    sampler = [0, 1, 2, 3, len(dataset) + 5, 4]
    loader = ThreadedBatchLoader(dataset, 2, num_workers=2, sampler=sampler)
    iterator = iter(loader)
    assert next(iterator)["tokens"].shape[0] == 2
    assert next(iterator)["tokens"].shape[0] == 2
    with pytest.raises(IndexError, match=str(len(dataset) + 5)):
        next(iterator)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch": 0}, "prefetch"),
        ({"sampler": [0, 1], "shuffle": True}, "exclude"),
    ],
)
def test_bad_arguments(dataset: GPTDataset, options: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"batch_size": 4} | options
    with pytest.raises(ValueError, match=match):
        ThreadedBatchLoader(dataset, **arguments)


@pytest.mark.parametrize(
    "state",
    [{}, {"epoch": 0}, {"epoch": -1, "batches_yielded": 0}, {"epoch": 0, "batches_yielded": "2"}],
)
def test_bad_state(dataset: GPTDataset, state: dict[str, Any]) -> None:
    loader = ThreadedBatchLoader(dataset, 4)
    with pytest.raises(ValueError, match="loader state field"):
        loader.load_state_dict(state)


def test_make_data_loader_with_thread_workers(dataset: GPTDataset) -> None:
    loader = make_data_loader(dataset, 5, num_workers=2, worker_type="thread")
    assert isinstance(loader, ThreadedBatchLoader)
    assert_batches_equal(list(loader), list(make_data_loader(dataset, 5)))
    with pytest.raises(ValueError, match="worker_type"):
        make_data_loader(dataset, 5, worker_type="fiber")


def test_packed_dataset_batches_through_the_thread_loader(tmp_path: Path) -> None:
    # PackedDataset.__getitems__ returns a dict of batched tensors: the loaders pass it through
    # (it once went to default_collate, which cannot collate a dict of batches).
    from tokenmill.datasets.packed import PackedDataset, PackingConfig

    prefix = write_megatron_shard(
        tmp_path / "packed", random_documents(np.random.default_rng(3), 60, max_length=40)
    )
    packed = PackedDataset(IndexedDataset(prefix), PackingConfig(sequence_length=16))
    for workers in (0, 2):
        loader = ThreadedBatchLoader(packed, 4, num_workers=workers, drop_last=True)
        batches = list(loader)
        assert len(batches) == len(packed) // 4
        for number, batch in enumerate(batches):
            for key, value in batch.items():
                expected = torch.stack([packed[4 * number + row][key] for row in range(4)])
                assert torch.equal(value, expected), (workers, number, key)
