"""Hostile inputs, round two (issue 37): files that change under a reader, planted links and
special files, resource bombs, escaping manifests, strict configs and clear errors.

Cases that could crash or hang the process run in a child under a timeout; the bomb and sparse
cases read back the child's peak RSS (VmHWM) against a 1 GiB budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RSS_BUDGET_MIB = 1024


def run_child(script: str, *args: str, timeout: float = 120) -> dict[str, object]:
    """Run `script` in a fresh interpreter (tests/ on its path); its last stdout line is a JSON
    report, to which the child's peak RSS (MiB) is added. A signal death or a hang fails."""
    wrapped = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        + textwrap.dedent(script)
        # VmHWM, the peak of this process's own memory map: ru_maxrss would start from the
        # parent's peak at fork (Linux carries it across fork and exec), the test run's own
        + "\nreport['peak_rss_mib'] = next(int(line.split()[1]) for line in "
        "open('/proc/self/status') if line.startswith('VmHWM:')) / 1024\n"
        "print(json.dumps(report))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", wrapped, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


# -- files that change under a reader ------------------------------------------------------------

_TRUNCATE = """
import os
import numpy as np
from conftest import write_megatron_shard
from tokenmill.errors import DataFormatError

root, reader, cut = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = sys.argv[4] if len(sys.argv) > 4 else "bin"
rng = np.random.default_rng(0)
if target == "bin":
    prefix = write_megatron_shard(root + "/s", [rng.integers(1, 1000, 3000) for _ in range(20)])
else:  # 15,000 sequences: a 300,042-byte .idx (mapped, not read whole; lengths end at 60,034)
    prefix = write_megatron_shard(root + "/s", [rng.integers(1, 1000, 4) for _ in range(15000)])
bin_path = prefix + ".bin"  # 120,000 bytes: 30 pages


class Tokenizer:
    vocab_size, eod = 1000, 0
    unique_identifiers = {"class": "Tokenizer"}


def gpt():
    from tokenmill import GPTDataset, GPTDatasetConfig, IndexedDataset, Split
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=512, tokenizer=Tokenizer(), split="1",
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=None,
    )
    data = IndexedDataset(prefix)
    return GPTDataset(data, prefix, np.arange(len(data), dtype=np.int32), 100, Split.train, config)


if reader == "indexed":
    from tokenmill import IndexedDataset
    dataset = IndexedDataset(prefix)
    first = dataset[0].copy()
    read = lambda: [int(dataset[i].sum()) for i in range(len(dataset))]
elif reader == "indexed slices":
    from tokenmill import IndexedDataset
    dataset = IndexedDataset(prefix)
    first = dataset[0:1]
    read = lambda: [len(dataset[i : i + 10]) for i in range(0, len(dataset), 10)]
elif reader == "megatron get":  # the class patch_megatron() installs, at megatron's path
    from tokenmill.megatron.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)
    first = dataset.get(0, 1)
    read = lambda: [int(dataset.get(i, 1).sum()) for i in range(len(dataset))]
elif reader == "megatron mmap reader":
    from tokenmill.megatron.indexed_dataset import _MMapBinReader
    bin_reader = _MMapBinReader(bin_path)
    read = lambda: [int(bin_reader.read(np.uint16, 1000, 2000 * i).sum()) for i in range(60)]
elif reader in ("gpt one", "gpt batch"):
    dataset = gpt()
    first = dataset[0]
    if reader == "gpt one":
        read = lambda: [int(dataset[i]["tokens"].sum()) for i in range(len(dataset))]
    else:
        read = lambda: dataset.__getitems__(list(range(len(dataset))))
elif reader in ("packed one", "packed batch"):
    from tokenmill import IndexedDataset
    from tokenmill.datasets.packed import PackedDataset, PackingConfig
    dataset = PackedDataset(IndexedDataset(prefix), PackingConfig(sequence_length=512))
    first = dataset[0]
    if reader == "packed one":
        read = lambda: [int(dataset[i]["input_ids"].sum()) for i in range(len(dataset))]
    else:
        read = lambda: dataset.__getitems__(list(range(len(dataset))))
elif reader == "nanogpt":
    from tokenmill.datasets.nanogpt import NanogptDataset
    from tokenmill.formats.nanogpt import write_nanogpt_shard
    bin_path = root + "/n.bin"
    write_nanogpt_shard(bin_path, rng.integers(1, 1000, 60000).astype(np.uint16))
    dataset = NanogptDataset(bin_path, seq_len=512)
    iterator = iter(dataset)
    first = next(iterator)
    read = lambda: [int(window["input_ids"].sum()) for window in iterator]
os.truncate(prefix + ".idx" if target == "idx" else bin_path, cut)
try:
    read()
    report = {"raised": None}
except DataFormatError as error:
    report = {"raised": str(error)}
"""


