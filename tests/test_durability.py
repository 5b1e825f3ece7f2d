"""Durable, thread-safe writes: fsync before the rename, the directory after, umask read once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenmill.common import atomic
from tokenmill.common.atomic import AtomicFile, atomic_write_text
from tokenmill.formats.megatron import IndexedDatasetBuilder


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every os.fsync: ("dir" | "file", what the target's final path held at that moment)."""
    calls: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file"
        calls.append((kind, os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.delenv("TOKENMILL_FSYNC", raising=False)
    return calls


def test_commit_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, fsyncs: list[tuple[str, str]]
) -> None:
    target = tmp_path / "entry.txt"
    written = AtomicFile(target)
    written.stream.write(b"payload")
    written.commit()
    assert [kind for kind, _ in fsyncs] == ["file", "dir"]
    assert fsyncs[0][1] != str(target)  # the temporary file, before it had the final name
    assert fsyncs[1][1] == str(tmp_path)
    assert target.read_bytes() == b"payload"


def test_fsync_can_be_turned_off(
    tmp_path: Path, fsyncs: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_FSYNC", "0")
    atomic_write_text(tmp_path / "a.txt", "x")
    assert fsyncs == []
    assert (tmp_path / "a.txt").read_text() == "x"


def test_megatron_shards_are_durable(tmp_path: Path, fsyncs: list[tuple[str, str]]) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "shard.bin"), dtype=np.uint16)
    builder.add_document(np.arange(10), lengths=[10])
    builder.finalize(str(tmp_path / "shard.idx"))
    kinds = [kind for kind, _ in fsyncs]
    assert kinds.count("file") >= 2 and kinds.count("dir") >= 2  # .bin and .idx, each renamed
    synced_files = [path for kind, path in fsyncs if kind == "file"]
    assert not any(path.endswith(("shard.bin", "shard.idx")) for path in synced_files)


def test_default_file_mode_never_touches_the_umask(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(mask: int) -> int:
        raise AssertionError("os.umask called: another thread could see umask 0")

    monkeypatch.setattr(os, "umask", forbidden)
    assert atomic.default_file_mode() == 0o666 & ~atomic._UMASK


def test_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    # a fresh process with umask 027: tokenmill's files are 0640, like open(..., "w")'s
    script = (
        "import os, sys; os.umask(0o027)\n"
        "from tokenmill.common.atomic import atomic_write_text\n"
        "atomic_write_text(sys.argv[1], 'x')\n"
        "print(oct(os.stat(sys.argv[1]).st_mode & 0o777), oct(os.umask(0)))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "f")], capture_output=True, text=True,
        check=True,
    ).stdout.split()  # fmt: skip
    assert output == ["0o640", "0o27"]
