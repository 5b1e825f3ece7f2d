"""tokenmill.storage: the S3 client, the chunk cache, the local object cache and IndexedDataset on
s3:// against a real S3-compatible server (moto's server mode, see conftest.s3_service)."""

from __future__ import annotations

import functools
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from oracles import import_oracle

import_oracle("boto3")

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.errors import DataFormatError, ObjectChangedError, ObjectStorageError
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.storage.chunk_cache import ChunkCache
from tokenmill.storage.local_cache import cache_object, cache_object_if_exists, record_path
from tokenmill.storage.object_storage import (
    ObjectStorageConfig,
    get_index_cache_path,
    is_object_storage_path,
    local_cache_path,
)
from tokenmill.storage.s3 import RetryPolicy, S3Client, S3Url, get_client, is_s3_url

from conftest import S3Bucket, random_documents, write_megatron_shard

# -- URLs and configuration ------------------------------------------------------------------


def test_s3_url_parse_round_trip() -> None:
    url = S3Url.parse("s3://bucket/a/b/c.idx")
    assert (url.bucket, url.key) == ("bucket", "a/b/c.idx")
    assert str(url) == "s3://bucket/a/b/c.idx"
    assert S3Url.parse("s3://bucket").key == ""
    assert str(S3Url.parse("s3://bucket/dir").join("x.bin")) == "s3://bucket/dir/x.bin"
    assert str(S3Url.parse("s3://bucket/dir/").join("x.bin")) == "s3://bucket/dir/x.bin"
    assert is_s3_url("s3://b/k") and not is_s3_url("/local/s3://") and not is_s3_url(3)
    assert is_object_storage_path("msc://p/x") and not is_object_storage_path("data/x")


@pytest.mark.parametrize(
    ("url", "message"),
    [("/local/path", "not an s3:// URL"), ("s3:///key", "no bucket name"), ("s3://", "no bucket")],
)
def test_s3_url_rejects_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S3Url.parse(url)


@pytest.mark.parametrize("url", ["s3://bucket", "s3://bucket/", "s3://bucket/dir/"])
def test_s3_url_require_key(url: str) -> None:
    with pytest.raises(ValueError, match="does not name an object"):
        S3Url.parse(url).require_key()


def test_local_cache_path_is_megatron_layout(tmp_path: Path) -> None:
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path))
    expected = os.path.join(str(tmp_path), "bucket", "data", "shard.idx")
    assert get_index_cache_path("s3://bucket/data/shard.idx", config) == expected
    for bad in ("s3://bucket/../escape.idx", "s3://bucket/a//b.idx", "s3://bucket/./a.idx"):
        with pytest.raises(ValueError, match="cannot be mapped"):
            local_cache_path(bad, str(tmp_path))
    with pytest.raises(NotImplementedError, match="msc://"):
        get_index_cache_path("msc://profile/x.idx", config)


def test_object_storage_config_checks_and_coerces(tmp_path: Path) -> None:
    for field, value in [
        ("bin_chunk_nbytes", 0),
        ("bin_cache_nbytes", -1),
        ("prefetch_threads", -1),
        ("prefetch_samples", -2),
    ]:
        with pytest.raises(ValueError, match=field):
            ObjectStorageConfig(str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match="path_to_idx_cache"):
        ObjectStorageConfig("")

    class MegatronStyle:  # megatron-core's ObjectStorageConfig: two fields
        path_to_idx_cache = str(tmp_path)
        bin_chunk_nbytes = 1 << 20

    coerced = ObjectStorageConfig.coerce(MegatronStyle())
    assert (coerced.bin_chunk_nbytes, coerced.bin_cache_nbytes) == (1 << 20, 1 << 20)
    with pytest.raises(TypeError, match="path_to_idx_cache"):
        ObjectStorageConfig.coerce(object())