@pytest.mark.parametrize(
    "reader",
    [
        "indexed",
        "indexed slices",
        "megatron get",
        "megatron mmap reader",
        "gpt one",
        "gpt batch",
        "packed one",
        "packed batch",
        "nanogpt",
    ],
)
@pytest.mark.parametrize("cut", [40000, 60001], ids=["page-aligned", "partial-page"])
def test_a_file_truncated_while_mapped_raises_naming_it(
    tmp_path: Path, reader: str, cut: int
) -> None:
    """A .bin cut while a dataset has it mapped: a DataFormatError naming the file, not SIGBUS
    (the pages past the cut) and not zeros (the partial page at the cut)."""
    report = run_child(_TRUNCATE, str(tmp_path), reader, str(cut))
    raised = report["raised"]
    assert isinstance(raised, str), report
    assert ".bin: data file is now" in raised and "truncated or rewritten in place" in raised


@pytest.mark.parametrize("reader", ["indexed", "indexed slices", "megatron get"])
@pytest.mark.parametrize("cut", [40000, 60001], ids=["page-aligned", "partial-page"])
def test_an_index_truncated_while_mapped_raises_naming_it(
    tmp_path: Path, reader: str, cut: int
) -> None:
    """A mapped .idx (above the 64 KiB read-whole size) cut under an IndexedDataset: its
    lengths and pointers are read under the guard, so the error names the .idx."""
    report = run_child(_TRUNCATE, str(tmp_path), reader, str(cut), "idx")
    raised = report["raised"]
    assert isinstance(raised, str), report
    assert "s.idx: data file is now" in raised and "truncated or rewritten in place" in raised


@pytest.mark.parametrize("reader", ["indexed", "megatron get"])
def test_a_bin_truncated_beside_a_mapped_index_is_named(tmp_path: Path, reader: str) -> None:
    """ds[i] reads a mapped .idx's entry and probes the .bin's end in one guarded call: a
    fault there names the .bin when it is the file that shrank."""
    report = run_child(_TRUNCATE, str(tmp_path), reader, "40000", "bin beside a mapped idx")
    raised = report["raised"]
    assert isinstance(raised, str), report
    assert "s.bin: data file is now 40000 bytes" in raised, raised


# -- strict configs and records ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("yaml", "seed: 1\nchunk_tokens: 8\nseed: 2\n", r"c\.yaml: duplicate key 'seed' at line 3 \(first at line 1\)"),
        ("yaml", "a:\n  b: 1\n  b: 2\n", r"c\.yaml: duplicate key 'b' at line 3 \(first at line 2\)"),
        ("json", '{"blend": 1,\n "split": "1",\n "blend": 2}', r"c\.json: duplicate key 'blend' at line 3"),
    ],
)  # fmt: skip
def test_duplicate_config_keys_are_refused_naming_file_key_and_line(
    kind: str, text: str, message: str
) -> None:
    from tokenmill.common.config_text import ConfigTextError, parse_config_text

    with pytest.raises(ConfigTextError, match=message):
        parse_config_text(text, f"c.{kind}", kind)
    # a YAML merge key may still be overridden: that is what it is for
    merged = "base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  x: 3\n"
    assert parse_config_text(merged, "m.yaml", "yaml")["run"] == {"x": 3, "y": 2}


def test_mixture_files_refuse_duplicate_keys_and_booleans_as_counts(tmp_path: Path) -> None:
    from tokenmill.datasets.mixture_config import MixtureConfig, MixtureConfigError

    body = "sources:\n  a:\n    paths: [x]\nphases:\n  - name: p0\n    tokens: 100\n    weights: {a: 1.0}\n"
    (tmp_path / "twice.yaml").write_text("seed: 1\n" + body + "seed: 2\n")
    with pytest.raises(MixtureConfigError, match=r"twice\.yaml: duplicate key 'seed' at line 9"):
        MixtureConfig.from_file(tmp_path / "twice.yaml")
    (tmp_path / "bool.yaml").write_text("seed: 1\nchunk_tokens: true\n" + body)
    with pytest.raises(
        MixtureConfigError, match=r"bool\.yaml: chunk_tokens must be an integer, got True"
    ):
        MixtureConfig.from_file(tmp_path / "bool.yaml")


