"""publish / download: round trips over a real S3-compatible server (moto) and a local HTTP
server, resume after SIGKILL, checksum failures, background downloads, bad manifests."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokenmill.common.locks as locks_module
from tokenmill.cli.main import main
from tokenmill.errors import ChecksumError
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.storage.download import STATE_NAME, download, start_download
from tokenmill.storage.manifest import Manifest, ManifestObject, parse_shard_list
from tokenmill.storage.publish import collect_files, publish
from tokenmill.storage.transfer import TransferPolicy, load_manifest

from conftest import random_documents, write_megatron_shard

FAST = TransferPolicy(workers=2, max_attempts=4, backoff_base=0.01, backoff_max=0.05, timeout=10)


# -- a local HTTP server with ranges, a request log, throttling and gates -----------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        state = self.server
        name = self.path.lstrip("/")
        with state.lock:
            state.log.append((name, self.headers.get("Range")))
            failures = state.failures.get(name, 0)
            if failures:
                state.failures[name] = failures - 1
        if failures:
            self.send_error(503, "try again")
            return
        gate = state.gates.get(name)
        if gate is not None:
            gate.wait(30)
        path = state.root / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        byte_range = self.headers.get("Range")
        if byte_range:
            start = int(byte_range.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        delay = state.slow.get(name, 0.0)
        hold = state.hold_after.get(name)
        step = 16 << 10
        try:
            for offset in range(0, len(body), step):
                self.wfile.write(body[offset : offset + step])
                if delay:
                    self.wfile.flush()
                    time.sleep(delay)
                if hold is not None and offset + step >= hold[0]:
                    self.wfile.flush()
                    hold[1].wait(60)  # stop mid-object until the test lets go
                    hold = None
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.lock = threading.Lock()
        self.log: list[tuple[str, str | None]] = []
        self.failures: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.slow: dict[str, float] = {}
        # name -> (bytes, event): after sending that many bytes of the object, wait for the event
        self.hold_after: dict[str, tuple[int, threading.Event]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def requests_for(self, name: str) -> list[str | None]:
        with self.lock:
            return [byte_range for logged, byte_range in self.log if logged == name]


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[_Server]:
    root = tmp_path / "served"
    root.mkdir()
    server = _Server(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        for gate in server.gates.values():
            gate.set()
        server.shutdown()
        server.server_close()


def make_dataset(directory: Path, count: int = 3, documents: int = 60) -> list[str]:
    rng = np.random.default_rng(3)
    directory.mkdir(parents=True, exist_ok=True)
    prefixes = []
    for i in range(count):
        prefix = write_megatron_shard(
            directory / f"shard{i}", random_documents(rng, documents, 200)
        )
        prefixes.append(prefix)
    cache = directory / "cache"
    cache.mkdir()
    (cache / "abc-GPTDataset-train-description.txt").write_text("{}")
    (cache / "abc-GPTDataset-train-sample_index.npy").write_bytes(os.urandom(3000))
    (cache / ".abc-GPTDataset-train.lock").write_text("")  # never published
    return prefixes


def tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


# -- collecting files, manifests -----------------------------------------------------------------


def test_collect_files(tmp_path: Path) -> None:
    prefixes = make_dataset(tmp_path / "data")
    Path(prefixes[0] + ".tokenmill.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("x")
    files = collect_files(
        [*prefixes[:2], str(tmp_path / "data" / "cache"), str(tmp_path / "notes.txt")]
    )
    assert [key for key, _ in files] == [
        "cache/abc-GPTDataset-train-description.txt",
        "cache/abc-GPTDataset-train-sample_index.npy",
        "notes.txt",
        "shard0.bin",
        "shard0.idx",
        "shard0.tokenmill.json",
        "shard1.bin",
        "shard1.idx",
    ]
    with pytest.raises(FileNotFoundError, match=r"nothing to publish at .*absent"):
        collect_files([str(tmp_path / "absent")])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "shard0.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"would be published as 'shard0.bin'"):
        collect_files([prefixes[0], str(tmp_path / "other" / "shard0.bin")])


def test_manifest_round_trip_and_validation() -> None:
    digest = "ab" * 32
    manifest = Manifest((ManifestObject("a/b.bin", 3, digest),), {"seed": 1})
    assert Manifest.from_json(manifest.to_json(), "m") == manifest
    good = json.loads(manifest.to_json())
    cases = [
        ({**good, "format": "x"}, "format is 'x'"),
        ({**good, "version": 9}, "unsupported manifest version 9"),
        ({**good, "objects": {}}, "'objects' must be a list"),
        ({**good, "objects": [{"key": "../x", "size": 1, "sha256": digest}]}, "'..'"),
        ({**good, "objects": [{"key": "/x", "size": 1, "sha256": digest}]}, "relative path"),
        ({**good, "objects": [{"key": "x", "size": -1, "sha256": digest}]}, "size must be"),
        ({**good, "objects": [{"key": "x", "size": 1, "sha256": "zz"}]}, "64 hex digits"),
        ({**good, "objects": [{"key": "x", "size": 1}]}, "size and sha256 are required"),
        ({**good, "objects": [good["objects"][0]] * 2}, "appears twice"),
        ({**good, "config": 3}, "'config' must be an object"),
    ]
    for payload, message in cases:
        with pytest.raises(ValueError, match=message):
            Manifest.from_json(json.dumps(payload), "bad.json")
    with pytest.raises(ValueError, match=r"bad.json: manifest is not valid JSON"):
        Manifest.from_json("{", "bad.json")


def test_shard_lists() -> None:
    digest = "cd" * 32
    manifest = parse_shard_list(
        ["# comment", "https://h/x/shard_000.bin " + digest, "", "http://h/shard_001.bin"], "list"
    )
    assert [(o.key, o.sha256, o.url) for o in manifest.objects] == [
        ("shard_000.bin", digest, "https://h/x/shard_000.bin"),
        ("shard_001.bin", None, "http://h/shard_001.bin"),
    ]
    for lines, message in [
        (["ftp://h/x"], r"list:1: expected 'URL \[sha256\]'"),
        (["https://h/x nothex"], "is not a sha256"),
        (["https://h/a/x", "https://h/b/x"], "'x' appears twice"),
        (["# nothing"], "no URLs"),
        (["https://h/"], "object key must be a non-empty string"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_shard_list(lines, "list")


def test_policy_validation() -> None:
    for field, value in [("workers", 0), ("max_attempts", 0), ("part_bytes", 0), ("timeout", 0)]:
        with pytest.raises(ValueError, match=f"TransferPolicy.{field}"):
            TransferPolicy(**{field: value})


# -- local directory + HTTP ---------------------------------------------------------------------


def test_publish_to_a_directory_then_download_over_http(tmp_path: Path, http_root: _Server) -> None:
    prefixes = make_dataset(tmp_path / "data")
    paths = [*prefixes, str(tmp_path / "data" / "cache")]
    report = publish(paths, str(http_root.root), config={"seed": 7}, policy=FAST)
    assert len(report.uploaded) == 8 and report.skipped == []
    manifest = Manifest.from_json((http_root.root / "manifest.json").read_text(), "m")
    assert manifest.config == {"seed": 7}
    for item in manifest.objects:
        data = (http_root.root / item.key).read_bytes()
        assert (item.size, item.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    # publishing again sends nothing
    again = publish(paths, str(http_root.root), policy=FAST)
    assert again.uploaded == [] and len(again.skipped) == 8 and again.bytes_uploaded == 0

    local = tmp_path / "local"
    result = download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    assert len(result.fetched) == 8 and result.bytes_fetched == manifest.total_bytes
    assert tree(local) == {k: v for k, v in tree(http_root.root).items() if k != "manifest.json"}
    assert (
        IndexedDataset(str(local / "shard1"))[3].tolist() == IndexedDataset(prefixes[1])[3].tolist()
    )
    # a second download fetches nothing and does not even re-hash (recorded as verified)
    count = len(http_root.log)
    result = download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    assert result.fetched == [] and len(result.skipped) == 8
    assert len(http_root.log) == count + 1  # only the manifest


def test_http_retries_transient_errors(tmp_path: Path, http_root: _Server) -> None:
    prefixes = make_dataset(tmp_path / "data", count=1)
    publish(prefixes, str(http_root.root), policy=FAST)
    http_root.failures["shard0.bin"] = 2
    download(f"{http_root.url}/manifest.json", str(tmp_path / "local"), policy=FAST)
    assert http_root.requests_for("shard0.bin") == [None, None, None]
    assert (tmp_path / "local" / "shard0.bin").read_bytes() == Path(
        prefixes[0] + ".bin"
    ).read_bytes()
    # out of attempts: a clear error naming the URL and the attempts
    http_root.failures["shard0.idx"] = 10
    (tmp_path / "local" / "shard0.idx").unlink()
    from tokenmill.errors import ObjectStorageError

    with pytest.raises(ObjectStorageError, match=r"shard0.idx: failed after 4 attempts"):
        download(f"{http_root.url}/manifest.json", str(tmp_path / "local"), policy=FAST)


def test_corrupted_object_fails_checksum(tmp_path: Path, http_root: _Server) -> None:
    prefixes = make_dataset(tmp_path / "data", count=2)
    publish(prefixes, str(http_root.root), policy=FAST)
    served = http_root.root / "shard1.bin"
    data = bytearray(served.read_bytes())
    data[100] ^= 1
    served.write_bytes(bytes(data))
    local = tmp_path / "local"
    with pytest.raises(ChecksumError, match=r"shard1.bin: sha256 mismatch: got [0-9a-f]{64}, the"):
        download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    assert not (local / "shard1.bin").exists() and not (local / ".shard1.bin.partial").exists()
    assert (local / "shard0.bin").exists()  # the good objects landed
    served.write_bytes(served.read_bytes()[:-1])
    with pytest.raises(ChecksumError, match="object has 12103 bytes but the manifest says 12104"):
        download(f"{http_root.url}/manifest.json", str(local), policy=FAST)


def test_a_replaced_local_file_is_fetched_again(tmp_path: Path, http_root: _Server) -> None:
    prefixes = make_dataset(tmp_path / "data", count=1)
    publish(prefixes, str(http_root.root), policy=FAST)
    local = tmp_path / "local"
    download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    (local / "shard0.bin").write_bytes(b"garbage")
    result = download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    assert result.fetched == ["shard0.bin"]
    assert (local / "shard0.bin").read_bytes() == Path(prefixes[0] + ".bin").read_bytes()


def test_download_killed_midway_resumes(tmp_path: Path, http_root: _Server) -> None:
    rng = np.random.default_rng(5)
    data = tmp_path / "data"
    data.mkdir()
    prefixes = [
        write_megatron_shard(data / f"shard{i}", random_documents(rng, 400, 300)) for i in range(3)
    ]
    publish(prefixes, str(http_root.root), policy=FAST)
    # the server stops after 32 KiB of shard1.bin until released: the kill lands inside it
    release = threading.Event()
    http_root.hold_after["shard1.bin"] = (32 << 10, release)
    local = tmp_path / "local"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill.cli.main",
            "download",
            f"{http_root.url}/manifest.json",
            str(local),
            "--workers",
            "1",
        ],
    )
    partial = local / ".shard1.bin.partial"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size >= 32 << 10):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    release.set()
    http_root.hold_after.clear()
    assert (local / "shard0.bin").exists() and (local / "shard0.idx").exists()
    assert not (local / "shard1.bin").exists()
    have = partial.stat().st_size
    with http_root.lock:
        http_root.log.clear()
    result = download(f"{http_root.url}/manifest.json", str(local), policy=FAST)
    assert sorted(result.skipped) == ["shard0.bin", "shard0.idx"]
    assert http_root.requests_for("shard0.bin") == [] and http_root.requests_for("shard0.idx") == []
    assert http_root.requests_for("shard1.bin") == [f"bytes={have}-"]  # continued, not restarted
    assert tree(local) == {k: v for k, v in tree(http_root.root).items() if k != "manifest.json"}


def test_first_shards_are_readable_while_the_rest_download(
    tmp_path: Path, http_root: _Server
) -> None:
    prefixes = make_dataset(tmp_path / "data")
    publish(prefixes, str(http_root.root), policy=FAST)
    gate = http_root.gates["shard2.bin"] = threading.Event()
    job = start_download(f"{http_root.url}/manifest.json", str(tmp_path / "local"), policy=FAST)
    job.wait("shard0.bin", timeout=20)
    job.wait("shard0.idx", timeout=20)
    first = IndexedDataset(str(tmp_path / "local" / "shard0"))
    assert first[0].tolist() == IndexedDataset(prefixes[0])[0].tolist()
    assert not job.done()
    with pytest.raises(TimeoutError, match=r"shard2.bin is not downloaded"):
        job.wait("shard2.bin", timeout=0.05)
    gate.set()
    report = job.result(timeout=30)
    assert len(report.fetched) == 6
    with pytest.raises(KeyError, match="no object 'nope'"):
        job.wait("nope")


def test_plain_http_shard_list(
    tmp_path: Path, http_root: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(3):
        (http_root.root / f"shard_{i:05d}.parquet").write_bytes(os.urandom(5000 + i))
    digest = hashlib.sha256((http_root.root / "shard_00000.parquet").read_bytes()).hexdigest()
    listing = tmp_path / "shards.txt"
    listing.write_text(
        f"{http_root.url}/shard_00000.parquet {digest}\n{http_root.url}/shard_00001.parquet\n"
    )
    assert main(["download", str(listing), str(tmp_path / "a"), "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".")) == [
        "shard_00000.parquet",
        "shard_00001.parquet",
    ]
    assert (
        main(["download", "--url", f"{http_root.url}/shard_00002.parquet", str(tmp_path / "b")])
        == 0
    )
    captured = capsys.readouterr()
    assert "downloaded 1 objects" in captured.out
    assert "[download] 1 fetched shard_00002.parquet" in captured.err
    assert "no sha256 to verify: shard_00002.parquet" in captured.err
    # a bad checksum in the list is caught
    listing.write_text(f"{http_root.url}/shard_00001.parquet {'0' * 64}\n")
    assert main(["download", str(listing), str(tmp_path / "c")]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err


def test_cli_errors(tmp_path: Path, http_root: _Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["download", f"{http_root.url}/manifest.json", str(tmp_path / "x")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["download", "a", "b", "c"]) == 2
    assert "expected SOURCE LOCAL_DIR" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "absent"), str(tmp_path / "out")]) == 2
    assert "nothing to publish" in capsys.readouterr().err
    assert main(["publish", str(tmp_path), "https://host/x"]) == 2
    assert "use an s3:// URL or a local directory" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"format": "tokenmill.manifest", "version": 1, "objects": [{"key": "../x", "size": 1, "sha256": "'
        + "a" * 64
        + '"}]}'
    )
    assert main(["download", str(bad), str(tmp_path / "y")]) == 2
    assert "must be a relative path" in capsys.readouterr().err


# -- S3 (moto server) -----------------------------------------------------------------------------


def test_publish_and_download_through_s3(tmp_path: Path, s3_bucket: Any) -> None:
    prefixes = make_dataset(tmp_path / "data")
    big = tmp_path / "data" / "big.bin"
    big.write_bytes(os.urandom(11 << 20))  # multipart: 5 MiB parts (S3's minimum)
    policy = TransferPolicy(workers=2, part_bytes=5 << 20, backoff_base=0.01)
    destination = s3_bucket.url("runs/r1")
    paths = [*prefixes, str(tmp_path / "data" / "cache"), str(big)]
    report = publish(paths, destination, config={"seed": 1}, policy=policy)
    assert len(report.uploaded) == 9
    boto = s3_bucket.service.boto
    head = boto.head_object(Bucket=s3_bucket.name, Key="runs/r1/big.bin")
    assert head["Metadata"]["sha256"] == hashlib.sha256(big.read_bytes()).hexdigest()
    assert head["ETag"].endswith('-3"')  # 3 parts
    assert json.loads(s3_bucket.get("runs/r1/manifest.json"))["config"] == {"seed": 1}
    again = publish(paths, destination, policy=policy)
    assert again.uploaded == [] and len(again.skipped) == 9

    local = tmp_path / "local"
    reads = TransferPolicy(workers=2, part_bytes=4 << 20)  # ranged GETs of 4 MiB
    result = download(destination + "/manifest.json", str(local), policy=reads)
    assert len(result.fetched) == 9
    expected = {k: v for k, v in tree(tmp_path / "data").items() if not k.endswith(".lock")}
    assert tree(local) == expected
    # a rerun after a crash: the finished objects are not fetched again
    (local / "shard2.bin").unlink()
    (local / ".big.bin.partial").write_bytes(big.read_bytes()[: 6 << 20])
    (local / "big.bin").unlink()
    result = download(destination + "/manifest.json", str(local), policy=reads)
    assert result.fetched == ["big.bin", "shard2.bin"]
    assert result.bytes_fetched == (5 << 20) + os.path.getsize(prefixes[2] + ".bin")
    assert tree(local) == expected


def test_s3_multipart_upload_resumes(tmp_path: Path, s3_bucket: Any) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 << 20))
    boto = s3_bucket.service.boto
    key = "p/big.bin"
    upload = boto.create_multipart_upload(Bucket=s3_bucket.name, Key=key)
    data = big.read_bytes()
    boto.upload_part(
        Bucket=s3_bucket.name,
        Key=key,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=data[: 5 << 20],
    )
    boto.upload_part(  # a stale part 2 from another version of the file: must be re-sent
        Bucket=s3_bucket.name,
        Key=key,
        UploadId=upload["UploadId"],
        PartNumber=2,
        Body=os.urandom(5 << 20),
    )
    policy = TransferPolicy(workers=1, part_bytes=5 << 20)
    report = publish([str(big)], s3_bucket.url("p"), policy=policy)
    assert report.bytes_uploaded == len(data) - (5 << 20)  # part 1 was kept
    with pytest.raises(ValueError, match="below S3's multipart minimum of 5 MiB"):
        publish([str(big)], s3_bucket.url("p"), policy=TransferPolicy(part_bytes=1 << 20))
    assert s3_bucket.get(key) == data


def test_corrupted_s3_object_fails_checksum(tmp_path: Path, s3_bucket: Any) -> None:
    prefixes = make_dataset(tmp_path / "data", count=1)
    publish(prefixes, s3_bucket.url("r"), policy=FAST)
    original = s3_bucket.get("r/shard0.bin")
    s3_bucket.put("r/shard0.bin", original[:50] + bytes([original[50] ^ 1]) + original[51:])
    with pytest.raises(ChecksumError, match=r"s3://.*/r/shard0.bin: sha256 mismatch"):
        download(s3_bucket.url("r/manifest.json"), str(tmp_path / "local"), policy=FAST)
    s3_bucket.put("r/shard0.bin", original)
    s3_bucket.put("r/shard0.idx", b"short")
    with pytest.raises(ChecksumError, match="the object has 5 bytes but the manifest says"):
        download(s3_bucket.url("r/manifest.json"), str(tmp_path / "local2"), policy=FAST)


def test_cli_publish_download_s3(
    tmp_path: Path, s3_bucket: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    prefixes = make_dataset(tmp_path / "data", count=2)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"random_seed": 3}))
    url = s3_bucket.url("cli")
    assert main(["publish", *prefixes, url, "--config", str(config), "--quiet"]) == 0
    assert "published 4 objects" in capsys.readouterr().out
    manifest, _ = load_manifest(url + "/manifest.json")
    assert manifest.config == {"file": str(config), "fields": {"random_seed": 3}}
    assert main(["download", url + "/manifest.json", str(tmp_path / "d")]) == 0
    assert "downloaded 4 objects" in capsys.readouterr().out
    assert (tmp_path / "d" / STATE_NAME).exists()


# -- path_to_cache at a published cache -------------------------------------------------------


def _trainer_config(path_to_cache: str) -> Any:
    from tokenmill.datasets.gpt import GPTDatasetConfig

    from conftest import TinyTokenizer

    return GPTDatasetConfig(
        random_seed=5,
        sequence_length=31,
        blend=(["data/shard0", "data/shard1"], [0.6, 0.4]),
        split="90,8,2",
        path_to_cache=path_to_cache,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.5,
        tokenizer=TinyTokenizer(),
    )


@pytest.mark.parametrize("where", ["s3 manifest", "s3 prefix", "http manifest"])
def test_trainer_starts_from_a_published_cache(
    tmp_path: Path,
    s3_bucket: Any,
    http_root: _Server,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.index.cache import CacheSession, cache_session
    from tokenmill.runs.cache_build import build_cache
    from tokenmill.runs.config_file import load_run_config

    sizes = [100, 10, 5]
    builder_node, trainer_node = tmp_path / "builder", tmp_path / "trainer"
    make_dataset(builder_node / "data", count=2)
    shutil.rmtree(builder_node / "data" / "cache")  # (make_dataset's stand-in cache)
    monkeypatch.chdir(builder_node)
    (builder_node / "run.json").write_text(
        json.dumps(
            {
                "random_seed": 5,
                "sequence_length": 31,
                "blend": [["data/shard0", "data/shard1"], [0.6, 0.4]],
                "split": "90,8,2",
                "path_to_cache": "cache",
                "reset_position_ids": False,
                "reset_attention_mask": False,
                "eod_mask_loss": False,
                "create_attention_mask": False,
                "mid_level_dataset_surplus": 0.5,
                "tokenizer": {
                    "vocab_size": 1000,
                    "eod": 0,
                    "unique_identifiers": {"class": "TinyTokenizer", "vocab_size": 1000},
                },
            }
        )
    )
    assert build_cache(load_run_config("run.json"), sizes, progress=False).built == 9
    reference = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, lambda: True, _trainer_config("cache")
    ).build()
    paths = ["data/shard0", "data/shard1", "cache"]
    if where == "http manifest":
        publish(paths, str(http_root.root), policy=FAST)
        location = f"{http_root.url}/manifest.json"
    else:
        publish(paths, s3_bucket.url("run"), policy=FAST)
        location = s3_bucket.url("run/manifest.json" if where == "s3 manifest" else "run/cache")

    trainer_node.mkdir()
    monkeypatch.chdir(trainer_node)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(trainer_node / "node-local"))
    manifest_url = location if location.endswith(".json") else s3_bucket.url("run/manifest.json")
    download(
        manifest_url, "data", keys=[f"shard{i}{s}" for i in range(2) for s in (".bin", ".idx")]
    )
    for attempt in range(2):  # the second construction finds the entries already on the node
        session = CacheSession()
        with cache_session(session):
            datasets = BlendedMegatronDatasetBuilder(
                GPTDataset, sizes, lambda: True, _trainer_config(location)
            ).build()
        assert len(session.events) == 9, attempt
        assert [e.cache.base for e in session.events if e.built] == [], attempt
        for ours, theirs in zip(datasets, reference):
            assert len(ours) == len(theirs)
            np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
            for i in (0, len(theirs) - 1):
                assert ours[i]["tokens"].tolist() == theirs[i]["tokens"].tolist()
    local = Path(session.events[0].cache.directory)
    assert local.parent == trainer_node / "node-local" / "remote-index-caches"
    assert len([p for p in local.iterdir() if p.name.endswith("-description.txt")]) == 9


def test_s3_download_killed_midway_resumes(tmp_path: Path, s3_bucket: Any) -> None:
    from s3_support import FaultProxy

    prefixes = make_dataset(tmp_path / "data", count=2)
    big = tmp_path / "data" / "zbig.bin"  # last in key order
    big.write_bytes(os.urandom(6 << 20))
    publish([*prefixes, str(big)], s3_bucket.url("k"), policy=TransferPolicy(part_bytes=5 << 20))
    upstream = int(s3_bucket.service.endpoint.rsplit(":", 1)[1])
    proxy = FaultProxy(upstream)

    def after_first_part(command: str, path: str, headers: Any) -> bool:
        # every GET of zbig.bin past its first MiB hangs: the kill lands inside that object
        byte_range = headers.get("Range") or ""
        if "zbig.bin" not in path or not byte_range.startswith("bytes="):
            return False
        return int(byte_range.removeprefix("bytes=").split("-")[0]) >= 1 << 20

    proxy.hang_when(after_first_part)
    local = tmp_path / "local"
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.cli.main",
                "download",
                s3_bucket.url("k/manifest.json"),
                str(local),
                "--workers",
                "1",
                "--part-size-mib",
                "1",
            ],
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint},
        )
        partial = local / ".zbig.bin.partial"
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size >= 1 << 20):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        proxy.close()
    finished = sorted(p.name for p in local.iterdir() if not p.name.startswith("."))
    assert finished == ["shard0.bin", "shard0.idx", "shard1.bin", "shard1.idx"]
    have = partial.stat().st_size
    assert 0 < have < big.stat().st_size
    result = download(s3_bucket.url("k/manifest.json"), str(local), policy=FAST)
    assert result.skipped == finished and result.fetched == ["zbig.bin"]
    assert result.bytes_fetched == big.stat().st_size - have  # continued from the byte it had
    assert (local / "zbig.bin").read_bytes() == big.read_bytes()


def test_remote_cache_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.storage.remote_cache import (
        fetch_cache_entry,
        is_remote_cache,
        local_cache_directory,
    )

    assert is_remote_cache("s3://bucket/cache") and is_remote_cache("https://h/run/manifest.json")
    assert is_remote_cache(str(tmp_path / "manifest.json"))
    (tmp_path / "odd.json").mkdir()
    assert not is_remote_cache(str(tmp_path / "odd.json")) and not is_remote_cache(str(tmp_path))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "node"))
    assert local_cache_directory("s3://a/b") != local_cache_directory("s3://a/c")
    assert local_cache_directory("s3://a/b").startswith(str(tmp_path / "node"))
    with pytest.raises(ValueError, match=r"an http\(s\) cache location must be a manifest"):
        fetch_cache_entry("https://h/cache", "abc-GPTDataset-train")


# -- an s3:// cache prefix is listed once per node -----------------------------------------------

_OPEN_ENTRIES = """
import json, sys
from tokenmill.storage.remote_cache import fetch_cache_entry
for base in json.loads(sys.argv[2]):
    local = fetch_cache_entry(sys.argv[1], base, ["a", "b"])
