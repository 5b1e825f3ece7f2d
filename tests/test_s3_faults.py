"""Fault tests against a real S3-compatible server: injected 503 SlowDown answers, slow responses
(read timeouts), dropped connections, and the server stopped and restarted mid-read. Reads
succeed after retries, and fail with a clear error naming the object once the budget is spent.

Budgets and timeouts are tiny here (tens of milliseconds) so the whole module runs in seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oracles import import_oracle

import_oracle("boto3")
import_oracle("moto.server")

from s3_support import FaultProxy, MotoServer
from tokenmill.errors import ObjectStorageError
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.storage import s3
from tokenmill.storage.object_storage import ObjectStorageConfig
from tokenmill.storage.s3 import RetryPolicy, S3Client

from conftest import S3Bucket, random_documents, write_megatron_shard

FAST = RetryPolicy(max_attempts=5, backoff_base=0.01, backoff_max=0.02, read_timeout=2)


@pytest.fixture
def proxy(s3_bucket: S3Bucket) -> Iterator[FaultProxy]:
    port = int(s3_bucket.service.endpoint.rsplit(":", 1)[1])
    fault_proxy = FaultProxy(port)
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture
def use_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Point the process-wide clients at another endpoint (AWS_ENDPOINT_URL) for one test."""

    def switch(endpoint: str) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3.reset_clients()

    yield switch
    monkeypatch.undo()
    s3.reset_clients()