def test_a_jsonl_record_with_its_text_key_twice_is_refused(tmp_path: Path) -> None:
    from tokenmill.errors import DataFormatError
    from tokenmill.tokenize.packed_text import pack_chunk
    from tokenmill.tokenize.readers import ReadOptions, iter_chunks, read_documents

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two", "id": 1, "text": "three"}\n')
    with pytest.raises(
        DataFormatError, match=r"in\.jsonl: line 2: the key 'text' appears more than once"
    ):
        list(read_documents(path))
    options = ReadOptions()
    (chunk,) = iter_chunks(str(path), options)
    with pytest.raises(DataFormatError, match=r"in\.jsonl: line 2: the key 'text' appears more"):
        pack_chunk(chunk, options)  # the C++ packer leaves the line to the Python reader
    path.write_text('{"text": "a", "meta": {"text": "nested is fine"}}\n')
    assert list(read_documents(path)) == ["a"]


# -- resource bombs ------------------------------------------------------------------------------

_READ_BOMB = """
import os, zlib
from tokenmill.errors import DataFormatError
from tokenmill.tokenize.readers import read_documents

root, kind = sys.argv[1], sys.argv[2]
block_mib, blocks = 1 << 20, 320  # 320 MiB of output (past the 256 MiB grace)


def compressed(byte, suffix):
    if suffix == ".gz":
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    else:
        import zstandard
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
    block = byte * block_mib
    return b"".join([compressor.compress(block) for _ in range(blocks)] + [compressor.flush()])


if kind == "long line":  # 300 MiB of one JSON record (a sparse-free plain file)
    path = root + "/in.jsonl"
    with open(path, "wb") as stream:
        stream.write(b'{"text": "')
        for _ in range(300):
            stream.write(b"a" * block_mib)
        stream.write(b'"}\\n')
elif kind == "line without newline":
    path = root + "/in.txt"
    with open(path, "wb") as stream:
        for _ in range(300):
            stream.write(b"b" * block_mib)
elif kind.startswith(("gzip", "zstd")):
    suffix = ".gz" if kind.startswith("gzip") else ".zst"
    path = root + "/in.jsonl" + suffix
    with open(path, "wb") as stream:
        stream.write(compressed(b"\\n" if kind.endswith("newlines") else b"c", suffix))
try:
    from tokenmill.tokenize.readers import ReadOptions
    options = ReadOptions(txt_mode="line")
    count = sum(1 for _ in read_documents(path, options))
    report = {"raised": None, "documents": count}
except DataFormatError as error:
    report = {"raised": str(error)}
"""


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("long line", r"in\.jsonl: line 1 is longer than 268435456 bytes \(max_record_bytes\)"),
        ("line without newline", r"in\.txt: line 1 is longer than 268435456 bytes"),
        ("gzip one line", r"in\.jsonl\.gz: (line 1 is longer|jsonl\.gz decompresses to more)"),
        ("gzip newlines", r"in\.jsonl\.gz: jsonl\.gz decompresses to more than 200 times"),
        ("zstd one line", r"in\.jsonl\.zst: (line 1 is longer|jsonl\.zst decompresses to more)"),
        ("zstd newlines", r"in\.jsonl\.zst: jsonl\.zst decompresses to more than 200 times"),
    ],
)
def test_line_and_decompression_bombs_are_refused_within_memory(
    tmp_path: Path, kind: str, message: str
) -> None:
    import re

    report = run_child(_READ_BOMB, str(tmp_path), kind, timeout=300)
    assert isinstance(report["raised"], str) and re.search(message, report["raised"]), report
    assert float(str(report["peak_rss_mib"])) < RSS_BUDGET_MIB, report


# -- links and special files ---------------------------------------------------------------------


def test_fifo_inputs_are_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO named like an input is refused (read directly) or never taken (a directory walk),
    instead of blocking forever in open()."""
    import os

    report = run_child(
        """
import os
from tokenmill.errors import DataFormatError
from tokenmill.tokenize.readers import expand_inputs, read_documents
root = sys.argv[1]
os.mkfifo(root + "/planted.jsonl")
with open(root + "/real.jsonl", "w") as stream:
    stream.write('{"text": "x"}\\n')
report = {"walk": [os.path.basename(p) for p in expand_inputs([root])]}
try:
    list(read_documents(root + "/planted.jsonl"))
except DataFormatError as error:
    report["raised"] = str(error)
# a token source (a mixture's, a blend's) whose .idx is a FIFO
from tokenmill import IndexedDataset
os.mkfifo(root + "/source.idx")
open(root + "/source.bin", "wb").close()
try:
    IndexedDataset(root + "/source")
except DataFormatError as error:
    report["source"] = str(error)
