"""tokenmill on Ray (tokenmill.ray, ``tokenize --engine ray``) against single-machine tokenize.

Every test runs on a real Ray cluster started and stopped here: ``ray.init(num_cpus=2)`` in this
process, and a two-node cluster on this machine (``ray start --head`` and a worker node joined
with ``ray start --address``, each with its own temporary directory; the CLI connects with
``--ray-address``). The outputs must equal single-machine ``tokenmill tokenize`` byte for byte
for JSON Lines, zstd and parquet inputs, whatever the range size, also when an actor is killed
with SIGKILL in the middle of a part. Ray is in the [test] extra: a missing Ray fails here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import ray.data

from tokenmill.errors import DataFormatError
from tokenmill.ray import plan_ranges, tokenize_dataset, tokenize_on_ray
from tokenmill.ray.engine import _byte_range_chunks
from tokenmill.tokenize import ReadOptions, TokenizeConfig, TokenizerSpec, tokenize

from conftest import S3Service

SUFFIXES = (".bin", ".idx", ".tokenmill.json")
# Ray's token authentication writes ~/.ray/auth_token and every client must present it; these
# throwaway clusters listen on 127.0.0.1 only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _documents(count: int, seed: int) -> list[str]:
    generator = random.Random(seed)
    words = ["alpha", "beta", "gamma", "délta", "ünïcode", "🙂", "x", "  ", "\n", '{"q": 1}', "\\n"]
    return [
        " ".join(generator.choice(words) for _ in range(generator.randint(0, 60)))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A directory holding a .jsonl (with blank lines), a .jsonl.zst and a parquet file of
    several row groups, and a GPT-2-style byte-level BPE tokenizer.json trained on them."""
    import pyarrow
    import pyarrow.parquet
    import zstandard
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("ray-corpus")
    inputs = root / "in"
    inputs.mkdir()
    documents = _documents(260, seed=35)
    lines = [json.dumps({"text": text, "id": index}) for index, text in enumerate(documents[:110])]
    lines.insert(7, "")
    lines.insert(40, "   ")
    (inputs / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    zst = "".join(json.dumps({"text": text}) + "\n" for text in documents[110:180])
    (inputs / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(zst.encode()))
    table = pyarrow.table({"text": documents[180:]})
    pyarrow.parquet.write_table(table, inputs / "c.parquet", row_group_size=13)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return {"inputs": inputs, "tokenizer": root / "tokenizer.json", "root": root}


def _config(corpus: dict[str, Path], output: Path, **options: object) -> TokenizeConfig:
    return TokenizeConfig(
        inputs=(str(corpus["inputs"]),),
        output_prefix=str(output),
        tokenizer=TokenizerSpec.parse(str(corpus["tokenizer"])),
        progress=False,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def single(corpus: dict[str, Path]) -> Path:
    """Single-machine tokenize of the corpus: the reference output."""
    prefix = corpus["root"] / "single" / "out"
    result = tokenize(_config(corpus, prefix, workers=1))
    assert result.backend.startswith("gigatoken")
    return prefix


def _assert_same(expected: Path, actual: Path, suffixes: tuple[str, ...] = SUFFIXES) -> None:
    for suffix in suffixes:
        left = Path(str(expected) + suffix).read_bytes()
        right = Path(str(actual) + suffix).read_bytes()
        assert left == right, f"{actual}{suffix} differs from {expected}{suffix}"


@pytest.fixture(scope="module")
def local_ray(s3_service: S3Service) -> Iterator[None]:
    """A Ray instance of 2 CPUs started by this process (stopped after the module), after the
    S3 test server's endpoint and credentials are in the environment its workers inherit."""
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


# -- ranges, without Ray ---------------------------------------------------------------------


@pytest.mark.parametrize("range_bytes", [1, 7, 64, 1000, 1 << 20])
def test_byte_ranges_hold_every_line_once(tmp_path: Path, range_bytes: int) -> None:
    """A byte range owns the lines that start in it: the ranges' chunks, concatenated, are the
    file, for range sizes from 1 byte (most ranges empty) to more than the file."""
    path = tmp_path / "lines.jsonl"
    lines = [json.dumps({"text": "y" * size}) for size in (0, 3, 200, 1, 50, 0, 999, 2)]
    data = ("\n".join(lines) + "\n\n" + json.dumps({"text": "last, no newline"})).encode()
    path.write_bytes(data)
    ranges = plan_ranges([str(path)], ReadOptions(), range_bytes)
    assert ranges[0].start == 0 and ranges[-1].stop == len(data)
    pieces = [
        chunk.data
        for item in ranges
        for chunk, _ in _byte_range_chunks(str(path), "jsonl", item.start, item.stop, 16)
    ]
    assert b"".join(pieces) == data
    assert [item.name for item in ranges] == sorted(item.name for item in ranges)


def test_parquet_ranges_group_row_groups(corpus: dict[str, Path]) -> None:
    path = str(corpus["inputs"] / "c.parquet")
    ranges = plan_ranges([path], ReadOptions(), range_bytes=1)
    assert [(item.start, item.stop) for item in ranges] == [(g, g + 1) for g in range(7)]
    (whole,) = plan_ranges([path], ReadOptions(), range_bytes=1 << 30)
    assert (whole.unit, whole.start, whole.stop) == ("row_groups", 0, 7)


# -- on the local instance -------------------------------------------------------------------


@pytest.mark.parametrize("range_bytes", [700, 1 << 30])
def test_ray_output_equals_single_machine(
    corpus: dict[str, Path], single: Path, local_ray: None, tmp_path: Path, range_bytes: int
) -> None:
    """jsonl (cut into byte ranges), zst (whole) and parquet (row groups) in one run: the
    .bin, .idx and sidecar equal single-machine tokenize's; the kept parts merge again."""
    prefix = tmp_path / "ray"
    result = tokenize_on_ray(
        _config(corpus, prefix, keep_parts=True), range_bytes=range_bytes, actors=2
    )
    _assert_same(single, prefix)
    assert result.documents == 260 and not result.skipped
    parts = sorted(path.name for path in (tmp_path / "ray.parts").glob("*.idx"))
    files = sorted(str(path) for path in corpus["inputs"].iterdir())
    planned = plan_ranges(files, ReadOptions(), range_bytes)
    assert len(parts) == len(result.parts) == len(planned) == (47 if range_bytes == 700 else 3)
    # the parts are a dataset list `tokenmill merge` takes: the same .bin/.idx again
    merged = tmp_path / "merged"
    subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "merge", str(tmp_path / "ray.parts"), "-o", str(merged),
         "-q"],
        check=True,
    )  # fmt: skip
    _assert_same(single, merged, (".bin", ".idx"))
    # a second run finds every part done and writes none
    again = tokenize_on_ray(
        _config(corpus, prefix, keep_parts=True), range_bytes=range_bytes, actors=2
    )
    assert again.parts == [] and len(again.skipped) == len(result.parts)
    _assert_same(single, prefix)


