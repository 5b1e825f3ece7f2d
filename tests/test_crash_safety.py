"""Crash safety: SIGKILL a process in the middle of writing, then check what readers see.

Each test runs the real code in a child process that pauses at a chosen point (a patched
function prints PAUSED and sleeps), kills it with SIGKILL there, and then checks that

* no partial output is visible to a reader (outputs appear by rename only, the commit point
  last), and readers fail with a clear error instead of reading half-written data;
* the next run completes and its output is byte-identical to an uninterrupted run.

The pause points sit where a crash does the most damage: mid-write of a temporary file and
between the renames of files that belong together. (`tokenize` killed between finished parts is
tests/test_tokenize.py::test_killed_run_resumes_to_identical_output.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tokenmill.errors import CacheError
from tokenmill.formats.megatron import IndexedDataset

from conftest import random_documents, write_megatron_shard

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")

TESTS = Path(__file__).parent

PAUSE = """
import os, sys, time
sys.path.insert(0, {tests!r})

def pause(*args, **kwargs):
    print("PAUSED", flush=True)
    time.sleep(600)
"""


def kill_when_paused(body: str, **values: object) -> None:
    """Run PAUSE + body in a child, wait for PAUSED, SIGKILL it, and check it died there."""
    code = PAUSE.format(tests=str(TESTS)) + textwrap.dedent(body).format(**values)
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        line = process.stdout.readline()
        process.send_signal(signal.SIGKILL)
        _, error = process.communicate(timeout=60)
    if line.strip() != "PAUSED":
        raise AssertionError(f"the child never reached its pause point: {line!r}\n{error}")
    assert process.returncode == -signal.SIGKILL


def visible(directory: Path) -> set[str]:
    """The files a reader can see (temporary files are hidden dot-files)."""
    return {p.name for p in directory.iterdir() if not p.name.startswith(".")}


def temporaries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".tmp")}


# -- index cache ----------------------------------------------------------------------------------

CACHE_CHILD = """
import numpy as np
from test_stale_data import build, make_config
import tokenmill.index.cache_writes as writes_module
import tokenmill.index.fingerprint as fingerprint_module
point = {point!r}
if point == "mid-array":
    # killed with half of an array's bytes written under its temporary name: the background
    # writer's second write(2) is the first array's data, after its .npy header; it stores half,
    # prints PAUSED and sleeps
    from tokenmill._core import _testing
    _testing.inject_file_fault("write", 2, pause=True)
elif point == "third-array":
    # killed while the third array's bytes are being prepared: an entry's files are handed to
    # the writer together, so none of that entry's files exists yet
    real = writes_module._npy_chunks
    calls = []
    def third(path, array):
        calls.append(path)
        if len(calls) == 3:
            pause()
        return real(path, array)
    writes_module._npy_chunks = third
elif point in ("description", "rebuild"):
    # arrays and data fingerprint renamed into place, the descriptions (commit points) not yet
    real_commit = writes_module.commit_together
    def before_descriptions(files, **options):
        if any(str(file.path).endswith("-description.txt") for file in files):
            pause()
        real_commit(files, **options)
    writes_module.commit_together = before_descriptions
if point == "rebuild":
    # the entry exists (built by the parent) but its data changed: killed while rebuilding it
    pass