""",
        str(tmp_path),
        timeout=60,
    )
    assert report["walk"] == ["real.jsonl"], report
    assert "planted.jsonl: is a FIFO, not a regular file" in str(report["raised"]), report
    assert "source.idx: index file is a FIFO, not a regular file" in str(report["source"]), report
    assert os.path.exists(tmp_path / "planted.jsonl")


def test_a_recursive_glob_through_a_symlink_loop_reads_each_file_once(tmp_path: Path) -> None:
    from tokenmill.tokenize.readers import expand_inputs

    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "data" / "sub" / "loop").symlink_to(tmp_path / "data")  # sub/loop -> data
    found = expand_inputs([str(tmp_path / "data" / "**" / "*.jsonl")])
    assert found == [str(tmp_path / "data" / "sub" / "a.jsonl")]


# -- manifests and downloads ---------------------------------------------------------------------


def _manifest_json(objects: list[dict[str, object]]) -> str:
    return json.dumps(
        {"format": "tokenmill.manifest", "version": 1, "objects": objects, "config": None}
    )


def _object(key: str, data: bytes, url: str | None = None) -> dict[str, object]:
    import hashlib

    entry: dict[str, object] = {
        "key": key,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    if url is not None:
        entry["url"] = url
    return entry


class _HostileServer:
    """A loopback HTTP server that decodes paths as a real one does ('%2e%2e' climbs), and
    serves an endless body, a redirect out of the published prefix, and a manifest."""

    def __init__(self, root: Path) -> None:
        import http.server
        import posixpath
        import threading
        import time
        import urllib.parse

        self.root = root
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                path = posixpath.normpath(
                    urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                )
                if path in ("/pub/trickle.bin", "/pub/trickle.json"):
                    self.send_response(200)
                    self.end_headers()
                    try:  # a byte every 50 ms, never the end (60 s at most: the test's guard)
                        for _ in range(1200):
                            self.wfile.write(b"t")
                            self.wfile.flush()
                            time.sleep(0.05)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                if path in ("/pub/endless.bin", "/pub/endless.json"):
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(4096):  # 64 MiB at most: a guard for the test itself
                            self.wfile.write(b"x" * (16 << 10))
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                if path == "/pub/moved.bin":
                    self.send_response(302)
                    self.send_header("Location", f"{outer.url}/secret.txt")
                    self.end_headers()
                    return
                file = outer.root / path.lstrip("/")
                if not file.is_file():
                    self.send_error(404)
                    return
                data = file.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile_server(tmp_path: Path) -> object:
    root = tmp_path / "served"
    (root / "pub").mkdir(parents=True)
    (root / "secret.txt").write_bytes(b"private")
    server = _HostileServer(root)
    yield server
    server.close()


@pytest.mark.parametrize("where", ["percent-encoded key", "percent-encoded url", "redirect"])
def test_manifests_cannot_reach_outside_their_location(
    tmp_path: Path, hostile_server: _HostileServer, where: str
) -> None:
    from tokenmill.errors import ObjectStorageError
    from tokenmill.storage.download import download

    base = f"{hostile_server.url}/pub"
    entry = {
        "percent-encoded key": _object("%2e%2e/secret.txt", b"private"),
        "percent-encoded url": _object("secret.txt", b"private", f"{base}/%2e%2e/secret.txt"),
        "redirect": _object("moved.bin", b"private"),
    }[where]
    (hostile_server.root / "pub" / "manifest.json").write_text(_manifest_json([entry]))
    destination = tmp_path / "destination"
    with pytest.raises((ValueError, ObjectStorageError), match=r"refusing|relative path"):
        download(f"{base}/manifest.json", str(destination), policy=_fast_policy())
    assert not [p for p in destination.rglob("*") if p.is_file() and b"private" in p.read_bytes()]


def _fast_policy() -> object:
    from tokenmill.storage.transfer import TransferPolicy

    return TransferPolicy(max_attempts=1, timeout=10.0)


def test_a_body_longer_than_the_manifest_says_is_cut_off(
    tmp_path: Path, hostile_server: _HostileServer
) -> None:
    from tokenmill.errors import ChecksumError, ObjectStorageError
    from tokenmill.storage.download import download

    base = f"{hostile_server.url}/pub"
    (hostile_server.root / "pub" / "manifest.json").write_text(
        _manifest_json([_object("endless.bin", b"y" * 100)])
    )
    destination = tmp_path / "destination"
    with pytest.raises(
        (ChecksumError, ObjectStorageError), match="more than the manifest's 100 bytes"
    ):
        download(f"{base}/manifest.json", str(destination), policy=_fast_policy())
    assert all(p.stat().st_size <= 100 for p in destination.rglob("*") if p.is_file())


@pytest.mark.parametrize("what", ["shard list", "declared size", "manifest"])
def test_a_body_that_trickles_forever_fails_at_the_total_deadline(
    tmp_path: Path, hostile_server: _HostileServer, what: str
) -> None:
    """A server that sends a byte every 50 ms and never ends the body: every read succeeds
    within the per-read timeout, so only the total deadline stops it (2 s here)."""
    from tokenmill.storage.download import download
    from tokenmill.storage.manifest import parse_shard_list
    from tokenmill.storage.transfer import DeadlinePassed, TransferPolicy

    policy = TransferPolicy(max_attempts=3, timeout=10.0, deadline=2.0)
    base = f"{hostile_server.url}/pub"
    source: object
    if what == "shard list":  # no size to stop at
        source = parse_shard_list([f"{base}/trickle.bin"], "test")
    elif what == "declared size":  # 1,000 bytes declared: more than 2 s of trickle brings
        (hostile_server.root / "pub" / "manifest.json").write_text(
            _manifest_json([_object("trickle.bin", b"t" * 1000)])
        )
        source = f"{base}/manifest.json"
    else:  # the manifest itself trickles
        source = f"{base}/trickle.json"
    with pytest.raises(DeadlinePassed, match=r"trickle\.(bin|json): not complete after \d+ s"):
        download(source, str(tmp_path / "destination"), policy=policy)  # type: ignore[arg-type]


def test_a_hard_linked_partial_file_never_overwrites_its_other_name(tmp_path: Path) -> None:
    import os

    from tokenmill.storage.download import download

    published = tmp_path / "published"
    published.mkdir()
    (published / "a.bin").write_bytes(b"new data")
    (published / "manifest.json").write_text(_manifest_json([_object("a.bin", b"new data")]))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    destination = tmp_path / "destination"
    destination.mkdir()
    os.link(victim, destination / ".a.bin.partial")  # planted by another user
    with pytest.raises(ValueError, match=r"\.a\.bin\.partial: it has 2 names"):
        download(str(published / "manifest.json"), str(destination))
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("keys", [["x.bin", ".x.bin.partial"], [".tokenmill-download.json"]])
def test_keys_may_not_name_another_objects_partial_or_the_state_file(
    tmp_path: Path, keys: list[str]
) -> None:
    from tokenmill.storage.download import STATE_NAME, download

    keys = [STATE_NAME if key == ".tokenmill-download.json" else key for key in keys]
    published = tmp_path / "published"
    published.mkdir()
    for key in keys:
        (published / key).write_bytes(key.encode())
    (published / "manifest.json").write_text(
        _manifest_json([_object(key, key.encode()) for key in keys])
    )
    with pytest.raises(ValueError, match="refusing the key"):
        download(str(published / "manifest.json"), str(tmp_path / "destination"))


def test_a_symlink_planted_at_the_parts_directory_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out.parts").symlink_to(elsewhere)  # planted by another user
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "tokenize", str(source),
         "--output", str(tmp_path / "out"), "--workers", "0", "--quiet"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "out.parts: it is a symlink to" in result.stderr, result.stderr
    assert [p.name for p in elsewhere.iterdir() if not p.name.startswith(".")] == []


def test_publish_follows_no_symlink_out_of_what_it_was_given(tmp_path: Path) -> None:
    from tokenmill.storage.publish import publish

    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.bin").write_bytes(b"a")
    (data / "inside.bin").symlink_to(data / "sub" / "a.bin")  # inside: published as a file
    (data / "leak.txt").symlink_to(secret)
    with pytest.raises(ValueError, match=r"leak\.txt: it is a symlink to .*secret\.txt, outside"):
        publish([str(data)], str(tmp_path / "out"))
    (data / "leak.txt").unlink()
    (data / "linked-dir").symlink_to(tmp_path)  # a directory link that leaves: refused too
    with pytest.raises(ValueError, match=r"linked-dir: it is a symlink"):
        publish([str(data)], str(tmp_path / "out"))
    (data / "linked-dir").unlink()
    # the destination: a key directory planted as a symlink is never written through
    destination = tmp_path / "destination"
    destination.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (destination / "data").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="refusing to write through the symlink"):
        publish([str(data)], str(destination))
    assert list(elsewhere.iterdir()) == []
    (destination / "data").unlink()
    report = publish([str(data)], str(destination))
    assert sorted(o.key for o in report.manifest.objects) == ["data/inside.bin", "data/sub/a.bin"]


# -- silently accepted values --------------------------------------------------------------------


class _Tokenizer:
    vocab_size, eod = 1000, 0

    @property
    def unique_identifiers(self) -> dict[str, str]:
        return {"class": "Tokenizer"}


@pytest.mark.parametrize("value", [1.5, float("nan"), float("inf")])
def test_float_tokens_are_refused_by_gpt_dataset_as_megatron_does(
    tmp_path: Path, value: float
) -> None:
    import numpy as np

    from tokenmill import GPTDataset, GPTDatasetConfig, IndexedDataset, Split

    from conftest import write_megatron_shard

    documents = [[1.0, 2.0, value, 4.0] * 8 for _ in range(6)]
    prefix = write_megatron_shard(tmp_path / "f", documents, dtype=np.float32)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=8, tokenizer=_Tokenizer(), split="1",
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=None,
    )  # fmt: skip
    data = IndexedDataset(prefix)
    dataset = GPTDataset(
        data, prefix, np.arange(len(data), dtype=np.int32), 10, Split.train, config
    )
    with pytest.raises(TypeError, match=r"f\.bin: tokens of dtype float32 cannot be served"):
        dataset[0]


def test_uint64_tokens_past_int64_are_refused_by_packed_dataset() -> None:
    import numpy as np

    from tokenmill.datasets.packed import PackedDataset, PackingConfig

    huge = 1 << 63

    class Uint64Documents:  # any indexed source: e.g. a .npy token directory of uint64
        path_prefix = "u"
        documents = (np.array([1, 2, 3], np.uint64), np.array([4, huge, 6], np.uint64))
        sequence_lengths = np.array([3, 3], np.int32)

        def get(self, idx: int, offset: int = 0, length: int | None = None) -> object:
            document = self.documents[idx]
            return document[offset : len(document) if length is None else offset + length]

    config = PackingConfig(sequence_length=8, shuffle_rows=False)
    dataset = PackedDataset(Uint64Documents(), config)
    with pytest.raises(OverflowError, match=rf"u: document 1 holds token {huge}, which does not"):
        dataset.__getitems__(list(range(len(dataset))))


def test_a_loader_state_past_the_epoch_or_of_the_wrong_type_is_refused() -> None:
    from tokenmill.loading.threaded import ThreadedBatchLoader

    loader = ThreadedBatchLoader(list(range(100)), batch_size=10, num_workers=0)
    with pytest.raises(
        ValueError, match=r"'batches_yielded' = 1000000000 is more than the 10 batches"
    ):
        loader.load_state_dict({"epoch": 0, "batches_yielded": 10**9})
    for bad in (1e9, True):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            loader.load_state_dict({"epoch": 0, "batches_yielded": bad})
    with pytest.raises(ValueError, match="must be a mapping, got list"):
        loader.load_state_dict([0, 1])  # type: ignore[arg-type]
    loader.load_state_dict({"epoch": 0, "batches_yielded": 10})  # the end of an epoch is fine


# -- errors that name the thing ------------------------------------------------------------------


def test_unclear_errors_name_the_index_file_and_value(tmp_path: Path) -> None:
    import numpy as np

    from tokenmill import GPTDataset, GPTDatasetConfig, IndexedDataset, Split
    from tokenmill.datasets.utils import normalize

    from conftest import write_megatron_shard

    prefix = write_megatron_shard(tmp_path / "d", [[1, 2, 3], [4, 5, 6, 7]])
    data = IndexedDataset(prefix)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=2, tokenizer=_Tokenizer(), split="1",
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=None,
    )  # fmt: skip
    dataset = GPTDataset(data, prefix, np.arange(len(data), dtype=np.int32), 3, Split.train, config)
    for index in (2**63, -(2**63) - 1):
        with pytest.raises(IndexError, match=rf"sample index {index} is out of range"):
            dataset[index]
        with pytest.raises(IndexError, match=rf"sample index {index} is out of range"):
            dataset.__getitems__([0, index])
    with pytest.raises(ValueError, match=r"d\\x00x' contains a NUL byte"):
        IndexedDataset(prefix + "\x00x")
    with pytest.raises(ValueError, match=r"holds a lone surrogate '\\udc80' at position"):
        IndexedDataset(prefix + "\udc80")
    with pytest.raises(ValueError, match=r"weights sum to more than a float64 holds"):
        normalize([1e308, 1e308])


def test_mixture_weights_that_overflow_are_reported_as_given(tmp_path: Path) -> None:
    from tokenmill.datasets.mixture_config import MixtureConfig, MixtureConfigError

    (tmp_path / "w.toml").write_text(
        'seed = 7\n[sources.a]\npaths = ["x"]\n[sources.b]\npaths = ["y"]\n[[phases]]\n'
        'name = "p0"\ntokens = 100\nweights = { a = 1e308, b = 1e308 }\n'
    )
    with pytest.raises(
        MixtureConfigError, match=r"weights sum to more .* \(a=1e\+308, b=1e\+308\)"
    ):
        MixtureConfig.from_file(tmp_path / "w.toml")


@pytest.mark.parametrize("content", [b"not json {", b"[1, 2]"], ids=["not json", "a list"])
def test_validate_state_errors_name_the_file(tmp_path: Path, content: bytes) -> None:
    from conftest import write_megatron_shard

    prefix = write_megatron_shard(tmp_path / "a", [[1, 2, 3], [4, 5]])
    config = tmp_path / "m.toml"
    config.write_text(
        f'seed = 7\nchunk_tokens = 1\nexhaustion = "drop"\n[sources.a]\npaths = ["{prefix}"]\n'
        '[[phases]]\nname = "p0"\ntokens = 4\nweights = { a = 1.0 }\n'
    )
    state = tmp_path / "state.json"
    state.write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "validate", str(config), "--state", str(state)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "state.json: the state" in result.stderr, (
        result.stderr
    )


def test_record_level_errors_name_file_and_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.errors import DataFormatError
    from tokenmill.tokenize.readers import read_documents

    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(table, tmp_path / "two.parquet")
    with pytest.raises(DataFormatError, match=r"two\.parquet: 2 columns are named 'text'"):
        list(read_documents(tmp_path / "two.parquet"))
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "bad \\udc80 here"}\n')
    with pytest.raises(DataFormatError, match=r"s\.jsonl: line 2: 'text' holds a lone surrogate"):
        list(read_documents(tmp_path / "s.jsonl"))


def test_packing_a_sparse_file_of_huge_claimed_sizes_is_refused_before_allocating(
    tmp_path: Path,
) -> None:
    """A sparse 34 GB .bin whose .idx claims 8 documents of 2**31 - 1 tokens: the plan of rows of
    8 tokens would need 128 GiB; PackedDataset and inspect --packing refuse it first."""
    report = run_child(
        """
