"""Batch buffers are owned, not guessed: no batch changes after it is returned.

The pool reuses a batch's memory only when every array, tensor and view that reaches it has been
freed (weakref finalizers, not reference counts). The stress test gathers batches on several
threads while the consumer keeps, drops, slices and mutates earlier batches' tensors at random,
and checks every kept batch against a copy taken when it was returned.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import TinyTokenizer, random_documents, write_megatron_shard

torch = pytest.importorskip("torch")

from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.serving.buffers import BufferPool
from tokenmill.serving.layout import Field


def make_dataset(tmp_path: Path) -> GPTDataset:
    prefix = write_megatron_shard(
        tmp_path / "corpus", random_documents(np.random.default_rng(5), 300, max_length=200)
    )
    config = GPTDatasetConfig(
        random_seed=7, sequence_length=64, split="1", tokenizer=TinyTokenizer(),
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True,
        create_attention_mask=False, path_to_cache=str(tmp_path / "cache"),
    )  # fmt: skip
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, prefix, np.arange(len(indexed)), 400, Split.train, config)


def test_pool_returns_memory_only_when_every_view_is_freed() -> None:
    pool = BufferPool()
    fields = (Field("tokens", (8,), np.dtype(np.int64)), Field("mask", (8,), np.dtype(np.float32)))
    first = pool.lend(fields, 4)
    address = first["tokens"].ctypes.data
    tokens = torch.from_numpy(first["tokens"])
    keep = tokens[2:].view(torch.int32)  # a view of a slice of the tensor
    del first, tokens
    assert pool.free_sets(4) == 0  # the "mask" array died with `first`, "tokens" lives on
    assert pool.lend(fields, 4)["tokens"].ctypes.data != address
    del keep
    assert pool.free_sets(4) == 2  # both sets are free again
    addresses = {pool.lend(fields, 4)["tokens"].ctypes.data for _ in range(4)}
    assert address in addresses and pool.allocations == 2  # reused, nothing new allocated


def test_no_returned_batch_ever_changes_under_concurrent_gathers(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path)
    kept: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    kept_lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                start = rng.randrange(0, len(dataset) - 8)
                batch = dataset.get_batch(list(range(start, start + rng.choice((2, 4, 8)))))
                action = rng.random()
                if action < 0.35:  # keep it, with a copy to compare against later
                    held = {k: v[rng.randrange(0, 2) :] for k, v in batch.items()}  # a view
                    with kept_lock:
                        kept.append((held, {k: v.clone() for k, v in held.items()}))
                elif action < 0.5:  # mutate it: the consumer owns it
                    batch["tokens"].add_(1)
                with kept_lock:
                    if kept and rng.random() < 0.3:  # drop an old one
                        kept.pop(rng.randrange(len(kept)))
        except BaseException as error:  # re-raised by the assertion in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert kept
    for held, copy in kept:
        for key in held:
            assert torch.equal(held[key], copy[key]), key