build({shard!r}, make_config(__import__("pathlib").Path({cache!r})))
"""


@pytest.mark.parametrize("point", ["mid-array", "third-array", "description", "rebuild"])
def test_killed_cache_build_leaves_a_miss_and_the_next_run_completes(
    shard: str, tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_stale_data import arrays, build, make_config, retokenize

    cache = tmp_path / "cache"
    if point == "rebuild":
        build(shard, make_config(cache))
        retokenize(shard, seed=5)
    kill_when_paused(CACHE_CHILD, point=point, shard=shard, cache=str(cache))

    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
    if point == "rebuild":
        # a committed entry is never deleted: killed before re-committing its (identical)
        # description, the rebuild has already renamed the new arrays and then the new data
        # fingerprint into place, so the entry is whole and matches the new data
        assert list(cache.glob("*-description.txt"))
        build(shard, make_config(cache))
    else:
        # megatron-core's hit test (every file present) fails: the description is the commit
        # point
        assert not list(cache.glob("*-description.txt"))
        assert all(name.endswith((".npy", "-data.tokenmill.json")) for name in visible(cache))
        # a rank that does not build reports the miss instead of using partial arrays
        with pytest.raises(CacheError, match=r"description\.txt: missing"):
            build(shard, make_config(cache))
    monkeypatch.undo()

    # the next run is a new build: it sweeps the directory once
    resumed = build(shard, make_config(cache))
    reference = build(shard, make_config(tmp_path / "reference"))
    for ours, theirs in zip(arrays(resumed), arrays(reference)):
        np.testing.assert_array_equal(ours, theirs)
        assert ours.dtype == theirs.dtype
    names = {name.split("-", 1)[1] for name in visible(cache)}
    assert names == {name.split("-", 1)[1] for name in visible(tmp_path / "reference")}
    for name in visible(cache):
        if not name.endswith(".json"):  # the fingerprint records this shard's mtime
            assert (cache / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert not temporaries(cache), "the next build removes the killed writer's temporaries"


# -- convert --------------------------------------------------------------------------------------

CONVERT_CHILD = """
from tokenmill.cli.main import main
import tokenmill.formats.megatron as megatron
import tokenmill.formats.nanogpt as nanogpt
point = {point!r}
if point == "mid-bin":
    real_add = megatron.IndexedDatasetBuilder.add_documents
    calls = []
    def add_documents(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            pause()
        return real_add(self, *args, **kwargs)
    megatron.IndexedDatasetBuilder.add_documents = add_documents
elif point == "between-bin-and-idx":
    real_replace = os.replace
    def replace(source, target, *args, **kwargs):
        if str(target).endswith(".idx"):
            pause()
        return real_replace(source, target, *args, **kwargs)
    os.replace = replace
elif point == "mid-nanogpt-shard":
    real_write = nanogpt.NanogptShardWriter.write
    calls = []
    def write(self, tokens):
        calls.append(1)
        real_write(self, tokens)
        if len(calls) == 3:
            pause()
    nanogpt.NanogptShardWriter.write = write
sys.exit(main({argv!r}))
"""


def convert_argv(source: str, target: Path, to: str) -> list[str]:
    return ["convert", source, str(target), "--to", to, "--chunk-tokens", "500", "--quiet"]


@pytest.mark.parametrize("point", ["mid-bin", "between-bin-and-idx"])
def test_killed_convert_to_megatron(tmp_path: Path, point: str) -> None:
    from tokenmill.cli.main import main

    source = write_megatron_shard(
        tmp_path / "source", random_documents(np.random.default_rng(3), 300)
    )
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "converted"
    # an earlier conversion of other data is being replaced: its .idx must never pair with
    # the new .bin
    old = write_megatron_shard(target, random_documents(np.random.default_rng(4), 50))
    argv = convert_argv(source, target, "megatron")
    kill_when_paused(CONVERT_CHILD, point=point, argv=argv)

    if point == "mid-bin":
        # the old pair is untouched: the new .bin is still a temporary file
        assert len(IndexedDataset(old)) == 50
    else:
        assert not Path(old + ".idx").exists()
        with pytest.raises(FileNotFoundError, match=r"converted\.idx"):
            IndexedDataset(str(target))

    assert main(argv) == 0
    assert main(convert_argv(source, tmp_path / "reference", "megatron")) == 0
    for suffix in (".bin", ".idx"):
        assert (
            Path(str(target) + suffix).read_bytes()
            == (tmp_path / ("reference" + suffix)).read_bytes()
        )
    assert visible(tmp_path / "out") == {"converted.bin", "converted.idx"}


def test_killed_convert_to_nanogpt(tmp_path: Path) -> None:
    from tokenmill.cli.main import main
    from tokenmill.formats.nanogpt import NanogptShard

    source = write_megatron_shard(
        tmp_path / "source", random_documents(np.random.default_rng(3), 300)
    )
    argv = convert_argv(source, tmp_path / "out", "nanogpt")
    kill_when_paused(CONVERT_CHILD, point="mid-nanogpt-shard", argv=argv)
    assert visible(tmp_path / "out") == set()  # the shard exists only as a temporary file

    assert main(argv) == 0
    assert main(convert_argv(source, tmp_path / "reference", "nanogpt")) == 0
    assert visible(tmp_path / "out") == visible(tmp_path / "reference") == {"source.bin"}
    assert (tmp_path / "out" / "source.bin").read_bytes() == (
        tmp_path / "reference" / "source.bin"
    ).read_bytes()
    tokens = NanogptShard(tmp_path / "out" / "source.bin").tokens
    expected = np.concatenate(IndexedDataset(source)[0:300])
    np.testing.assert_array_equal(tokens, expected)


# -- merge ----------------------------------------------------------------------------------------

MERGE_CHILD = """
from tokenmill.cli.main import main
import tokenmill.formats.megatron as megatron
point = {point!r}
if point == "mid-copy":
    real_add = megatron.IndexedDatasetBuilder.add_index
    calls = []
    def add_index(self, prefix):
        calls.append(prefix)
        if len(calls) == 2:
            pause()
        return real_add(self, prefix)
    megatron.IndexedDatasetBuilder.add_index = add_index
else:
    real_replace = os.replace
    def replace(source, target, *args, **kwargs):
        if str(target).endswith({suffix!r}):
            pause()
        return real_replace(source, target, *args, **kwargs)
    os.replace = replace
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    ("point", "suffix"),
    [("mid-copy", ""), ("before-idx", ".idx"), ("before-sidecar", ".tokenmill.json")],
)
def test_killed_merge(tmp_path: Path, point: str, suffix: str) -> None:
    from tokenmill.cli.main import main
    from tokenmill.formats.dataset_sidecar import read_sidecar, write_sidecar

    fingerprint = {"kind": "bytes", "sha256": "a" * 64, "vocab_size": 258, "bos_id": 256}
    fingerprint["eod_id"] = 257
    inputs = []
    for number in range(3):
        documents = random_documents(np.random.default_rng(number), 80)
        prefix = write_megatron_shard(tmp_path / f"part{number}", documents)
        write_sidecar(prefix, fingerprint, documents=80)
        inputs.append(prefix)
    (tmp_path / "out").mkdir()
    output = tmp_path / "out" / "merged"
    argv = ["merge", *inputs, "--output", str(output), "--quiet"]
    kill_when_paused(MERGE_CHILD, point=point, suffix=suffix, argv=argv)

    if point == "before-sidecar":
        # the dataset is complete, but without its fingerprint it cannot be blended or merged
        assert visible(tmp_path / "out") == {"merged.bin", "merged.idx"}
    else:
        assert not Path(str(output) + ".idx").exists()
        with pytest.raises(FileNotFoundError):
            IndexedDataset(str(output))

    assert main(argv) == 0
    assert main([*argv[:-3], "--output", str(tmp_path / "reference"), "--quiet"]) == 0
    for name in ("merged.bin", "merged.idx"):
        assert (tmp_path / "out" / name).read_bytes() == (
            tmp_path / name.replace("merged", "reference")
        ).read_bytes()
    assert read_sidecar(str(output))["tokenizer"] == fingerprint
    assert visible(tmp_path / "out") == {"merged.bin", "merged.idx", "merged.tokenmill.json"}
    assert not temporaries(tmp_path / "out"), "the next merge removes the killed one's files"


# -- two builders ---------------------------------------------------------------------------------


def test_racing_builders_write_one_valid_entry(shard: str, tmp_path: Path) -> None:
    """Four processes start building the same entry at once: one builds, the others wait on
    the lock and load its result; all see identical arrays and one set of files remains."""
    from test_stale_data import arrays, build, make_config

    script = textwrap.dedent(
        f"""
        import sys, hashlib
        sys.path.insert(0, {str(TESTS)!r})
        from test_stale_data import arrays, build, make_config
        import pathlib
        dataset = build({shard!r}, make_config(pathlib.Path({str(tmp_path / "cache")!r})),
                        num_samples=20000)
        print(hashlib.sha256(b"".join(a.tobytes() for a in arrays(dataset))).hexdigest())
        """
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=300)[0].strip() for process in processes]
    assert [process.returncode for process in processes] == [0] * 4
    assert len(set(outputs)) == 1
    reference = build(shard, make_config(tmp_path / "reference"), num_samples=20000)
    import hashlib

    digest = hashlib.sha256(b"".join(a.tobytes() for a in arrays(reference))).hexdigest()
    assert outputs[0] == digest
    assert len(list((tmp_path / "cache").glob("*-description.txt"))) == 1
    assert not temporaries(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache")