import os
os.environ["TOKENMILL_MEMORY_BUDGET"] = str(1 << 30)
import struct
import numpy as np
from tokenmill import IndexedDataset
from tokenmill.cli.inspect_cmd import packing_report
from tokenmill.datasets.packed import PackedDataset, PackingConfig

prefix = sys.argv[1] + "/sparse"
count, length = 8, (1 << 31) - 1
with open(prefix + ".idx", "wb") as stream:
    stream.write(b"MMIDIDX\\x00\\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
    stream.write(struct.pack("<QQ", count, count + 1))
    stream.write(np.full(count, length, np.int32).tobytes())
    stream.write((np.arange(count, dtype=np.int64) * length * 2).tobytes())
    stream.write(np.arange(count + 1, dtype=np.int64).tobytes())
with open(prefix + ".bin", "wb") as stream:
    stream.truncate(count * length * 2)  # sparse: no block written
report = {}
data = IndexedDataset(prefix)
try:
    PackedDataset(data, PackingConfig(sequence_length=8))
except MemoryError as error:
    report["packed"] = str(error)
try:
    packing_report(data.sequence_lengths, 8, False)
except MemoryError as error:
    report["inspect"] = str(error)
""",
        str(tmp_path),
        timeout=120,
    )
    assert "sparse: a packing plan of at least 2,147,483,648 pieces" in str(report.get("packed"))
    assert "inspect --packing: a packing plan" in str(report.get("inspect")), report
    assert float(str(report["peak_rss_mib"])) < RSS_BUDGET_MIB, report


def test_a_sparse_npy_document_corpus_is_refused_before_allocating_its_table(
    tmp_path: Path,
) -> None:
    """A directory of .npy token files, one of them a sparse 8 GiB file of zeros, read as
    documents ending at EOS 0: one document per token, 4 Gi of them. The boundary scan checks
    the table it implies against the memory budget as it goes and refuses it after one step.
    The child's data limit (2 GiB; the file's map is not counted) turns the old unbounded
    allocation into an error instead of a machine swapping."""
    report = run_child(
        """
