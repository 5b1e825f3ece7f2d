"""The full path on s3://: GPTDataset, BlendedDataset through the builder and NanogptDataset read
from a real S3-compatible server (moto's server mode) give exactly the samples of local reads."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oracles import import_oracle

import_oracle("boto3")
torch = pytest.importorskip("torch")

from tokenmill.common.world import World
from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.nanogpt import NanogptDataset
from tokenmill.datasets.utils import Split
from tokenmill.errors import DataFormatError, TokenizerMismatchError
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.formats.nanogpt import write_nanogpt_shard
from tokenmill.storage.object_storage import ObjectStorageConfig

from conftest import S3Bucket, TinyTokenizer, random_documents, write_megatron_shard

SEQUENCE_LENGTH = 24


def gpt_config(blend: Any, **fields: Any) -> GPTDatasetConfig:
    values: dict[str, Any] = {
        "random_seed": 3,
        "sequence_length": SEQUENCE_LENGTH,
        "tokenizer": TinyTokenizer(),
        "blend": blend,
        "split": "1",
        "reset_position_ids": True,
        "reset_attention_mask": False,
        "eod_mask_loss": True,
        "create_attention_mask": False,
    }
    values.update(fields)
    return GPTDatasetConfig(**values)


def assert_samples_equal(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert list(left) == list(right)
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        if isinstance(left[name], torch.Tensor):
            assert torch.equal(left[name], right[name]), name
        else:
            assert left[name] == right[name], name


@pytest.fixture
def shards(s3_bucket: S3Bucket, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Two local shards and their copies in the bucket."""
    (tmp_path / "local").mkdir()
    local, remote = [], []
    for i, count in enumerate((150, 90)):
        documents = random_documents(np.random.default_rng(10 + i), count)
        prefix = write_megatron_shard(tmp_path / "local" / f"part{i}", documents)
        local.append(prefix)
        remote.append(s3_bucket.upload_prefix(prefix, f"corpus/part{i}"))
    return local, remote


