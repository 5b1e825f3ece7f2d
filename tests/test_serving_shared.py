"""Batches that cross process boundaries: torch's default collate passes them through, a
worker's batch pickles as one shared block, and a block is reused only after every tensor and
view of its batch is gone in the receiving process (tokenmill.serving.shared)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import TinyTokenizer

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, default_collate

from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.serving import shared
from tokenmill.serving.batch import BatchRow, SampleBatch
from tokenmill.serving.layout import Field


def dataset(shard: str, tmp_path: Path, **overrides: Any) -> GPTDataset:
    fields = {
        "random_seed": 3,
        "sequence_length": 64,
        "tokenizer": TinyTokenizer(),
        "blend": ([shard], None),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": True,
        "create_attention_mask": False,
        "path_to_cache": str(tmp_path / "cache"),
        **overrides,
    }
    low_level = IndexedDataset(shard)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, shard, indices, 3000, Split.train, GPTDatasetConfig(**fields))


def test_default_collate_passes_a_whole_batch_through(shard: str, tmp_path: Path) -> None:
    data = dataset(shard, tmp_path)
    batch = data.__getitems__([5, 1, 9])
    assert isinstance(batch, SampleBatch) and isinstance(batch[0], BatchRow)
    collated = default_collate(batch)
    assert list(collated) == list(batch.tensors)
    for key, tensor in collated.items():
        assert tensor.data_ptr() == batch.tensors[key].data_ptr()  # no copy
    # all rows of the batch, in order, are the batch too; any other list is stacked by torch
    assert default_collate(list(batch))["tokens"].data_ptr() == batch.tensors["tokens"].data_ptr()
    subset = default_collate([batch[2], batch[0]])
    expected = default_collate([data[9], data[5]])
    for key in expected:
        assert torch.equal(subset[key], expected[key])


def _pool_and_batch(count: int = 4) -> tuple[Any, Any, Any]:
    fields = (
        Field("tokens", (8,), np.dtype(np.int64)),
        Field("loss_mask", (8,), np.dtype(np.float32)),
    )
    pool = shared.SharedBlockPool(fields, torch)
    buffers = pool.take(count)
    buffers["tokens"][:] = np.arange(count * 8).reshape(count, 8)
    buffers["loss_mask"][:] = 1.0
    tensors = {key: torch.from_numpy(array) for key, array in buffers.items()}
    tensors["extra"] = torch.ones(2)  # not in the block: travels as itself
    return pool, buffers, shared.batch_in_block(tensors, buffers, pool)


def test_a_block_comes_back_only_when_every_tensor_and_view_is_gone() -> None:
    pool, buffers, batch = _pool_and_batch()
    block = buffers.block
    function, arguments = batch.__reduce__()
    assert function is shared.rebuild_shared_batch
    assert int(block.header[0]) == shared.LENT  # pickling lends it
    del buffers, batch
    received = function(*arguments)  # what the receiving process rebuilds
    assert list(received) == ["tokens", "loss_mask", "extra"]
    assert received["tokens"][1, 0] == 8 and received["tokens"].dtype == torch.int64
    view = received["tokens"][:, 2:4]
    assert pool.take(4).block is not block  # lent: a new block
    del received
    assert int(block.header[0]) == shared.LENT  # a view of one of its tensors is still alive
    del view
    assert int(block.header[0]) == shared.FREE
    assert any(pool.take(4).block is block for _ in range(3))  # reused


def test_a_block_used_in_its_own_process_is_never_lent() -> None:
    """Never pickled, a block is reused as soon as the worker itself holds no tensor of it."""
    pool, buffers, batch = _pool_and_batch()
    block = buffers.block
    assert pool.take(4).block is not block  # the batch still holds its tensors
    del buffers, batch
    assert pool.take(4).block is block


def test_lost_loans_are_given_up_after_a_while() -> None:
    """A batch that never reaches `rebuild_shared_batch` (unpacked by a custom collate, dropped
    at shutdown) leaves its block lent; the pool stops waiting for it and stays bounded."""
    pool, buffers, batch = _pool_and_batch()
    block = buffers.block
    batch.__reduce__()  # lent, never rebuilt
    del buffers, batch
    for _ in range(shared.SharedBlockPool.STALE_TAKES + shared.SharedBlockPool.PER_SIZE + 5):
        taken = pool.take(4)
        assert taken.block is not block
        del taken
    assert all(entry is not block for entry in pool._blocks[4])
    assert len(pool._blocks[4]) <= shared.SharedBlockPool.PER_SIZE


def test_shared_batch_pickles_as_its_block() -> None:
    """One storage in the pickle (the block), whatever the number of tensors."""
    _, _, batch = _pool_and_batch()
    storages: list[Any] = []

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                storages.append(obj.untyped_storage().data_ptr())
            return NotImplemented

    import io

    Recorder(io.BytesIO()).dump(batch)
    block_pointer = batch.block.block.untyped_storage().data_ptr()
    assert storages.count(block_pointer) == 1 and len(storages) == 2  # the block and "extra"


def test_worker_batches_equal_in_process_batches_and_stay_intact(
    shard: str, tmp_path: Path
) -> None:
    """Through a DataLoader with 2 worker processes and torch's default collate: every batch
    equals the in-process batch, batches and views kept by the consumer are never overwritten
    while the workers go on, and the workers reuse their blocks (the received tensors come back
    at a bounded set of addresses)."""
    data = dataset(shard, tmp_path)
    sampler = [list(range(start, start + 16)) for start in range(0, 16 * 120, 16)]
    addresses = set()
    for number, batch in enumerate(DataLoader(data, batch_sampler=sampler, num_workers=2)):
        expected = data.get_batch(sampler[number])
        assert list(batch) == list(expected)
        for key in expected:
            assert torch.equal(batch[key], expected[key]), (number, key)
        addresses.add(batch["tokens"].data_ptr())
    # released batches come back as the same few blocks (a fresh block per batch would give
    # about 120 addresses)
    assert len(addresses) <= 2 * shared.SharedBlockPool.PER_SIZE
    held: list[tuple[Any, Any]] = []
    for number, batch in enumerate(DataLoader(data, batch_sampler=sampler, num_workers=2)):
        if number % 10 == 0:
            view = batch["labels"][3:9, 5:]
            held.append((view, view.clone()))
            held.append((batch["tokens"], batch["tokens"].clone()))
        for kept, copy in held:
            assert torch.equal(kept, copy), number


def test_workers_forked_after_the_main_process_served_use_shared_blocks(
    shard: str, tmp_path: Path
) -> None:
    """A dataset served in the main process before its DataLoader starts (a warm-up batch, a
    check of one sample) still hands its workers' batches over as shared blocks: the server the
    workers inherit at fork finds out afresh that it runs in a worker. Before, it kept the main
    process's answer, and each batch went through torch's per-tensor copy into a new segment
    (0.5x the rate at B=8, S=2048; benchmarks/SERVING.md)."""
    import gc

    data = dataset(shard, tmp_path)
    sampler = [list(range(start, start + 16)) for start in range(0, 16 * 40, 16)]
    expected = [data.get_batch(indices) for indices in sampler]  # the main process serves first
    shared._RECENT.clear()  # filled only when a block received from a worker is released
    for number, batch in enumerate(DataLoader(data, batch_sampler=sampler, num_workers=2)):
        for key in expected[number]:
            assert torch.equal(batch[key], expected[number][key]), (number, key)
    del batch
    gc.collect()
    assert shared._RECENT, "the workers' batches did not come as shared blocks"