import os, resource
os.environ["TOKENMILL_MEMORY_BUDGET"] = str(1 << 30)
resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
import numpy as np
from tokenmill.formats.documents import DocumentCorpus

root = sys.argv[1] + "/corpus"
os.mkdir(root)
np.save(root + "/a.npy", np.array([5, 6, 0, 7, 0], dtype=np.uint16))
count = 4 << 30
with open(root + "/b.npy", "wb") as stream:
    header = {"descr": "<u2", "fortran_order": False, "shape": (count,)}
    np.lib.format.write_array_header_1_0(stream, header)
    stream.truncate(stream.tell() + 2 * count)  # sparse: no block written
try:
    DocumentCorpus(root, eos_token=0)
    report = {"raised": None}
except MemoryError as error:
    report = {"raised": str(error)}
""",
        str(tmp_path),
        timeout=120,
    )
    raised = str(report["raised"])
    assert "b.npy: the document table of at least" in raised, report
    assert "EOS token 0" in raised and "4,294,967,296 tokens" in raised, report
    assert float(str(report["peak_rss_mib"])) < RSS_BUDGET_MIB, report


@pytest.mark.parametrize(("bos", "eos"), [(None, 0), (0, None)])
def test_a_boundary_scan_in_steps_finds_what_one_scan_finds(
    monkeypatch: pytest.MonkeyPatch, bos: int | None, eos: int | None
) -> None:
    import numpy as np

    from tokenmill.formats import sources

    tokens = np.random.default_rng(3).integers(0, 4, 1000).astype(np.uint16)
    shard = sources.Shard("s", "s.npy", tokens)
    whole = sources.document_lengths(shard, bos, eos)
    monkeypatch.setattr(sources, "SCAN_STEP_TOKENS", 7)
    stepped = sources.document_lengths(shard, bos, eos)
    assert whole[0] is not None and stepped[0] is not None
    assert whole[0].tolist() == stepped[0].tolist() and whole[1] == stepped[1]


def test_a_manifest_that_never_ends_is_refused_at_its_limit(
    tmp_path: Path, hostile_server: _HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.storage import transfer
    from tokenmill.storage.download import download

    monkeypatch.setattr(transfer, "MAX_MANIFEST_BYTES", 1 << 20)
    with pytest.raises(ValueError, match=r"endless\.json: longer than 1,048,576 bytes"):
        download(
            f"{hostile_server.url}/pub/endless.json", str(tmp_path / "d"), policy=_fast_policy()
        )


def test_cli_errors_echo_a_huge_value_in_one_bounded_line(tmp_path: Path) -> None:
    value = "x" * (50 << 20)
    config = tmp_path / "m.yaml"
    config.write_text(
        f'seed: 1\nsources:\n  a:\n    paths: ["{value}"]\nphases:\n  - name: p\n'
        "    tokens: 10\n    weights: {a: 1.0}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "validate", str(config)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and len(result.stderr) < 2100, len(result.stderr)


# -- clean exits ---------------------------------------------------------------------------------

_EXIT_RACE = """
import sys, time
import concurrent.futures.process as process