def test_503_slowdown_is_retried(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.put("object", bytes(range(200)))
    client = S3Client(FAST, endpoint_url=proxy.endpoint)
    proxy.fail(4)  # one short of the budget
    assert client.get_range(url, 10, 20) == bytes(range(10, 20))
    assert client.stats.snapshot()["retries"] == 4
    proxy.fail(2)
    assert client.exists(url)  # HEAD answered 503 twice, then 200


def test_503_beyond_the_budget_names_the_object(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.put("data/shard.bin", bytes(100))
    client = S3Client(FAST, endpoint_url=proxy.endpoint)
    proxy.fail(5)
    with pytest.raises(ObjectStorageError) as raised:
        client.get_range(url, 0, 10)
    message = str(raised.value)
    assert message.startswith(f"{url}: GET bytes=0-9 failed after 5 attempts")
    assert "retry budget spent" in message and "SlowDown" in message
    proxy.fail(5)
    with pytest.raises(ObjectStorageError, match="HEAD failed after 5 attempts"):
        client.exists(url)  # not "False": the object's existence is unknown
    assert client.get_range(url, 0, 10) == bytes(10)  # the server is fine again


def test_slow_responses_time_out_and_are_retried(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.put("slow", b"0123456789")
    # The hung requests never answer, so only the client's own timeout ends them; the others have
    # the whole timeout as margin on a loaded machine (the count of retries is then exact).
    policy = RetryPolicy(max_attempts=3, backoff_base=0.01, backoff_max=0.02, read_timeout=1.5)
    client = S3Client(policy, endpoint_url=proxy.endpoint)
    proxy.hang(2)
    assert client.get_range(url, 2, 5) == b"234"
    assert client.stats.snapshot()["retries"] == 2
    proxy.hang(3)
    with pytest.raises(ObjectStorageError, match=r"failed after 3 attempts .*[Tt]imeout"):
        client.get_range(url, 2, 5)


def test_dropped_connections_are_retried(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.put("dropped", b"abcdef")
    client = S3Client(FAST, endpoint_url=proxy.endpoint)
    proxy.drop(2)
    assert client.get_range(url, 0, 6) == b"abcdef"
    proxy.drop(5)
    with pytest.raises(ObjectStorageError, match="failed after 5 attempts"):
        client.get_range(url, 0, 6)


def test_non_retryable_errors_are_not_retried(s3_bucket: S3Bucket, proxy: FaultProxy) -> None:
    client = S3Client(FAST, endpoint_url=proxy.endpoint)
    with pytest.raises(FileNotFoundError, match="object not found"):
        client.get_range(s3_bucket.url("absent"), 0, 1)
    assert client.stats.snapshot() == {"requests": 1, "bytes_received": 0, "retries": 0}


@pytest.fixture
def shard_on_s3(s3_bucket: S3Bucket, tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "local").mkdir()
    local = write_megatron_shard(
        tmp_path / "local" / "c", random_documents(np.random.default_rng(3), 120)
    )
    return local, s3_bucket.upload_prefix(local, "faults/c")


def test_dataset_reads_through_intermittent_faults_equal_local(
    shard_on_s3: tuple[str, str], proxy: FaultProxy, use_endpoint: object, tmp_path: Path
) -> None:
    local_prefix, remote_prefix = shard_on_s3
    use_endpoint(proxy.endpoint)  # type: ignore[operator]
    config = ObjectStorageConfig(str(tmp_path / "cache"), bin_cache_nbytes=0, retry=FAST)
    proxy.fail(2)  # the .idx HEAD
    remote = IndexedDataset(remote_prefix, object_storage_config=config)
    local = IndexedDataset(local_prefix)
    for i in range(len(local)):
        if i % 7 == 0:
            proxy.fail(2)
        if i % 11 == 0:
            proxy.drop(1)
        np.testing.assert_array_equal(remote[i], local[i])
    assert proxy.faults > 20


def test_server_stopped_and_restarted_mid_read(
    shard_on_s3: tuple[str, str], use_endpoint: object, tmp_path: Path
) -> None:
    local_prefix, remote_prefix = shard_on_s3
    server = MotoServer()  # a second server on its own port (moto's buckets are per process)
    server.start()
    try:
        use_endpoint(server.endpoint)  # type: ignore[operator]
        # a budget far beyond any restart time: the restart waits for an event (the reader has
        # failed and retried), not for a timer racing the reader on a loaded machine
        patient = RetryPolicy(max_attempts=2000, backoff_base=0.01, backoff_max=0.05)
        config = ObjectStorageConfig(str(tmp_path / "cache"), bin_cache_nbytes=0, retry=patient)
        remote = IndexedDataset(remote_prefix, object_storage_config=config)
        local = IndexedDataset(local_prefix)
        for i in range(10):
            np.testing.assert_array_equal(remote[i], local[i])
        client = remote.bin_reader.client
        retried_before = client.stats.snapshot()["retries"]
        reads_done = threading.Event()
        restarted_after: list[int] = []

        def restart_once_the_reader_retries() -> None:
            while not reads_done.is_set():
                retried = client.stats.snapshot()["retries"] - retried_before
                if retried >= 2:  # the reader met the stopped server twice
                    server.start()
                    restarted_after.append(retried)
                    return
                time.sleep(0.005)

        server.stop()
        restarter = threading.Thread(target=restart_once_the_reader_retries, daemon=True)
        restarter.start()
        try:
            for i in range(10, len(local)):  # the first of these reads waits for the restart
                np.testing.assert_array_equal(remote[i], local[i])
        finally:
            reads_done.set()
            restarter.join()
        # the reads failed while the server was down and went on once it was back
        assert restarted_after and restarted_after[0] >= 2
        assert client.stats.snapshot()["retries"] - retried_before >= restarted_after[0]
    finally:
        server.stop()


def test_server_gone_fails_with_a_clear_error(
    shard_on_s3: tuple[str, str], use_endpoint: object, tmp_path: Path
) -> None:
    _, remote_prefix = shard_on_s3
    server = MotoServer()
    server.start()
    try:
        use_endpoint(server.endpoint)  # type: ignore[operator]
        config = ObjectStorageConfig(str(tmp_path / "cache"), bin_cache_nbytes=0, retry=FAST)
        remote = IndexedDataset(remote_prefix, object_storage_config=config)
        remote[0]
    finally:
        server.stop()
    with pytest.raises(ObjectStorageError) as raised:
        remote[1]
    message = str(raised.value)
    assert f"{remote_prefix}.bin: GET bytes=" in message
    assert "failed after 5 attempts" in message and "EndpointConnectionError" in message


@pytest.mark.parametrize("what", ["object", "undeclared size", "manifest"])
def test_an_s3_body_that_trickles_fails_at_the_total_deadline(
    tmp_path: Path, s3_bucket: S3Bucket, proxy: FaultProxy, use_endpoint: Any, what: str
) -> None:
    """A body that arrives one byte every 50 ms: every read succeeds within botocore's read
    timeout and nothing is retried, so only the total deadline (TransferPolicy.deadline, 2 s
    here) stops it, as it stops an HTTP one (issue #37). The 200-byte object would take 10 s."""
    import hashlib
    import json

    from tokenmill.storage.download import download
    from tokenmill.storage.manifest import Manifest, ManifestObject
    from tokenmill.storage.transfer import DeadlinePassed, TransferPolicy

    data = bytes(range(200))
    url = s3_bucket.put("pub/a.bin", data)
    digest = hashlib.sha256(data).hexdigest()
    declared = None if what == "undeclared size" else len(data)
    source: str | Manifest = Manifest((ManifestObject("a.bin", declared, digest, url=url),))
    if what == "manifest":
        entry = {"key": "a.bin", "size": len(data), "sha256": digest}
        text = {"format": "tokenmill.manifest", "version": 1, "objects": [entry], "config": None}
        source = s3_bucket.put("pub/manifest.json", json.dumps(text).encode())
    trickled = "/pub/manifest.json" if what == "manifest" else "/pub/a.bin"
    proxy.trickle_when(lambda command, path, headers: path.split("?")[0].endswith(trickled))
    use_endpoint(proxy.endpoint)  # type: ignore[operator]
    with pytest.raises(DeadlinePassed, match=r"(a\.bin|manifest\.json): not complete after 2 s"):
        download(source, str(tmp_path / "out"), policy=TransferPolicy(deadline=2.0))
    proxy.trickle_when(None)
    download(source, str(tmp_path / "out"), policy=TransferPolicy(deadline=2.0))
    assert (tmp_path / "out" / "a.bin").read_bytes() == data