def test_s3_inputs(
    corpus: dict[str, Path], single: Path, local_ray: None, s3_service: S3Service, tmp_path: Path
) -> None:
    """s3:// inputs (a glob): each object is downloaded by the actor that reads it; the tokens
    and index equal single-machine tokenize of the local files, the sidecar names the URLs."""
    bucket = s3_service.new_bucket()
    for path in sorted(corpus["inputs"].iterdir()):
        bucket.put(f"corpus/{path.name}", path.read_bytes())
    config = _config(corpus, tmp_path / "ray")
    config = TokenizeConfig(
        inputs=(bucket.url("corpus/*"),),
        output_prefix=config.output_prefix,
        tokenizer=config.tokenizer,
        progress=False,
    )
    tokenize_on_ray(config, actors=2)
    _assert_same(single, tmp_path / "ray", (".bin", ".idx"))
    sidecar = json.loads((tmp_path / "ray.tokenmill.json").read_text())
    assert [entry["path"] for entry in sidecar["inputs"]] == [
        bucket.url(f"corpus/{name}") for name in ("a.jsonl", "b.jsonl.zst", "c.parquet")
    ]


def test_ray_nanogpt_output(corpus: dict[str, Path], local_ray: None, tmp_path: Path) -> None:
    expected = tmp_path / "single"
    tokenize(_config(corpus, expected, workers=1, prepend_bos=True, output_format="nanogpt"))
    actual = tmp_path / "ray"
    tokenize_on_ray(
        _config(corpus, actual, prepend_bos=True, output_format="nanogpt"), range_bytes=500
    )
    _assert_same(expected, actual, (".bin", ".bos.idx", ".tokenmill.json"))
    assert not (tmp_path / "ray.parts").exists()