def wakeup(self):  # CPython 3.11's own, with the gap between its check and its write widened
    if not self._closed:
        if process._global_shutdown:  # only in the interpreter-exit hook
            time.sleep(0.2)
        self._writer.send_bytes(b"")


process._ThreadWakeup.wakeup = wakeup
from tokenmill.cli.main import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_tokenize_prints_its_one_line_and_nothing_at_exit(tmp_path: Path) -> None:
    """A worker's error ends tokenize with one line, and nothing follows at interpreter exit.
    The pool's manager thread used to outlive the error, and CPython's exit hook raced it for
    the pool's wake-up pipe: now and then "Exception ignored ... Bad file descriptor". The
    child widens that race (the hook's write sleeps), so a still-running thread loses it on
    every run; the runs repeat for any other order of exit."""
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(3000))
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "lone \\udc80 surrogate"}\n')
    for run in range(20):
        result = subprocess.run(
            [sys.executable, "-c", _EXIT_RACE, "tokenize", str(good), str(bad), "--output",
             str(tmp_path / f"out{run}"), "--threads", "2", "--quiet"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert result.stderr.count("\n") == 1, f"run {run}: {result.stderr}"
        assert result.stderr.startswith("tokenmill: error: ") and "lone surrogate" in result.stderr


def test_a_subarray_descr_in_an_npy_header_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Found by the npy_tokens fuzz campaign (2026-11-28): descr '5u2' with shape () passed the
    header checks, and the reshape of its 5 values into () raised a bare numpy ValueError."""
    from tokenmill.errors import DataFormatError
    from tokenmill.formats.npy import load_npy
    from tokenmill.formats.token_dir import open_token_file

    header = b"{'descr': '5u2', 'fortran_order': False, 'shape': (), }"
    header += b" " * (118 - len(header)) + b"\n"
    path = tmp_path / "subarray.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(10))
    for read in (load_npy, lambda p: open_token_file(p, None)):
        with pytest.raises(DataFormatError, match=r"subarray\.npy.*subarray dtype"):
            read(path)
