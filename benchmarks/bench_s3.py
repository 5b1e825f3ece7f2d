"""Object storage: requests, bytes and throughput per 1000 samples read from s3:// (moto on
loopback), with tokenmill's chunk cache on and off, against a local mmap and megatron-core's
S3 reader, in one process run.

Usage: python benchmarks/bench_s3.py [--samples 1000] [--tokens 3000000] [--markdown]

A ~6 MiB uint16 shard (documents of lognormal length, mean ~1000 tokens) is written, uploaded to
a moto server (``moto_server`` in a subprocess on loopback), and read as a GPTDataset (2048-token samples, seed 1234).
Each configuration reads the same run of consecutive sample indices (a training loop's order; the
shuffle makes them random in the file), starting from a cold cache. moto reads the whole object
for every ranged GET and runs on loopback, so its times are NOT S3's: read the request and byte
counts as exact, the throughput only relative to the local mmap of the same run. Results and the
machine are recorded in benchmarks/README.md.

Configurations:
* local mmap: GPTDataset on a local prefix (the C++ gather path).
* s3, cache off: every document read is one ranged GET of exactly its bytes.
* s3, chunk cache (small / large): LRU of aligned chunks holding 1/6 of the object (a dataset
  much larger than the cache) or all of it, without and with prefetch along the sample order.
* megatron-core's _S3BinReader (one chunk per reader, replaced on every miss), reading the same
  documents through its IndexedDataset.get (what its GPTDataset.__getitem__ calls).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

SEQUENCE_LENGTH = 2048


class _Tokenizer:
    vocab_size = 32000
    eod = 0
    unique_identifiers = {"class": "BenchTokenizer"}  # noqa: RUF012


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _start_moto(port: int) -> subprocess.Popen[bytes]:
    """``moto_server`` (moto[server]'s console script) on 127.0.0.1:port, once it answers."""
    executable = os.path.join(os.path.dirname(sys.executable), "moto_server")
    command = [executable] if os.path.exists(executable) else [sys.executable, "-m", "moto.server"]
    server = subprocess.Popen(
        [*command, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1):
                return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"moto_server did not start on port {port}")


def _write_shard(prefix: str, tokens: int, seed: int) -> None:
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        length = int(min(max(rng.lognormal(6.5, 0.8), 8), tokens - written))
        document = rng.integers(1, 32000, length, dtype=np.uint16)
        document[-1] = 0
        builder.add_document(document, [length])
        written += length
    builder.finalize(prefix + ".idx")


def _config(prefix: str, cache: str, storage: Any = None) -> Any:
    from tokenmill.datasets.gpt import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQUENCE_LENGTH,
        tokenizer=_Tokenizer(),
        blend=([prefix], None),
        split="1",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
        object_storage_cache_path=storage,
    )


def _dataset(prefix: str, cache: str, storage: Any = None) -> Any:
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.datasets.utils import Split

    config = _config(prefix, cache, storage)
    low_level = GPTDataset.build_low_level_dataset(prefix, config)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, prefix, indices, None, Split.train, config)


def _reads(dataset: Any, indices: list[int]) -> list[tuple[int, int, int]]:
    """(document, offset, length) reads of each sample, as GPTDataset.__getitem__ makes them."""
    reads = []
    for idx in indices:
        position = int(dataset.shuffle_index[idx])
        begin, begin_offset = (int(v) for v in dataset.sample_index[position])
        end, end_offset = (int(v) for v in dataset.sample_index[position + 1])
        for i in range(begin, end + 1):
            document = int(dataset.document_index[i])
            length = int(dataset.dataset.sequence_lengths[document])
            first = begin_offset if i == begin else 0
            stop = min(end_offset + 1, length) if i == end else length
            reads.append((document, first, stop - first))
    return reads


def _measure_tokenmill(
    name: str, prefix: str, scratch: str, indices: list[int], storage: Any, expected: list[Any]
) -> dict[str, Any]:
    dataset = _dataset(prefix, os.path.join(scratch, "idx-" + name.replace(" ", "_")), storage)
    reader = getattr(dataset.dataset, "bin_reader", None)
    started = time.perf_counter()
    for idx, reference in zip(indices, expected):
        sample = dataset[idx]
        if not np.array_equal(sample["tokens"].numpy(), reference):
            raise AssertionError(f"{name}: sample {idx} differs from the local read")
    seconds = time.perf_counter() - started
    if reader is not None:
        reader.cache.wait_idle()
        stats = reader.stats
        requests, fetched = stats.requests, stats.bytes_fetched
        reader.close()
    else:
        requests, fetched = 0, 0
    return {"name": name, "seconds": seconds, "requests": requests, "bytes": fetched}