def test_gpt_dataset_from_s3_equals_local(
    shards: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    local, remote = shards
    storage = ObjectStorageConfig(
        str(tmp_path / "objects"), bin_chunk_nbytes=2048, bin_cache_nbytes=32 << 10
    )
    ours = gpt_config(([local[0]], None), path_to_cache=str(tmp_path / "a"))
    theirs = gpt_config(
        ([remote[0]], None), path_to_cache=str(tmp_path / "b"), object_storage_cache_path=storage
    )
    local_low = GPTDataset.build_low_level_dataset(local[0], ours)
    remote_low = GPTDataset.build_low_level_dataset(remote[0], theirs)
    assert remote_low.bin_reader is not None
    indices = np.arange(len(local_low), dtype=np.int32)
    first = GPTDataset(local_low, local[0], indices, 120, Split.train, ours)
    second = GPTDataset(remote_low, remote[0], indices, 120, Split.train, theirs)
    assert len(first) == len(second) >= 120
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    for idx in range(len(first)):
        assert_samples_equal(first[idx], second[idx])
    batch = [5, 0, len(first) - 1, 17]
    expected, got = first.get_batch(batch), second.get_batch(batch)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # reading in index order announced the following samples to the prefetcher
    stats = remote_low.bin_reader.stats
    assert stats.prefetched_chunks > 0 and stats.chunk_hits > 0
    # a pickled copy (a DataLoader worker under spawn) reads the same samples
    copy = pickle.loads(pickle.dumps(second))
    assert_samples_equal(copy[7], first[7])


def test_gpt_dataset_chunk_cache_off_equals_local(
    shards: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    local, remote = shards
    storage = ObjectStorageConfig(str(tmp_path / "objects"), bin_cache_nbytes=0)
    config = gpt_config(([remote[1]], None), object_storage_cache_path=storage)
    remote_low = GPTDataset.build_low_level_dataset(remote[1], config)
    local_low = IndexedDataset(local[1])
    indices = np.arange(len(local_low), dtype=np.int32)
    second = GPTDataset(remote_low, remote[1], indices, None, Split.train, config)
    first = GPTDataset(
        local_low, local[1], indices, None, Split.train, gpt_config(([local[1]], None))
    )
    for idx in range(0, len(first), 3):
        assert_samples_equal(first[idx], second[idx])
    assert remote_low.bin_reader.stats.chunk_hits == 0  # every read went to the server
    # without path_to_cache the indices live beside the cached .idx, not in "./s3:/..."
    cache = os.path.join(str(tmp_path / "objects"), remote[1][len("s3://") :], "cache")
    assert os.path.isdir(os.path.join(cache, "GPTDataset_indices"))
    assert not os.path.exists("s3:")


def test_builder_blend_from_s3_equals_local(
    shards: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    local, remote = shards
    sizes = [200, 30, 10]
    common: dict[str, Any] = {"split": "80,15,5"}
    local_config = gpt_config((local, [0.7, 0.3]), path_to_cache=str(tmp_path / "l"), **common)
    remote_config = gpt_config(
        (remote, [0.7, 0.3]),
        path_to_cache=str(tmp_path / "r"),
        object_storage_cache_path=str(tmp_path / "objects"),  # megatron's field: a directory
        **common,
    )
    expected = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, local_config).build()
    got = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, remote_config).build()
    for split_expected, split_got in zip(expected, got):
        assert isinstance(split_got, BlendedDataset)
        assert len(split_expected) == len(split_got)
        np.testing.assert_array_equal(split_expected.dataset_index, split_got.dataset_index)
        for idx in range(len(split_got)):
            assert_samples_equal(split_expected[idx], split_got[idx])
    # megatron-core's layout for the cached .idx: <cache>/<bucket>/<key>.idx
    for prefix in remote:
        assert os.path.isfile(os.path.join(str(tmp_path / "objects"), prefix[5:] + ".idx"))


@pytest.mark.megatron
def test_cached_idx_path_matches_megatron(tmp_path: Path) -> None:
    megatron_utils = import_oracle("megatron.core.datasets.object_storage_utils")
    from tokenmill.storage.object_storage import get_index_cache_path

    idx = "s3://bucket/some/dir/data_text_document.idx"
    config = ObjectStorageConfig(str(tmp_path))
    theirs = megatron_utils.get_index_cache_path(
        idx, megatron_utils.ObjectStorageConfig(path_to_idx_cache=str(tmp_path))
    )
    assert get_index_cache_path(idx, config) == theirs


def test_builder_checks_tokenizer_sidecars_on_s3(
    s3_bucket: S3Bucket, shards: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    import json

    _, remote = shards
    for i, (_prefix, vocab) in enumerate(zip(remote, (1000, 1001))):
        sidecar = {
            "format": "tokenmill.dataset",
            "version": 1,
            "tokenizer": {
                "kind": "bytes",
                "sha256": "0" * 64,
                "vocab_size": vocab,
                "bos_id": None,
                "eod_id": 0,
            },
        }
        s3_bucket.put(f"corpus/part{i}.tokenmill.json", json.dumps(sidecar).encode())
    config = gpt_config((remote, [0.5, 0.5]), object_storage_cache_path=str(tmp_path / "objects"))
    with pytest.raises(TokenizerMismatchError, match="vocab_size"):
        BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config).build()


def test_gpt_dataset_s3_needs_cache_path(shards: tuple[list[str], list[str]]) -> None:
    _, remote = shards
    with pytest.raises(ValueError, match="object_storage_cache_path"):
        GPTDataset.build_low_level_dataset(remote[0], gpt_config(([remote[0]], None)))


# -- NanogptDataset --------------------------------------------------------------------------

BOS = 0
SEQ = 7


def make_nanogpt(directory: Path, sizes: list[int]) -> list[str]:
    rng = np.random.default_rng(4)
    directory.mkdir(parents=True, exist_ok=True)
    paths, offset = [], 1
    for i, size in enumerate(sizes):
        tokens = np.arange(offset, offset + size, dtype=np.int64)
        offset += size
        tokens[rng.random(size) < 1 / 6] = BOS
        path = directory / f"fineweb_train_{i:03d}.bin"
        # shard 0 gets a .bos.idx, shard 1 none (scanned after a whole download)
        write_nanogpt_shard(path, tokens, np.uint32, bos_token=BOS if i == 0 else None)
        paths.append(str(path))
    return paths


def windows(dataset: NanogptDataset, ranks: int, workers: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for rank in range(ranks):
        for worker in range(workers):
            dataset.world = World(rank, ranks, worker, workers)
            out += [(*tuple(s["input_ids"].tolist()), int(s["labels"][-1])) for s in dataset]
    return out


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize(("ranks", "workers"), [(1, 1), (2, 3)])
def test_nanogpt_dataset_from_s3_equals_local(
    s3_bucket: S3Bucket, tmp_path: Path, align: bool, ranks: int, workers: int
) -> None:
    paths = make_nanogpt(tmp_path / "local", [700, 523, 301])
    for path in paths:
        name = os.path.basename(path)
        s3_bucket.put(f"nanogpt/{name}", Path(path).read_bytes())
        sidecar = path[: -len(".bin")] + ".bos.idx"
        if os.path.exists(sidecar):
            s3_bucket.put(f"nanogpt/{os.path.basename(sidecar)}", Path(sidecar).read_bytes())
    storage = ObjectStorageConfig(
        str(tmp_path / "objects"), bin_chunk_nbytes=256, bin_cache_nbytes=1024
    )
    options: dict[str, Any] = {"bos_token": BOS, "align_to_bos": align, "shuffle_files": True}
    local = NanogptDataset(str(tmp_path / "local" / "fineweb_train_*.bin"), SEQ, **options)
    remote = NanogptDataset(
        s3_bucket.url("nanogpt/fineweb_train_*.bin"),
        SEQ,
        object_storage_config=storage,
        **options,
    )
    assert remote.files == [s3_bucket.url(f"nanogpt/{os.path.basename(p)}") for p in paths]
    assert remote.token_counts == local.token_counts
    expected = windows(local, ranks, workers)
    assert windows(remote, ranks, workers) == expected
    assert len(expected) > 50


def test_nanogpt_s3_bad_bos_index_is_refused_when_read(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    paths = make_nanogpt(tmp_path / "local", [300])
    s3_bucket.put("n/a.bin", Path(paths[0]).read_bytes())
    from tokenmill.formats.bos_index import write_bos_index

    write_bos_index(tmp_path / "wrong.bos.idx", [1, 5], token_count=300)  # not BOS positions
    s3_bucket.put("n/a.bos.idx", (tmp_path / "wrong.bos.idx").read_bytes())
    dataset = NanogptDataset(
        [s3_bucket.url("n/a.bin")],
        SEQ,
        bos_token=BOS,
        align_to_bos=True,
        object_storage_config=ObjectStorageConfig(str(tmp_path / "objects")),
    )
    with pytest.raises(DataFormatError, match=r"a\.bin: its \.bos\.idx lists position 1"):
        list(dataset)


def test_nanogpt_s3_errors(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    s3_bucket.put("n/bad.bin", b"\x00" * 100)
    storage = ObjectStorageConfig(str(tmp_path / "objects"))
    with pytest.raises(ValueError, match="object_storage_config"):
        NanogptDataset(s3_bucket.url("n/*.bin"), SEQ)
    with pytest.raises(FileNotFoundError, match="no files matched"):
        NanogptDataset(s3_bucket.url("n/none_*.bin"), SEQ, object_storage_config=storage)
    with pytest.raises(DataFormatError, match=r"bad\.bin: file is 100 bytes, shorter than"):
        NanogptDataset(s3_bucket.url("n/*.bin"), SEQ, object_storage_config=storage)


def test_packed_dataset_from_s3_equals_local(
    shards: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    from tokenmill.datasets.packed import PackedDataset, PackingConfig

    local, remote = shards
    config = PackingConfig(sequence_length=32, window_overlap=2, max_documents_per_row=4)
    storage = ObjectStorageConfig(str(tmp_path / "objects"), bin_chunk_nbytes=1024)
    expected = PackedDataset(IndexedDataset(local[1]), config)
    got = PackedDataset(IndexedDataset(remote[1], object_storage_config=storage), config)
    assert len(got) == len(expected) > 10
    for idx in range(len(expected)):
        assert_samples_equal(expected[idx], got[idx])