print(local)
"""


def _publish_entries(s3_bucket: Any, key_prefix: str, bases: list[str]) -> dict[str, bytes]:
    """Cache-entry files (random bytes: fetching does not parse them) under `key_prefix`."""
    rng = np.random.default_rng(len(bases))
    published = {}
    for base in bases:
        for suffix in ("a.npy", "b.npy", "data.tokenmill.json", "description.txt"):
            name = f"{base}-{suffix}"
            published[name] = rng.integers(0, 256, int(rng.integers(1, 5000)), np.uint8).tobytes()
            s3_bucket.put(f"{key_prefix}/{name}", published[name])
    return published


def _bases(count: int, first: int = 0) -> list[str]:
    return [f"{i:032x}-GPTDataset-train" for i in range(first, first + count)]


@pytest.fixture
def s3_proxy(s3_bucket: Any) -> Iterator[Any]:
    """A FaultProxy in front of the session's moto server: it counts every request."""
    from s3_support import FaultProxy

    proxy = FaultProxy(int(s3_bucket.service.endpoint.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


def test_s3_cache_prefix_is_listed_once_per_node(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any
) -> None:
    """Three processes of one node open six entries each: one LIST in all, each file fetched
    once, byte-identical; then complete entries need no request at all."""
    bases = _bases(6)
    published = _publish_entries(s3_bucket, "run/cache", bases)
    s3_bucket.put(f"run/cache/deeper/{bases[0]}-c.npy", b"not directly under the prefix")
    s3_bucket.put(f"run/cache-other/{bases[0]}-c.npy", b"another prefix")
    location = s3_bucket.url("run/cache")
    node = tmp_path / "node"
    environment = {
        **os.environ,
        "AWS_ENDPOINT_URL": s3_proxy.endpoint,
        "TOKENMILL_CACHE_DIR": str(node),
        "TOKENMILL_CACHE_LISTING_ID": "job-1",
    }
    absent = _bases(1, first=99)  # not in the bucket: left to the local builder

    def run_processes(count: int, wanted: list[str]) -> list[str]:
        processes = [
            subprocess.Popen(
                # each process opens the entries in another order
                [
                    sys.executable,
                    "-c",
                    _OPEN_ENTRIES,
                    location,
                    json.dumps(wanted[i:] + wanted[:i]),
                ],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(count)
        ]
        outputs = [process.communicate(timeout=300) for process in processes]
        for process, (_, error) in zip(processes, outputs):
            assert process.returncode == 0, error
        return [out.strip() for out, _ in outputs]

    locals_ = run_processes(3, bases + absent)
    assert len(set(locals_)) == 1
    local = Path(locals_[0])
    (listing,) = s3_proxy.listings()  # one LIST for 3 processes x 7 entries
    assert "prefix=run%2Fcache%2F" in listing and "delimiter=%2F" in listing
    with s3_proxy.lock:
        heads = [path for method, path in s3_proxy.log if method == "HEAD"]
    assert sorted(heads) == sorted(f"/{s3_bucket.name}/run/cache/{name}" for name in published)
    committed = {p.name: p.read_bytes() for p in local.iterdir() if not p.name.startswith(".")}
    assert committed == published  # byte-identical; nothing from below or beside the prefix
    assert not [p.name for p in local.iterdir() if ".fetch.tm-" in p.name]
    listing_files = list(local.glob(".listing-*.json"))
    assert len(listing_files) == 1

    # complete entries: no request at all, not even a LIST (the listing file is gone)
    listing_files[0].unlink()
    before = s3_proxy.requests
    run_processes(2, bases)
    assert s3_proxy.requests == before

    # a new job lists again, once, and fetches only the entry missing on the node
    (local / f"{bases[2]}-description.txt").unlink()
    environment["TOKENMILL_CACHE_LISTING_ID"] = "job-2"
    run_processes(2, bases)
    assert len(s3_proxy.listings()) == 2
    assert s3_proxy.requests == before + 1 + 2 * 4  # one LIST, a HEAD and a GET per file
    committed = {p.name: p.read_bytes() for p in local.iterdir() if not p.name.startswith(".")}
    assert committed == published


def test_s3_cache_listing_freshness_and_no_lock(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno as errno_module

    from tokenmill.storage import remote_cache
    from tokenmill.storage.s3 import S3Client, using_client

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("TOKENMILL_CACHE_LISTING_ID", "job-1")
    monkeypatch.setattr(remote_cache, "_listings", {})
    bases = _bases(4)
    published = _publish_entries(s3_bucket, "c", bases[:2])
    location = s3_bucket.url("c")
    local = Path(remote_cache.local_cache_directory(location))

    def fetch(base: str) -> None:
        assert remote_cache.fetch_cache_entry(location, base, ["a", "b"]) == str(local)

    def committed() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in local.iterdir() if not p.name.startswith(".")}

    def no_lock(descriptor: int, operation: int) -> None:
        raise OSError(errno_module.ENOLCK, "No locks available")

    errors: list[BaseException] = []

    def fetch_both(first: int) -> None:
        try:
            for j in range(2):
                fetch(bases[(first + j) % 2])
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    with using_client(S3Client(endpoint_url=s3_proxy.endpoint)):
        # no working lock: four threads race for the same two entries; duplicate work at most,
        # and every file committed whole
        working_flock = locks_module.fcntl.flock
        monkeypatch.setattr(locks_module.fcntl, "flock", no_lock)
        threads = [threading.Thread(target=fetch_both, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        monkeypatch.setattr(locks_module.fcntl, "flock", working_flock)
        assert errors == []
        assert committed() == published
        assert 1 <= len(s3_proxy.listings()) <= 4
        assert not [p for p in local.iterdir() if ".fetch.tm-" in p.name]
        listed = len(s3_proxy.listings())

        # an entry published after the listing is not seen (built locally) until a refresh
        published |= _publish_entries(s3_bucket, "c", bases[2:3])
        fetch(bases[2])
        assert len(s3_proxy.listings()) == listed and f"{bases[2]}-a.npy" not in committed()
        remote_cache.refresh_cache_listing(location)
        assert not list(local.glob(".listing-*.json"))
        fetch(bases[2])
        assert len(s3_proxy.listings()) == listed + 1 and committed() == published

        # an object listed but deleted since: one more LIST, then the entry is absent
        published |= _publish_entries(s3_bucket, "c", bases[3:4])
        remote_cache.refresh_cache_listing(location)
        fetch(bases[0])  # complete: lists nothing
        assert len(s3_proxy.listings()) == listed + 1
        (local / f"{bases[0]}-a.npy").unlink()
        fetch(bases[0])  # lists the bucket, with bases[3]
        assert len(s3_proxy.listings()) == listed + 2
        for suffix in ("a.npy", "b.npy", "data.tokenmill.json", "description.txt"):
            s3_bucket.service.boto.delete_object(
                Bucket=s3_bucket.name, Key=f"c/{bases[3]}-{suffix}"
            )
        fetch(bases[3])
        assert len(s3_proxy.listings()) == listed + 3
        assert not [name for name in committed() if name.startswith(bases[3])]

        # a refresh by another process of the node (the node's file gone) is seen: one stat
        (local / f"{bases[1]}-description.txt").unlink()
        fetch(bases[1])
        assert len(s3_proxy.listings()) == listed + 3  # this process's copy is still good
        for listing_file in local.glob(".listing-*.json"):
            listing_file.unlink()
        (local / f"{bases[1]}-description.txt").unlink()
        fetch(bases[1])
        assert len(s3_proxy.listings()) == listed + 4

        # a listing older than TOKENMILL_CACHE_LISTING_MAX_AGE is made again
        monkeypatch.setenv("TOKENMILL_CACHE_LISTING_MAX_AGE", "0")
        (local / f"{bases[1]}-description.txt").unlink()
        fetch(bases[1])
        assert len(s3_proxy.listings()) == listed + 5
        monkeypatch.setenv("TOKENMILL_CACHE_LISTING_MAX_AGE", "soon")
        (local / f"{bases[1]}-description.txt").unlink()
        with pytest.raises(ValueError, match="TOKENMILL_CACHE_LISTING_MAX_AGE must be a number"):
            fetch(bases[1])


def test_manifest_cache_entry_without_a_working_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOLCK: the entry is downloaded into a directory of the process's own and renamed into
    place, whole and verified, with nothing left behind."""
    import errno as errno_module

    from tokenmill.storage import remote_cache

    def no_lock(descriptor: int, operation: int) -> None:
        raise OSError(errno_module.ENOLCK, "No locks available")

    cache = tmp_path / "cache"
    cache.mkdir()
    rng = np.random.default_rng(3)
    base = _bases(1)[0]
    for suffix in ("a.npy", "b.npy", "description.txt"):
        (cache / f"{base}-{suffix}").write_bytes(rng.integers(0, 256, 3000, np.uint8).tobytes())
    publish([str(cache)], str(tmp_path / "bucket"), policy=FAST)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "node"))
    monkeypatch.setattr(locks_module.fcntl, "flock", no_lock)
    location = str(tmp_path / "bucket" / "manifest.json")
    local = Path(remote_cache.fetch_cache_entry(location, base, ["a", "b"]))
    assert {p.name: p.read_bytes() for p in local.iterdir() if not p.name.startswith(".")} == {
        p.name: p.read_bytes() for p in cache.iterdir()
    }
    assert not [p for p in local.iterdir() if ".fetch.tm-" in p.name or p.suffix == ".partial"]