def test_killed_actor_is_retried(
    corpus: dict[str, Path],
    single: Path,
    local_ray: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An actor killed by SIGKILL with a part half written: Ray restarts it and retries the
    range, the leftovers are removed, and the output is still identical."""
    marker = tmp_path / "killed"
    monkeypatch.setenv("TOKENMILL_TEST_RAY_KILL_ONCE", str(marker))
    prefix = tmp_path / "ray"
    result = tokenize_on_ray(_config(corpus, prefix), range_bytes=900, actors=2)
    killed = int(marker.read_text())
    assert killed != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)  # the actor's process is gone
    _assert_same(single, prefix)
    assert result.documents == 260


def test_dataset_stage(corpus: dict[str, Path], local_ray: None, tmp_path: Path) -> None:
    """A ray.data.Dataset of records (several blocks, small batches) through the encode stage
    and the driver's commit: the .bin/.idx of single-machine tokenize of the same texts."""
    texts = _documents(150, seed=7)
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    expected = tmp_path / "single"
    tokenize(
        TokenizeConfig(
            inputs=(str(source),),
            output_prefix=str(expected),
            tokenizer=TokenizerSpec.parse(str(corpus["tokenizer"])),
            read=ReadOptions(json_key="body"),
            progress=False,
        )
    )
    dataset = ray.data.from_items([{"body": text} for text in texts], override_num_blocks=7)
    result = tokenize_dataset(
        dataset,
        str(tmp_path / "ray"),
        tokenizer=str(corpus["tokenizer"]),
        text_column="body",
        batch_size=11,
        actors=2,
        progress=False,
    )
    _assert_same(expected, tmp_path / "ray", (".bin", ".idx"))
    assert result.documents == 150
    sidecar = json.loads((tmp_path / "ray.tokenmill.json").read_text())
    reference = json.loads((tmp_path / "single.tokenmill.json").read_text())
    assert sidecar["tokenizer"] == reference["tokenizer"]
    assert sidecar["tokens"] == reference["tokens"]

    bad = ray.data.from_items([{"body": "fine"}, {"body": None}])
    with pytest.raises(Exception, match="row 1 of a batch is NoneType"):
        tokenize_dataset(bad, str(tmp_path / "bad"), text_column="body", progress=False)


def test_bad_line_names_file_and_line(local_ray: None, tmp_path: Path) -> None:
    """A malformed line deep inside a byte range is reported with the file's own line number,
    as single-machine tokenize reports it."""
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps({"text": f"document {index}"}) for index in range(60)]
    lines[47] = '{"text": 5}'
    path.write_text("\n".join(lines) + "\n")
    config = TokenizeConfig(inputs=(str(path),), output_prefix=str(tmp_path / "o"), progress=False)
    with pytest.raises(DataFormatError, match="line 48: 'text' must be a string") as local:
        tokenize(config)
    with pytest.raises(Exception, match="line 48: 'text' must be a string") as remote:
        tokenize_on_ray(config, range_bytes=300, actors=1)
    assert str(path) in str(remote.value) and str(path) in str(local.value)


# -- a two-node cluster: `ray start` head + worker, the CLI as the driver --------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ray_start(arguments: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`ray start --block ...` in its own process group (stopped by signalling the group: never
    `ray stop`, which would stop every Ray cluster on the machine)."""
    command = [str(Path(sys.executable).parent / "ray"), "start", "--block", *arguments]
    with log.open("wb") as output:  # the child keeps its own descriptor
        return subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the node's process group (`ray start`, gcs_server, raylet; a SIGTERM drains
    for 30 s): its workers, in sessions of their own, exit when their raylet is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def _wait_for_nodes(
    address: str, count: int, nodes: list[subprocess.Popen[bytes]], logs: list[Path]
) -> None:
    ray_command = str(Path(sys.executable).parent / "ray")
    deadline = time.monotonic() + 120
    while True:
        for node, log in zip(nodes, logs):
            if node.poll() is not None:
                raise AssertionError(f"`ray start` exited: {log.read_text()[-2000:]}")
        status = subprocess.run(
            [ray_command, "status", "--address", address], capture_output=True, text=True
        )
        active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if status.returncode == 0 and active.count("node_") == count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the cluster at {address} has not {count} nodes: {status}")
        time.sleep(1.0)


def test_two_node_cluster_cli(corpus: dict[str, Path], single: Path) -> None:
    """`tokenmill tokenize --engine ray --ray-address` against a head and a worker node of one
    CPU each (so the two actors run on different nodes): the single-machine bytes."""
    # short: Ray's socket paths under the temporary directory must fit AF_UNIX's 107 bytes
    work = Path(tempfile.mkdtemp(prefix="tm35-", dir="/tmp"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    head = _ray_start(
        ["--head", "--port", str(port), "--temp-dir", str(work / "head"),
         "--include-dashboard", "false", *common],
        work / "head.log",
    )  # fmt: skip
    worker = None
    try:
        _wait_for_nodes(address, 1, [head], [work / "head.log"])
        worker = _ray_start(
            ["--address", address, "--temp-dir", str(work / "worker"), *common], work / "worker.log"
        )
        _wait_for_nodes(address, 2, [head, worker], [work / "head.log", work / "worker.log"])
        output = work / "out"
        run = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli.main", "tokenize", str(corpus["inputs"]),
             "--tokenizer", str(corpus["tokenizer"]), "--engine", "ray",
             "--ray-address", address, "--output", str(output)],
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert "260 documents" in run.stderr
        _assert_same(single, output)
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
        shutil.rmtree(work, ignore_errors=True)