def _measure_megatron(
    remote: str, scratch: str, reads: list[tuple[int, int, int]], chunk: int
) -> dict[str, Any] | None:
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.object_storage_utils import ObjectStorageConfig
    except ImportError:
        return None
    config = ObjectStorageConfig(
        path_to_idx_cache=os.path.join(scratch, "megatron"), bin_chunk_nbytes=chunk
    )
    dataset = IndexedDataset(remote, mmap=False, object_storage_config=config)
    client = dataset.bin_reader._client
    counts = {"requests": 0, "bytes": 0}
    get_object = client.get_object

    def counting_get_object(**kwargs: Any) -> Any:
        response = get_object(**kwargs)
        counts["requests"] += 1
        counts["bytes"] += int(response["ContentLength"])
        return response

    client.get_object = counting_get_object
    started = time.perf_counter()
    for document, offset, length in reads:
        dataset.get(document, offset, length)
    seconds = time.perf_counter() - started
    label = f"megatron-core _S3BinReader, {chunk >> 10} KiB chunk"
    return {"name": label, "seconds": seconds, **counts}


def run(args: argparse.Namespace, evidence: Any = None) -> int:
    pytest_env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    os.environ.update(pytest_env)
    import logging

    import boto3

    from tokenmill.storage.object_storage import ObjectStorageConfig
    from tokenmill.storage.s3 import reset_clients

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _free_port()
    # moto in its own process, so its request handling does not share this process's GIL
    server = _start_moto(port)
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    reset_clients()
    try:
        with tempfile.TemporaryDirectory(prefix="tokenmill-bench-s3-") as scratch:
            prefix = os.path.join(scratch, "shard")
            _write_shard(prefix, args.tokens, seed=1234)
            size = os.path.getsize(prefix + ".bin")
            boto = boto3.client("s3")
            boto.create_bucket(Bucket="bench")
            for suffix in (".bin", ".idx"):
                boto.upload_file(prefix + suffix, "bench", "data/shard" + suffix)
            remote = "s3://bench/data/shard"

            local = _dataset(prefix, os.path.join(scratch, "idx-local"))
            count = len(local)
            start = int(np.random.default_rng(7).integers(0, max(1, count - args.samples)))
            indices = [(start + i) % count for i in range(args.samples)]
            expected = [local[idx]["tokens"].numpy().copy() for idx in indices]
            reads = _reads(local, indices)

            chunk = 64 << 10
            small = (size // 6) // chunk * chunk
            objects = os.path.join(scratch, "objects")
            configurations: list[tuple[str, Any]] = [
                ("local mmap", None),
                ("s3, cache off", ObjectStorageConfig(objects, bin_cache_nbytes=0)),
                (
                    f"s3, {chunk >> 10} KiB chunks, cache 1/6 object, no prefetch",
                    ObjectStorageConfig(
                        objects, bin_chunk_nbytes=chunk, bin_cache_nbytes=small, prefetch_threads=0
                    ),
                ),
                (
                    f"s3, {chunk >> 10} KiB chunks, cache 1/6 object, prefetch 8 samples",
                    ObjectStorageConfig(
                        objects, bin_chunk_nbytes=chunk, bin_cache_nbytes=small, prefetch_samples=8
                    ),
                ),
                (
                    f"s3, {chunk >> 10} KiB chunks, cache >= object, prefetch",
                    ObjectStorageConfig(objects, bin_chunk_nbytes=chunk, bin_cache_nbytes=2 * size),
                ),
                (
                    "s3, tokenmill defaults (4 MiB chunks, 256 MiB cache)",
                    ObjectStorageConfig(objects),
                ),
            ]
            rows = []
            for name, storage in configurations:
                source = prefix if storage is None else remote
                rows.append(_measure_tokenmill(name, source, scratch, indices, storage, expected))
            for megatron_chunk in (chunk, 1 << 20):
                row = _measure_megatron(remote, scratch, reads, megatron_chunk)
                if row is not None:
                    rows.append(row)
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    baseline = rows[0]["seconds"]
    per = 1000 / args.samples
    header = (
        f"{args.samples} consecutive samples of {SEQUENCE_LENGTH} tokens ({len(reads)} document "
        f"reads), object {size / 2**20:.1f} MiB"
    )
    print(header)
    print(
        "| configuration | requests / 1000 samples | MiB fetched / 1000 samples | samples/s | "
        "throughput vs local mmap |"
    )
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        rate = args.samples / row["seconds"]
        print(
            f"| {row['name']} | {row['requests'] * per:.0f} | "
            f"{row['bytes'] * per / 2**20:.1f} | {rate:,.0f} | {baseline / row['seconds']:.4f}x |"
        )
    if evidence is not None:
        evidence.runs.extend(rows)
        evidence.summary.update(samples=args.samples, document_reads=len(reads), object_bytes=size)
    return 0


def main(argv: list[str] | None = None, evidence: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000, help="samples per configuration")
    parser.add_argument("--tokens", type=int, default=3_000_000, help="tokens in the shard")
    return run(parser.parse_args(argv), evidence)


if __name__ == "__main__":
    from evidence import recorded

    with recorded("s3") as evidence:
        status = main(evidence=evidence)
    sys.exit(status)