def test_retry_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_S3_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("TOKENMILL_S3_BACKOFF_BASE", "0.5")
    policy = RetryPolicy.from_env()
    assert (policy.max_attempts, policy.backoff_base) == (3, 0.5)
    monkeypatch.setenv("TOKENMILL_S3_MAX_ATTEMPTS", "three")
    with pytest.raises(
        ValueError, match="TOKENMILL_S3_MAX_ATTEMPTS must be an integer, got 'three'"
    ):
        RetryPolicy.from_env()
    monkeypatch.setenv("TOKENMILL_S3_MAX_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="TOKENMILL_S3_MAX_ATTEMPTS must be >= 1"):
        RetryPolicy.from_env()
    with pytest.raises(ValueError, match="read_timeout"):
        RetryPolicy(read_timeout=0)


def test_backoff_is_bounded_full_jitter() -> None:
    import random

    policy = RetryPolicy(backoff_base=0.1, backoff_max=1.0)
    generator = random.Random(0)
    for attempt in range(12):
        cap = min(1.0, 0.1 * 2**attempt)
        delays = [policy.delay(attempt, generator) for _ in range(50)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > cap / 2  # jitter spreads over the whole interval


# -- the chunk cache, against a local reference ------------------------------------------------


class CountingSource:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, start: int, stop: int) -> bytes:
        with self.lock:
            self.calls.append((start, stop))
        assert 0 <= start < stop <= len(self.data)
        return self.data[start:stop]


@given(
    size=st.integers(1, 3000),
    chunk=st.integers(1, 700),
    capacity_chunks=st.integers(0, 5),
    reads=st.lists(st.tuples(st.integers(0, 2999), st.integers(0, 900)), max_size=25),
)
def test_chunk_cache_reads_equal_the_object(
    size: int, chunk: int, capacity_chunks: int, reads: list[tuple[int, int]]
) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    source = CountingSource(data)
    cache = ChunkCache(
        source, size, chunk_bytes=chunk, capacity_bytes=capacity_chunks * chunk, prefetch_threads=0
    )
    for start, length in reads:
        start %= size
        length = min(length, size - start)
        assert cache.read(start, length) == data[start : start + length]
        assert len(cache.cached_chunks()) <= max(capacity_chunks, 0)
        if capacity_chunks:
            for call_start, call_stop in source.calls:  # aligned requests only
                assert call_start % chunk == 0
                assert call_stop % chunk == 0 or call_stop == size
    assert cache.stats.requests == len(source.calls)
    assert cache.stats.bytes_fetched == sum(b - a for a, b in source.calls)


def test_chunk_cache_lru_order_and_coalescing() -> None:
    data = bytes(range(256)) * 4  # 1024 bytes, 8 chunks of 128
    source = CountingSource(data)
    cache = ChunkCache(
        source, len(data), chunk_bytes=128, capacity_bytes=3 * 128, prefetch_threads=0
    )
    assert cache.read(100, 200) == data[100:300]  # chunks 0..2 in one request
    assert source.calls == [(0, 384)]
    assert cache.read(130, 10) == data[130:140]  # hit
    assert source.calls == [(0, 384)]
    assert cache.cached_chunks() == [0, 2, 1]
    cache.read(1000, 24)  # chunk 7 evicts chunk 0 (least recently used)
    assert cache.cached_chunks() == [2, 1, 7]
    assert cache.stats.evictions == 1
    assert (cache.stats.chunk_hits, cache.stats.chunk_misses) == (1, 4)


def test_chunk_cache_without_capacity_reads_exact_ranges() -> None:
    data = bytes(1000)
    source = CountingSource(data)
    cache = ChunkCache(source, len(data), chunk_bytes=64, capacity_bytes=0)
    cache.read(10, 5)
    cache.read(10, 5)
    assert source.calls == [(10, 15), (10, 15)]
    assert cache.prefetch([(0, 100)]) == 0


def test_chunk_cache_prefetch_then_hit() -> None:
    data = os.urandom(4096)
    source = CountingSource(data)
    cache = ChunkCache(source, len(data), chunk_bytes=256, capacity_bytes=4096, prefetch_threads=2)
    started = cache.prefetch([(0, 300), (1024, 10), (0, 5)])
    assert started == 3  # chunks 0, 1, 4 (0 named twice)
    cache.wait_idle()
    assert sorted(source.calls) == [(0, 256), (256, 512), (1024, 1280)]
    assert cache.read(200, 100) == data[200:300]
    assert cache.read(1030, 4) == data[1030:1034]
    assert len(source.calls) == 3  # both reads were hits
    assert cache.prefetch([(0, 300)]) == 0  # nothing left to fetch
    cache.close()


def test_chunk_cache_prefetch_budget_is_half_the_cache() -> None:
    data = bytes(64 * 100)
    source = CountingSource(data)
    cache = ChunkCache(source, len(data), chunk_bytes=64, capacity_bytes=64 * 8, prefetch_threads=1)
    assert cache.prefetch([(0, len(data))]) == 4
    cache.wait_idle()
    assert len(cache.cached_chunks()) == 4


def test_chunk_cache_failure_reaches_every_waiter() -> None:
    gate = threading.Event()

    def failing(start: int, stop: int) -> bytes:
        gate.wait(5)
        raise ObjectStorageError("s3://b/k: GET failed after 3 attempts")

    cache = ChunkCache(failing, 1000, chunk_bytes=100, capacity_bytes=1000, prefetch_threads=1)
    cache.prefetch([(0, 10)])
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            cache.read(0, 10)  # waits for the prefetch in flight
        except ObjectStorageError as error:
            errors.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and "after 3 attempts" in str(errors[0])
    assert cache.cached_chunks() == []
    with pytest.raises(ObjectStorageError):  # a later read tries again (and fails again)
        cache.read(0, 10)


def test_chunk_cache_rejects_bad_ranges_and_sizes() -> None:
    cache = ChunkCache(CountingSource(bytes(10)), 10, chunk_bytes=4, capacity_bytes=8)
    with pytest.raises(ValueError, match=r"\[8, 12\) is outside the 10-byte object"):
        cache.read(8, 4)
    with pytest.raises(ValueError, match="chunk_bytes must be > 0, got 0"):
        ChunkCache(CountingSource(b""), 0, chunk_bytes=0, capacity_bytes=0)
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        ChunkCache(CountingSource(b""), 0, chunk_bytes=1, capacity_bytes=-1)


def _slice(data: bytes, start: int, stop: int) -> bytes:
    return data[start:stop]


def test_chunk_cache_pickles_without_its_chunks() -> None:
    data = bytes(range(200))
    cache = ChunkCache(functools.partial(_slice, data), 200, chunk_bytes=50, capacity_bytes=200)
    cache.read(0, 10)
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.cached_chunks() == []
    assert copy.read(60, 10) == data[60:70]


# -- the client against the server ------------------------------------------------------------


def test_client_stat_exists_get_range_download_upload(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    payload = os.urandom(10_000)
    url = s3_bucket.put("dir/object.bin", payload)
    client = S3Client()
    info = client.stat(url)
    assert (info.url, info.size) == (url, len(payload)) and info.etag
    assert client.exists(url)
    # missing objects and buckets are reported as missing (megatron-core always says True)
    assert not client.exists(s3_bucket.url("dir/missing.bin"))
    assert not client.exists("s3://no-such-bucket-here/x")
    assert client.get_range(url, 100, 200) == payload[100:200]
    assert client.get_range(url, 0, 1, if_match=info.etag) == payload[:1]
    with pytest.raises(ValueError, match=r"\[5, 5\) is empty"):
        client.get_range(url, 5, 5)
    with pytest.raises(FileNotFoundError, match=r"object not found: s3://.*/dir/missing\.bin"):
        client.stat(s3_bucket.url("dir/missing.bin"))
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        client.get_range(s3_bucket.url("dir/missing.bin"), 0, 10)

    local = tmp_path / "copy.bin"
    assert client.download(url, local).etag == info.etag
    assert local.read_bytes() == payload
    assert [p.name for p in tmp_path.iterdir()] == ["copy.bin"]  # no temporary left

    source = tmp_path / "up.bin"
    source.write_bytes(b"uploaded")
    uploaded = client.upload(source, s3_bucket.url("dir/up.bin"))
    assert uploaded.size == 8 and s3_bucket.get("dir/up.bin") == b"uploaded"
    assert client.glob(s3_bucket.url("dir/*.bin")) == [url, s3_bucket.url("dir/up.bin")]
    assert client.glob(s3_bucket.url("dir/o*")) == [url]
    assert client.glob(s3_bucket.url("dir/up.bin")) == [s3_bucket.url("dir/up.bin")]
    assert client.glob(s3_bucket.url("dir/nothing*")) == []
    client.delete(s3_bucket.url("dir/up.bin"))
    assert not client.exists(s3_bucket.url("dir/up.bin"))
    with pytest.raises(FileNotFoundError):
        client.upload(tmp_path / "absent.bin", s3_bucket.url("dir/absent.bin"))


def test_if_match_detects_a_replaced_object(s3_bucket: S3Bucket) -> None:
    url = s3_bucket.put("obj", b"version one")
    client = S3Client()
    etag = client.stat(url).etag
    s3_bucket.put("obj", b"version two")
    with pytest.raises(ObjectChangedError, match="changed on the server since it was opened"):
        client.get_range(url, 0, 4, if_match=etag)


def test_client_reads_endpoint_and_credentials_from_environment(s3_bucket: S3Bucket) -> None:
    # no endpoint_url argument anywhere: AWS_ENDPOINT_URL (set by the fixture) decides
    url = s3_bucket.put("env", b"abc")
    assert get_client().get_range(url, 0, 3) == b"abc"
    assert os.environ["AWS_ENDPOINT_URL"] == s3_bucket.service.endpoint


# -- the local object cache ---------------------------------------------------------------------


def test_cache_object_downloads_once_and_refreshes_on_change(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    url = s3_bucket.put("data/shard.idx", b"index v1")
    client = S3Client()
    local = cache_object(url, str(tmp_path), client)
    assert local == os.path.join(str(tmp_path), s3_bucket.name, "data", "shard.idx")
    assert Path(local).read_bytes() == b"index v1" and os.path.exists(record_path(local))
    before = client.stats.snapshot()["bytes_received"]
    assert cache_object(url, str(tmp_path), client) == local  # a hit: HEAD only
    assert client.stats.snapshot()["bytes_received"] == before

    s3_bucket.put("data/shard.idx", b"index v2!")  # new ETag and size
    assert Path(cache_object(url, str(tmp_path), client)).read_bytes() == b"index v2!"
    s3_bucket.put("data/shard.idx", b"index v3!")  # same size, new ETag
    assert Path(cache_object(url, str(tmp_path), client)).read_bytes() == b"index v3!"

    Path(local).write_bytes(b"corrupt!!")  # same size, record intact but file edited locally
    os.remove(record_path(local))  # a missing record is a miss
    assert Path(cache_object(url, str(tmp_path), client)).read_bytes() == b"index v3!"

    assert cache_object_if_exists(s3_bucket.url("data/none.json"), str(tmp_path), client) is None
    with pytest.raises(FileNotFoundError, match=r"none\.json"):
        cache_object(s3_bucket.url("data/none.json"), str(tmp_path), client)


def test_cache_object_one_download_for_concurrent_callers(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    url = s3_bucket.put("big.idx", os.urandom(300_000))
    client = S3Client()
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache_object(url, str(tmp_path), client)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    # 4 HEADs before the lock + up to 4 after; exactly one body was transferred
    assert client.stats.snapshot()["bytes_received"] == 300_000


# -- IndexedDataset on s3:// --------------------------------------------------------------------


@pytest.fixture
def s3_shard(s3_bucket: S3Bucket, tmp_path: Path) -> tuple[str, str]:
    rng = np.random.default_rng(7)
    (tmp_path / "local").mkdir()
    local = write_megatron_shard(tmp_path / "local" / "corpus", random_documents(rng, 300))
    remote = s3_bucket.upload_prefix(local, "datasets/corpus")
    return local, remote


@pytest.mark.parametrize(
    "config_kwargs",
    [
        {},
        {"bin_chunk_nbytes": 256, "bin_cache_nbytes": 1024},
        {"bin_chunk_nbytes": 100, "bin_cache_nbytes": 0},
        {"bin_chunk_nbytes": 64, "bin_cache_nbytes": 64, "prefetch_threads": 0},
    ],
)
def test_indexed_dataset_from_s3_equals_local(
    s3_shard: tuple[str, str], tmp_path: Path, config_kwargs: dict[str, int]
) -> None:
    local_prefix, remote_prefix = s3_shard
    config = ObjectStorageConfig(str(tmp_path / "cache"), **config_kwargs)
    local = IndexedDataset(local_prefix)
    remote = IndexedDataset(remote_prefix, object_storage_config=config)
    assert len(remote) == len(local) == 300
    assert remote.dtype == local.dtype
    np.testing.assert_array_equal(remote.sequence_lengths, local.sequence_lengths)
    np.testing.assert_array_equal(remote.document_indices, local.document_indices)
    order = np.random.default_rng(0).permutation(len(local))
    for i in order[:60].tolist():
        np.testing.assert_array_equal(remote[i], local[i])
        length = int(local.sequence_lengths[i])
        np.testing.assert_array_equal(
            remote.get(i, offset=length // 3, length=length // 2),
            local.get(i, offset=length // 3, length=length // 2),
        )
    for left, right in zip(remote[10:40], local[10:40]):
        np.testing.assert_array_equal(left, right)
    # the .idx landed in megatron-core's cache layout
    cached_idx = os.path.join(str(tmp_path / "cache"), remote_prefix[len("s3://") :] + ".idx")
    assert Path(cached_idx).read_bytes() == Path(local_prefix + ".idx").read_bytes()
    # pickling re-opens from the cache (workers under spawn)
    copy = pickle.loads(pickle.dumps(remote))
    np.testing.assert_array_equal(copy[5], local[5])


def test_indexed_dataset_s3_errors(
    s3_bucket: S3Bucket, s3_shard: tuple[str, str], tmp_path: Path
) -> None:
    local_prefix, remote_prefix = s3_shard
    config = ObjectStorageConfig(str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="object_storage_config"):
        IndexedDataset(remote_prefix)
    with pytest.raises(FileNotFoundError, match=r"object not found: s3://.*/missing\.idx"):
        IndexedDataset(s3_bucket.url("datasets/missing"), object_storage_config=config)
    with pytest.raises(NotImplementedError, match="msc://"):
        IndexedDataset("msc://profile/data", object_storage_config=config)
    # a .bin that does not belong to the .idx
    s3_bucket.put("datasets/corpus.bin", Path(local_prefix + ".bin").read_bytes()[:-2])
    with pytest.raises(DataFormatError, match=r"corpus.bin: data object is \d+ bytes"):
        IndexedDataset(remote_prefix, object_storage_config=config)


def test_indexed_dataset_exists_on_s3(s3_bucket: S3Bucket, s3_shard: tuple[str, str]) -> None:
    _, remote_prefix = s3_shard
    assert IndexedDataset.exists(remote_prefix)
    assert not IndexedDataset.exists(s3_bucket.url("datasets/nothing"))
    s3_bucket.service.boto.delete_object(Bucket=s3_bucket.name, Key="datasets/corpus.bin")
    assert not IndexedDataset.exists(remote_prefix)  # .idx alone is not a dataset


def test_indexed_dataset_detects_replaced_bin(
    s3_bucket: S3Bucket, s3_shard: tuple[str, str], tmp_path: Path
) -> None:
    local_prefix, remote_prefix = s3_shard
    config = ObjectStorageConfig(str(tmp_path / "cache"), bin_cache_nbytes=0)
    remote = IndexedDataset(remote_prefix, object_storage_config=config)
    remote[0]
    data = bytearray(Path(local_prefix + ".bin").read_bytes())
    data[0] ^= 1
    s3_bucket.put("datasets/corpus.bin", bytes(data))
    with pytest.raises(ObjectChangedError, match=r"corpus\.bin changed on the server"):
        remote[1]


def _read_in_child(remote: IndexedDataset, local_prefix: str) -> None:
    local = IndexedDataset(local_prefix)
    for i in range(0, len(local), 7):
        if not np.array_equal(remote[i], local[i]):
            os._exit(3)
    os._exit(0)


def test_forked_child_reads_with_its_own_client_and_cache(
    s3_shard: tuple[str, str], tmp_path: Path
) -> None:
    import multiprocessing
    import warnings

    local_prefix, remote_prefix = s3_shard
    config = ObjectStorageConfig(
        str(tmp_path / "cache"), bin_chunk_nbytes=512, bin_cache_nbytes=4096
    )
    remote = IndexedDataset(remote_prefix, object_storage_config=config)
    remote[0]  # the parent has a boto3 client, cached chunks and (after prefetch) threads
    remote.bin_reader.prefetch([(0, 4096)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        child = multiprocessing.get_context("fork").Process(
            target=_read_in_child, args=(remote, local_prefix)
        )
        child.start()
    child.join(60)
    assert child.exitcode == 0


def test_remote_array_views_and_errors(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    from tokenmill.storage.remote import RemoteArray, S3BinReader

    values = np.arange(1000, dtype="<u2")
    url = s3_bucket.put("arr.bin", bytes(16) + values.tobytes())
    config = ObjectStorageConfig(str(tmp_path), bin_chunk_nbytes=128, bin_cache_nbytes=1024)
    reader = S3BinReader(url, config, S3Client())
    array = RemoteArray(reader, np.dtype("<u2"), 1000, 16, readahead_bytes=256)
    assert len(array) == 1000 and array.shape == (1000,)
    np.testing.assert_array_equal(array[10:300], values[10:300])
    np.testing.assert_array_equal(array[-5:], values[-5:])
    assert array[-1] == 999 and array[0] == 0
    assert array[5:5].shape == (0,)
    reader.cache.wait_idle()
    assert reader.stats.prefetched_chunks > 0  # read-ahead after the slice
    with pytest.raises(IndexError, match="token 1000 out of range for 1000 tokens"):
        array[1000]
    with pytest.raises(ValueError, match="only step-1 slices"):
        array[::2]
    with pytest.raises(ValueError, match="need 2018 bytes, the object has 2016"):
        RemoteArray(reader, np.dtype("<u2"), 1001, 16)
    assert reader.read(np.uint16, 3, 16 + 20).tolist() == [10, 11, 12]  # megatron's signature
    reader.close()


def test_multipart_upload(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.storage import s3

    monkeypatch.setattr(s3, "_MULTIPART_BYTES", 5 << 20)  # S3's smallest part size
    payload = os.urandom((5 << 20) + 1000)
    (tmp_path / "big.bin").write_bytes(payload)
    info = S3Client().upload(tmp_path / "big.bin", s3_bucket.url("big.bin"))
    assert info.size == len(payload) and info.etag.endswith('-2"')  # two parts
    assert s3_bucket.get("big.bin") == payload


def test_process_wide_client_can_be_replaced() -> None:
    from tokenmill.storage.s3 import set_client, using_client

    mine = S3Client(RetryPolicy(max_attempts=1))
    with using_client(mine):
        assert get_client() is mine
    assert get_client() is not mine
    previous = set_client(mine)
    assert set_client(previous) is mine


def test_staging_refuses_bucket_urls(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    from tokenmill.storage.staging import fetch_source, upload_prefix

    (tmp_path / "d.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="does not name an object"):
        upload_prefix(str(tmp_path / "d"), f"s3://{s3_bucket.name}")
    with pytest.raises(ValueError, match="not the bucket"):
        fetch_source(f"s3://{s3_bucket.name}/")


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'tokenmill\[s3\]'"):
        S3Client(RetryPolicy()).stat("s3://bucket/key")


def test_cache_object_needs_no_working_lock(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without locks (ENOLCK under NFS/Lustre `noflock`) the local copy is still
    made: the lock only saves a duplicate download (`common.locks`)."""
    import errno
    import fcntl

    def no_lock(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_lock)
    url = s3_bucket.put("data/shard.idx", b"index v1")
    local = cache_object(url, str(tmp_path), S3Client())
    assert Path(local).read_bytes() == b"index v1" and os.path.exists(record_path(local))
    assert not [p for p in Path(local).parent.iterdir() if p.name.endswith(".tmp")]
