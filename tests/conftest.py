"""Shared fixtures: tiny tokenizers, independently written Megatron shards, hypothesis profile."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import oracles
from oracles import import_oracle

os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "tokenmill",
        deadline=None,
        max_examples=60,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile("tokenmill")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


class TinyTokenizer:
    """The attributes megatron-core's datasets read from a tokenizer, and nothing else."""

    def __init__(self, vocab_size: int = 1000, eod: int = 0, pad: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        if pad is not None:
            self.pad = pad
        self.unique_identifiers = {"class": "TinyTokenizer", "vocab_size": vocab_size}


_DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}


def write_megatron_shard(
    prefix: str | Path,
    documents: Sequence[Sequence[int]],
    dtype: np.dtype | type = np.uint16,
) -> str:
    """Write `documents` (one sequence each) as .bin/.idx straight from the format spec.

    Independent of tokenmill's writer on purpose: tests read what this writes.
    """
    dtype = np.dtype(dtype)
    prefix = str(prefix)
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    tokens = (
        np.concatenate([np.asarray(d, dtype=dtype) for d in documents])
        if len(documents)
        else np.zeros(0, dtype)
    )
    Path(prefix + ".bin").write_bytes(tokens.astype(dtype).tobytes())
    pointers = np.zeros(len(documents), dtype=np.int64)
    if len(documents) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * dtype.itemsize
    document_indices = np.arange(len(documents) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as stream:
        stream.write(b"MMIDIDX\x00\x00")
        stream.write(struct.pack("<Q", 1))
        stream.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        stream.write(struct.pack("<Q", len(documents)))
        stream.write(struct.pack("<Q", len(document_indices)))
        stream.write(lengths.tobytes())
        stream.write(pointers.tobytes())
        stream.write(document_indices.tobytes())
    return prefix


def random_documents(
    rng: np.random.Generator,
    count: int,
    max_length: int = 300,
    vocab_size: int = 1000,
    eod: int = 0,
) -> list[list[int]]:
    """Documents of random lengths in [1, max_length], each ending with the EOD token."""
    documents = []
    for _ in range(count):
        length = int(rng.integers(1, max_length + 1))
        document = rng.integers(1, vocab_size, length)
        document[-1] = eod
        documents.append(document.tolist())
    return documents


def _differential_coverage_summary(terminalreporter: Any) -> None:
    """The differential suites' pair coverage (tests/covering.py): pairs of settings the
    compared cases reached, with refusals and zero-length datasets counted apart. With
    TOKENMILL_DIFFERENTIAL_REPORT=PATH the same lines are also written to PATH."""
    from covering import report_lines

    lines = report_lines()
    if not lines:
        return
    terminalreporter.section("differential coverage (pairs of settings)")
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("TOKENMILL_DIFFERENTIAL_REPORT")
    if target:
        Path(target).write_text("\n".join(lines) + "\n", encoding="utf-8")


# -- test oracles (tests/oracles.py): missing or broken ones fail, never skip ---------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tag every megatron-marked test (junit XML: property oracle=megatron-core): .ci/run counts
    the ones that ran."""
    for item in items:
        if item.get_closest_marker("megatron") is not None:
            item.user_properties.append(("oracle", "megatron-core"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A megatron-marked test fails when megatron-core is missing or broken, whatever it imports."""
    if item.get_closest_marker("megatron") is not None:
        oracles.require("megatron-core")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _differential_coverage_summary(terminalreporter)
    if oracles.MISSING:
        terminalreporter.section("missing or broken test oracles", red=True, bold=True)
        for name, reason in sorted(oracles.MISSING.items()):
            terminalreporter.line(oracles.message(name, reason))


@pytest.fixture(autouse=True)
def _collect_the_oracles_leaked_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """megatron-core (the oracle) can leave a .bin file object to the garbage collector when it
    refuses a config midway; collected during a later test, its ResourceWarning became that
    test's unraisable-exception error. Collect it in the megatron test that made it, with the
    oracle's own leak ignored (tokenmill's files are not involved: its readers keep no file
    object)."""
    yield
    if request.node.get_closest_marker("megatron") is not None:
        import gc
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture
def tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture
def greedy_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread that ran each greedy blending computation, in order (the
    builder computes a cold blend's indices ahead, on a thread of its own)."""
    import threading

    from tokenmill.index import blending

    threads: list[str] = []
    real = blending._greedy

    def recording(vector: np.ndarray, count: int) -> Any:
        threads.append(threading.current_thread().name)
        return real(vector, count)

    monkeypatch.setattr(blending, "_greedy", recording)
    return threads


@pytest.fixture
def shard(tmp_path: Path) -> str:
    """A 200-document uint16 shard with random lengths, ending every document with EOD 0."""
    rng = np.random.default_rng(1234)
    return write_megatron_shard(tmp_path / "corpus", random_documents(rng, 200))


# -- S3: a real S3-compatible server (moto's server mode) on loopback, for the whole session -------


class S3Service:
    """The session's S3 server: its endpoint and a plain boto3 client (for setting up data)."""

    def __init__(self, server: Any, endpoint: str) -> None:
        import boto3

        self.server = server
        self.endpoint = endpoint
        self.boto = boto3.client("s3", endpoint_url=endpoint)
        self._buckets = 0

    def new_bucket(self) -> S3Bucket:
        """A fresh, empty bucket (names are 3+ characters, as S3 requires)."""
        self._buckets += 1
        name = f"tokenmill-test-{self._buckets}"
        self.boto.create_bucket(Bucket=name)
        return S3Bucket(self, name)


class S3Bucket:
    """One test's bucket on the session's server."""

    def __init__(self, service: S3Service, name: str) -> None:
        self.service = service
        self.name = name

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> str:
        self.service.boto.put_object(Bucket=self.name, Key=key, Body=data)
        return self.url(key)

    def get(self, key: str) -> bytes:
        data: bytes = self.service.boto.get_object(Bucket=self.name, Key=key)["Body"].read()
        return data

    def upload_prefix(self, local_prefix: str | Path, key_prefix: str) -> str:
        """Upload every file `local_prefix*` (.bin, .idx, sidecars); returns the s3:// prefix."""
        directory, name = os.path.split(str(local_prefix))
        for entry in sorted(os.listdir(directory)):
            path = os.path.join(directory, entry)
            if entry.startswith(name) and os.path.isfile(path):
                self.service.boto.upload_file(path, self.name, key_prefix + entry[len(name) :])
        return self.url(key_prefix)


@pytest.fixture(scope="session")
def s3_service() -> Iterator[S3Service]:
    """moto's ThreadedMotoServer on 127.0.0.1:<free port> with test credentials, small retry
    budgets and AWS_ENDPOINT_URL in the environment (what tokenmill's client reads)."""
    import_oracle("moto.server")
    import logging

    from s3_support import TEST_ENVIRONMENT, MotoServer
    from tokenmill.storage import s3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request
    server = MotoServer()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in TEST_ENVIRONMENT.items():
            patch.setenv(key, value)
        patch.delenv("AWS_PROFILE", raising=False)
        patch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        patch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        server.start()
        s3.reset_clients()
        try:
            yield S3Service(server, server.endpoint)
        finally:
            s3.reset_clients()
            server.stop()


@pytest.fixture
def s3_bucket(s3_service: S3Service) -> S3Bucket:
    """A fresh bucket on the session's S3 server."""
    return s3_service.new_bucket()
