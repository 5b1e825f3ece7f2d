"""Durable, thread-safe writes: fsync before the rename, the directory after, umask read once."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill._core import _testing
from tokenmill.common import atomic
from tokenmill.common.atomic import AtomicFile, atomic_write_text
from tokenmill.errors import ResourceLimitError
from tokenmill.formats.megatron import IndexedDatasetBuilder


def _take_background_syncs(calls: list[tuple[str, str]]) -> None:
    """Append the fsyncs (and syncfs calls: "filesystem") the background file writer made since
    the last call (its log)."""
    for logged in _testing.take_file_syncs():
        kind, found, label = logged.partition("filesystem:")
        calls.append(("filesystem", label) if found and not kind else ("file", logged))


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """Every fsync: ("dir" | "file", what the target's final path held at that moment). Those of
    Python (os.fsync) as they happen; those of the background file writer (its test log) before
    the next Python fsync or rename (a commit waits for them before either), and at the end."""
    calls: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        _take_background_syncs(calls)
        kind = "dir" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file"
        calls.append((kind, os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.delenv("TOKENMILL_FSYNC", raising=False)
    _testing.take_file_syncs()
    _testing.record_file_syncs(True)
    try:
        yield calls
    finally:
        _testing.record_file_syncs(False)
        _testing.take_file_syncs()


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


@pytest.mark.parametrize(
    "write",
    [
        "atomic.atomic_write_text(sys.argv[1], 'x')",  # streamed: AtomicFile (mkstemp + fchmod)
        "atomic.commit_together([atomic.WrittenFile(sys.argv[1], (b'x',))])",  # cache files
    ],
    ids=["AtomicFile", "WrittenFile"],
)
def test_files_get_the_mode_the_umask_gives(tmp_path: Path, write: str) -> None:
    # a fresh process with umask 027: tokenmill's files are 0640, like open(..., "w")'s
    script = (
        "import os, sys; os.umask(0o027)\n"
        "from tokenmill.common import atomic\n"
        f"{write}\n"
        "print(oct(os.stat(sys.argv[1]).st_mode & 0o777), oct(os.umask(0)))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "f")], capture_output=True, text=True,
        check=True,
    ).stdout.split()  # fmt: skip
    assert output == ["0o640", "0o27"]


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch, fsyncs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """fsyncs (as in `fsyncs`) and renames ("rename", final name), in the order they happened."""
    real_replace = os.replace

    def recording_replace(source: str, target: str) -> None:
        _take_background_syncs(fsyncs)
        fsyncs.append(("rename", os.fspath(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", recording_replace)
    return fsyncs


def test_commit_together_syncs_every_file_before_any_rename_and_the_directory_once(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    files = []
    for number in range(20):
        file = AtomicFile(tmp_path / f"f{number}.txt")
        file.stream.write(f"payload {number}".encode())
        files.append(file)
    atomic.commit_together(files)
    kinds = [kind for kind, _ in events]
    assert kinds == ["file"] * 20 + ["rename"] * 20 + ["dir"]
    assert all(path.endswith(".tmp") for kind, path in events if kind == "file")
    assert [path for kind, path in events if kind == "rename"] == [str(f.path) for f in files]
    assert all((tmp_path / f"f{n}.txt").read_text() == f"payload {n}" for n in range(20))
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_commit_together_without_threads_is_the_same_commit(
    tmp_path: Path, events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # writers that cannot start a thread (threads=0 runs every job in line) do the same work
    monkeypatch.setattr(atomic, "_WRITERS", {})
    monkeypatch.setattr(atomic, "_WRITER_THREADS", {"write": 0, "sync": 0})
    files = [AtomicFile(tmp_path / f"f{number}.txt") for number in range(3)]
    written = [atomic.WrittenFile(tmp_path / f"w{number}.txt", (b"w",)) for number in range(3)]
    atomic.commit_together([*files, *written])
    assert [kind for kind, _ in events] == ["file"] * 6 + ["rename"] * 6 + ["dir"]
    assert [(tmp_path / f"w{number}.txt").read_bytes() for number in range(3)] == [b"w"] * 3


def _entry(directory: Path, number: int) -> Any:
    from tokenmill.index.cache import IndexCache

    return IndexCache.create(
        directory, f"{number:032x}", "GPTDataset", "train", f"entry {number}", ("a", "b")
    )


def test_deferred_commits_publish_the_batch_at_its_end_descriptions_last(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    from tokenmill.index.cache import deferred_commits

    entries = [_entry(tmp_path, number) for number in range(5)]
    with deferred_commits():
        for number, entry in enumerate(entries):
            entry.save({"a": np.arange(number + 1), "b": np.zeros(3)})
            # no description (the commit point) before the batch ends: no reader takes an entry
            # of a partial batch (the arrays are written under their final names, unread
            # until their description is in place)
            assert not [name for name in os.listdir(tmp_path) if name.endswith("-description.txt")]
        assert not events
    renames = [path for kind, path in events if kind == "rename"]
    # only the descriptions are renamed, after every array is on disk; one directory fsync for
    # the arrays' names, one for the descriptions'
    assert len(renames) == 5 and all(path.endswith("-description.txt") for path in renames)
    first_rename = next(i for i, (kind, _) in enumerate(events) if kind == "rename")
    synced = [path for kind, path in events[:first_rename] if kind == "file"]
    assert sorted(path for path in synced if path.endswith(".npy")) == sorted(
        str(entry.array_path(name)) for entry in entries for name in ("a", "b")
    )
    assert [kind for kind, _ in events].count("dir") == 2
    assert [kind for kind, _ in events][first_rename - 1] == "file"  # descriptions' own fsyncs
    for number, entry in enumerate(entries):
        arrays, problems = entry.load()
        assert problems == [] and arrays is not None
        np.testing.assert_array_equal(arrays["a"], np.arange(number + 1))
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_batch_writes_beside_a_name_that_exists_and_renames(tmp_path: Path) -> None:
    from tokenmill.index.cache import deferred_commits

    # a name already there (a stale entry rebuilt, a killed or racing writer's file) is
    # replaced by a rename, never written through
    entry = _entry(tmp_path, 1)
    stale = entry.array_path("a")
    stale.write_bytes(b"a killed writer's half array")
    before = os.stat(stale).st_ino
    with deferred_commits():
        entry.save({"a": np.arange(4), "b": np.zeros(2)})
    assert os.stat(stale).st_ino != before
    arrays, problems = entry.load()
    assert problems == [] and arrays is not None
    np.testing.assert_array_equal(arrays["a"], np.arange(4))
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_deferred_commits_keep_the_entries_completed_before_an_error(tmp_path: Path) -> None:
    from tokenmill.index.cache import deferred_commits

    first, second = _entry(tmp_path, 1), _entry(tmp_path, 2)

    def batch_that_fails() -> None:
        with deferred_commits():
            first.save({"a": np.arange(4), "b": np.zeros(2)})
            second.save({"a": np.arange(4)})  # "b" missing: fails while being written

    with pytest.raises(KeyError):
        batch_that_fails()
    assert first.load()[0] is not None
    assert not second.description_path.exists()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_batch_commits_every_entry_but_the_one_whose_file_could_not_be_written(
    tmp_path: Path,
) -> None:
    from tokenmill.index.cache import deferred_commits

    entries = [_entry(tmp_path, number) for number in range(6)]

    # the 7th write(2) of the background writer fails: some entry's file, written while the
    # batch goes on; that entry is left out, the others are committed, then the error is raised
    def batch() -> None:
        with deferred_commits():
            for number, entry in enumerate(entries):
                entry.save({"a": np.arange(number + 1), "b": np.zeros(3)})

    _testing.inject_file_fault("write", 7, errno.ENOSPC)
    try:
        with pytest.raises(ResourceLimitError, match="filesystem is full"):
            batch()
    finally:
        _testing.inject_file_fault("write", 0)
    committed = [entry for entry in entries if entry.description_path.exists()]
    assert len(committed) == 5
    for entry in committed:
        arrays, problems = entry.load()
        assert problems == [] and arrays is not None
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_an_entry_whose_fingerprint_cannot_be_written_is_left_out_of_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.index import cache_writes
    from tokenmill.index.cache import deferred_commits

    # an entry's fingerprint is handed to the writer with the files of the entry SEAL_LAG after
    # it (here the next one): when that hand-over fails, the entry is not committed without its
    # fingerprint
    monkeypatch.setattr(cache_writes, "SEAL_LAG", 0)
    entries = [_entry(tmp_path, number) for number in range(3)]
    real = atomic.WrittenFile.together.__func__  # type: ignore[attr-defined]
    calls = [0]

    def failing_second(cls: type, files: Any, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no memory for the writer's queue")
        return real(cls, files, *args)

    monkeypatch.setattr(atomic.WrittenFile, "together", classmethod(failing_second))
    fingerprint = {"format": "tokenmill.data-fingerprint", "version": 1, "datasets": {}}

    def batch() -> None:
        with deferred_commits():
            for number, entry in enumerate(entries):
                arrays = {"a": np.arange(number + 1), "b": np.zeros(3)}
                entry.save(arrays, fingerprint, fingerprint_made_here=True)

    with pytest.raises(MemoryError, match="writer's queue"):
        batch()
    # the first entry's fingerprint went with the second's files: neither is committed
    assert not any(entry.description_path.exists() for entry in entries)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_blend_build_fsyncs_in_rounds_not_per_file(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig

    from conftest import TinyTokenizer, random_documents, write_megatron_shard

    rng = np.random.default_rng(3)
    shards = [
        write_megatron_shard(tmp_path / f"shard{i}", random_documents(rng, 30, 60))
        for i in range(11)
    ]
    events.clear()
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        tokenizer=TinyTokenizer(),
        blend=(shards, [1.0] * len(shards)),
        split="100,0,0",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    BlendedMegatronDatasetBuilder(GPTDataset, [200, 0, 0], lambda: True, config).build()
    renamed = [path for kind, path in events if kind == "rename"]
    assert len([p for p in renamed if p.endswith("-description.txt")]) == 12  # 11 members + blend
    # the members' 55 files and the blend's 4 (under the 64 of a syncfs) are committed together,
    # in two rounds (data, then descriptions): two directory fsyncs, however many sources
    assert [kind for kind, _ in events].count("dir") == 2
    first_description = next(i for i, (k, p) in enumerate(events) if p.endswith("description.txt"))
    data_files = [i for i, (k, p) in enumerate(events) if k == "file" and "description" not in p]
    assert len(data_files) == 11 * 4 + 3  # arrays and fingerprints, the blend's included
    assert max(data_files) < first_description


def _batch_of(directory: Path, entries: int) -> list[Any]:
    """`entries` entries saved in one deferred_commits batch (3 files each)."""
    from tokenmill.index.cache import deferred_commits

    saved = [_entry(directory, number) for number in range(entries)]
    with deferred_commits():
        for number, entry in enumerate(saved):
            entry.save({"a": np.arange(number + 1), "b": np.zeros(3)})
    return saved


@pytest.fixture
def small_whole_filesystem_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "WHOLE_FILESYSTEM_SYNC_FILES", 6)
    # nothing else dirty in the page cache (a shared machine's other work would otherwise turn
    # the syncfs into per-file fsyncs: WHOLE_FILESYSTEM_SYNC_OTHER_BYTES)
    monkeypatch.setattr(atomic, "_dirty_bytes", lambda: 0)


@pytest.mark.usefixtures("small_whole_filesystem_batches")
def test_a_large_batch_syncs_its_filesystem_once_then_renames(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    entries = _batch_of(tmp_path, 4)  # 12 files
    kinds = [kind for kind, _ in events]
    # one syncfs of the cache's filesystem (every file written by then), no fsync per file;
    # then the directory fsynced (the data files were created under their names), the
    # descriptions renamed, the directory again
    assert kinds == ["filesystem", "dir"] + ["rename"] * 4 + ["dir"]
    assert events[0][1] == str(tmp_path)
    assert all(path.endswith("-description.txt") for _, path in events[-5:-1])
    for number, entry in enumerate(entries):
        arrays, problems = entry.load()
        assert problems == [] and arrays is not None
        np.testing.assert_array_equal(arrays["a"], np.arange(number + 1))


@pytest.mark.usefixtures("small_whole_filesystem_batches")
def test_a_long_batch_starts_writing_back_early_and_still_syncs_at_its_end(
    tmp_path: Path, events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.index import cache_writes

    # every 2 entries a syncfs on a thread of its own (a head start, through a descriptor of
    # its own, its errors ignored: a failing one changes nothing); the commit's own syncfs,
    # after every file is written, is what makes the batch durable
    monkeypatch.setattr(cache_writes, "EARLY_WRITEBACK_ENTRIES", 2)
    real_sync = atomic._core.sync_filesystem

    def failing_early(descriptor: int, label: str) -> int:
        return errno.EIO if label.startswith("early:") else real_sync(descriptor, label)

    monkeypatch.setattr(atomic._core, "sync_filesystem", failing_early)
    entries = _batch_of(tmp_path, 5)
    kinds = [kind for kind, _ in events]
    assert kinds[-8:] == ["filesystem", "dir"] + ["rename"] * 5 + ["dir"]
    assert events[-8][1] == str(tmp_path)
    for entry in entries:
        arrays, problems = entry.load()
        assert problems == [] and arrays is not None
    monkeypatch.setattr(atomic._core, "sync_filesystem", real_sync)
    events.clear()
    _batch_of(tmp_path / "again", 5)
    early = [label for kind, label in events if kind == "filesystem" and label.startswith("early")]
    assert early == [f"early:{tmp_path / 'again'}"] * 2


@pytest.mark.usefixtures("small_whole_filesystem_batches")
def test_a_large_batch_fsyncs_each_file_when_much_else_is_dirty(
    tmp_path: Path, events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a syncfs would also write back a stranger's gigabytes: each file is fsynced instead
    monkeypatch.setattr(atomic, "_dirty_bytes", lambda: 8 << 30)
    _batch_of(tmp_path, 4)
    kinds = [kind for kind, _ in events]
    assert "filesystem" not in kinds
    assert kinds == ["file"] * 8 + ["dir"] + ["file"] * 4 + ["rename"] * 4 + ["dir"]


@pytest.mark.usefixtures("small_whole_filesystem_batches")
def test_without_syncfs_a_large_batch_fsyncs_each_file(
    tmp_path: Path, events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic._core, "sync_filesystem", lambda descriptor, label: errno.ENOSYS)
    _batch_of(tmp_path, 4)
    assert [kind for kind, _ in events].count("file") == 12
    assert "filesystem" not in [kind for kind, _ in events]


@pytest.mark.usefixtures("small_whole_filesystem_batches")
def test_a_failed_syncfs_commits_nothing_and_names_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOKENMILL_FSYNC", raising=False)
    monkeypatch.setattr(atomic._core, "sync_filesystem", lambda descriptor, label: errno.EIO)
    with pytest.raises(OSError, match=rf"cannot sync the filesystem of {tmp_path}") as raised:
        _batch_of(tmp_path, 4)
    assert raised.value.errno == errno.EIO
    # no description renamed (the data may not be on disk), no temporary file left behind
    assert [name for name in os.listdir(tmp_path) if not name.endswith(".npy")] == []


def test_a_batch_holds_one_descriptor_per_directory_until_it_ends(tmp_path: Path) -> None:
    from tokenmill.index import cache_writes
    from tokenmill.index.cache import deferred_commits

    def held() -> list[str]:  # this process's descriptors on the directory itself
        found = []
        for descriptor in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        return [target for target in found if target == str(tmp_path)]

    with deferred_commits():
        for number in range(5):
            _entry(tmp_path, number).save({"a": np.arange(2), "b": np.zeros(1)})
        context = cache_writes.current_context()
        assert context is not None and context.batch is not None
        assert list(context.batch.filesystems) == [str(tmp_path)]
        assert held() == [str(tmp_path)]
    assert cache_writes.current_context() is None
    assert held() == []


def test_owner_tag_names_the_process_after_a_fork() -> None:
    import multiprocessing

    from tokenmill.common.owner import owner_tag

    parent = owner_tag()
    assert parent.endswith(f"-{os.getpid()}") and owner_tag() == parent
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child, child_pid = pool.apply(_tag_and_pid)
    assert child == parent.rsplit("-", 1)[0] + f"-{child_pid}" and child_pid != os.getpid()


def _tag_and_pid() -> tuple[str, int]:
    from tokenmill.common.owner import owner_tag

    return owner_tag(), os.getpid()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype=np.int32),
        np.arange(12, dtype=np.int64).reshape(6, 2),
        np.empty(0, dtype=np.uint32),
        np.arange(9, dtype=np.uint16)[::2],  # not contiguous: written as its contiguous copy
        np.zeros((0, 2), dtype=np.int64),
    ],
    ids=["int32", "int64-2d", "empty", "strided", "empty-2d"],
)
def test_cache_arrays_hold_the_bytes_numpy_save_writes(tmp_path: Path, array: np.ndarray) -> None:
    from tokenmill.index.cache_writes import atomic_save_npy

    atomic_save_npy(tmp_path / "ours.npy", array)
    np.save(tmp_path / "numpy.npy", np.ascontiguousarray(array), allow_pickle=False)
    assert (tmp_path / "ours.npy").read_bytes() == (tmp_path / "numpy.npy").read_bytes()
    np.testing.assert_array_equal(np.load(tmp_path / "ours.npy"), array)


def test_written_file_is_invisible_until_committed_and_named_for_its_owner(
    tmp_path: Path,
) -> None:
    from tokenmill.common import owner

    written = atomic.WrittenFile(tmp_path / "entry.npy", (b"abc", memoryview(b"def")))
    assert os.listdir(tmp_path) == [os.path.basename(written.temporary_path)]
    name = os.path.basename(written.temporary_path)
    assert name.startswith(f".entry.npy.{owner.owner_tag()}.") and name.endswith(".tmp")
    # the cleaner's rules apply to it: a live writer's file (this process) is never abandoned
    assert not owner.is_abandoned(name, os.stat(written.temporary_path).st_mtime)
    assert written.status.st_size == 6
    atomic.commit_together([written])
    assert os.listdir(tmp_path) == ["entry.npy"]
    assert (tmp_path / "entry.npy").read_bytes() == b"abcdef"


def test_written_file_abort_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = atomic.WrittenFile(tmp_path / "a.txt", (b"x",))
    written.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match=r"directory of .* does not exist: .*missing"):
        atomic.WrittenFile(tmp_path / "missing" / "a.txt", (b"x",))
    # a temporary name left by an earlier process with the same pid is skipped, not reused
    monkeypatch.setattr(atomic, "_TEMPORARY_NUMBERS", itertools.count(7))
    from tokenmill.common.owner import owner_tag

    stale = tmp_path / f".b.txt.{owner_tag()}.7.tmp"
    stale.write_bytes(b"old")
    written = atomic.WrittenFile(tmp_path / "b.txt", (b"new",))
    assert written.temporary_path.endswith(".8.tmp")
    assert stale.read_bytes() == b"old"
    # ... and a background write aborted before it was waited for leaves that name alone too
    monkeypatch.setattr(atomic, "_TEMPORARY_NUMBERS", itertools.count(7))
    atomic.WrittenFile(tmp_path / "b.txt", (b"new",), background=True).abort()
    assert stale.read_bytes() == b"old"

    # a failed write (disk full) leaves nothing behind and reports the error, again on a second
    # look (a background write's error is raised when it is waited for)
    _testing.inject_file_fault("write", 1, errno.ENOSPC)
    with pytest.raises(ResourceLimitError, match=r"cannot write .*c\.txt.*filesystem is full"):
        atomic.WrittenFile(tmp_path / "c.txt", (b"data",))
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".c.txt")]
    _testing.inject_file_fault("write", 2, errno.ENOSPC)
    background = atomic.WrittenFile(tmp_path / "e.txt", (b"da", b"ta"), background=True)
    for _ in range(2):
        with pytest.raises(ResourceLimitError, match=r"cannot write .*e\.txt.*filesystem is full"):
            background.finish()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".e.txt")]
    # out of descriptors when creating it: named as the limit, never taken for a bad file
    _testing.inject_file_fault("create", 1, errno.EMFILE)
    with pytest.raises(ResourceLimitError, match=r"cannot create .*d\.txt.*ulimit -n"):
        atomic.WrittenFile(tmp_path / "d.txt", (b"data",))
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".d.txt")]


def test_written_files_together_in_place_or_beside_their_names(
    tmp_path: Path, events: list[tuple[str, str]]
) -> None:
    (tmp_path / "taken.bin").write_bytes(b"old")
    placed, beside, taken = atomic.WrittenFile.together(
        [
            (tmp_path / "placed.bin", (b"p",)),
            (tmp_path / "beside.bin", (b"b",)),
            (tmp_path / "taken.bin", (b"new",)),
        ],
        in_place=[True, False, True],
    )
    for file in (placed, beside, taken):
        file.finish()
    # in place: under its final name at once; an existing name: a temporary file beside it
    assert placed.temporary_path == str(tmp_path / "placed.bin")
    assert (tmp_path / "placed.bin").read_bytes() == b"p"
    assert beside.temporary_path.endswith(".tmp") and taken.temporary_path.endswith(".tmp")
    assert (tmp_path / "taken.bin").read_bytes() == b"old"
    atomic.commit_together([placed, beside, taken])
    assert [path for kind, path in events if kind == "rename"] == [
        str(tmp_path / "beside.bin"),
        str(tmp_path / "taken.bin"),
    ]
    assert sorted(os.listdir(tmp_path)) == ["beside.bin", "placed.bin", "taken.bin"]
    assert (tmp_path / "taken.bin").read_bytes() == b"new"


def test_an_aborted_in_place_file_is_left_for_the_next_writer(tmp_path: Path) -> None:
    # a racing writer may have renamed its committed file over the name: never removed
    (file,) = atomic.WrittenFile.together([(tmp_path / "a.npy", (b"half",))], in_place=[True])
    file.finish()
    file.abort()
    assert (tmp_path / "a.npy").read_bytes() == b"half"


def test_a_batch_belongs_to_its_build_and_another_thread_commits_at_once(tmp_path: Path) -> None:
    """The batch of deferred commits lives in the build's context (contextvars), not in the
    process: while one thread holds a batch open, another thread's save commits its entry before
    returning (on main it returned with no description committed)."""
    import threading

    from tokenmill.index.cache import deferred_commits

    arrays = {"a": np.arange(2), "b": np.zeros(1)}
    saved_elsewhere: list[bool] = []

    def other_thread() -> None:
        entry = _entry(tmp_path / "other", 1)
        entry.save(arrays)
        saved_elsewhere.append(entry.description_path.is_file())

    batched = _entry(tmp_path / "batch", 0)
    with deferred_commits():
        batched.save(arrays)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert saved_elsewhere == [True]  # committed when its save returned
        assert not batched.description_path.exists()  # this batch commits at its end
    assert batched.description_path.is_file()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="ab/.", max_size=12), max_size=8))
def test_the_directories_of_a_commit_are_those_of_dirname(paths: list[str]) -> None:
    """The commit's directories (computed once per directory, not per file) are
    ``abspath(dirname(path))`` of each path, whatever slashes and dots it holds."""
    expected = {os.path.abspath(os.path.dirname(path) or os.curdir) for path in paths}
    assert atomic._directories(paths) == expected
