"""The background file writer (csrc/file_writer.hpp, `tokenmill._core.FileWriter`): bytes, errors
as values, tickets, buffer lifetimes, threads, fork; and the cold blend build that uses it."""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill._core import FileWriter, _testing

CREATE, WRITE, OPEN, NOT_REGULAR = 1, 2, 4, 6


@pytest.fixture(params=[0, 1, 4], ids=["in-line", "1-thread", "4-threads"])
def writer(request: pytest.FixtureRequest) -> FileWriter:
    return FileWriter(request.param)


def test_writes_the_chunks_in_order_and_reports_the_files_status(
    writer: FileWriter, tmp_path: Path
) -> None:
    array = np.arange(1000, dtype=np.int64).reshape(500, 2)
    path = tmp_path / "file"
    error, step, size, inode, mtime_ns, ctime_ns, generation = writer.wait(
        writer.submit_write(str(path), [b"head", memoryview(b"er"), array, b""])
    )
    assert (error, step) == (0, 0)
    assert path.read_bytes() == b"header" + array.tobytes()
    assert (size, inode, mtime_ns, ctime_ns, generation) == _status_of(path)


def _status_of(path: Path) -> tuple[int, int, int, int, int]:
    """(size, inode, mtime_ns, ctime_ns, generation) of `path`, as the kernel reports them."""
    status = path.stat()
    return (
        status.st_size,
        status.st_ino,
        status.st_mtime_ns,
        status.st_ctime_ns,
        _generation_of(path),
    )


def _generation_of(path: Path) -> int:
    """The inode generation, as Python reads it (FS_IOC_GETVERSION: an int at the buffer's
    start); -1 where the filesystem reports none."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        buffer = fcntl.ioctl(descriptor, 0x80087601, bytes(8))  # FS_IOC_GETVERSION
    except OSError:
        return -1
    finally:
        os.close(descriptor)
    return int.from_bytes(buffer[:4], sys.byteorder)


def test_inode_generation_is_the_kernels_or_minus_one(tmp_path: Path) -> None:
    from tokenmill import _core

    path = tmp_path / "file"
    path.write_bytes(b"x")
    descriptor = os.open(path, os.O_RDONLY)
    try:
        assert _core.inode_generation(descriptor) == _generation_of(path)
    finally:
        os.close(descriptor)
    read, write = os.pipe()  # no filesystem generation for a pipe
    try:
        assert _core.inode_generation(read) == -1
    finally:
        os.close(read)
        os.close(write)
    assert _core.inode_generation(10**6) == -1  # not a descriptor: unknown, never a crash


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=3000), limit=st.integers(0, 3000))
def test_read_small_file_reads_the_whole_file_with_its_status(
    tmp_path_factory: pytest.TempPathFactory, content: bytes, limit: int
) -> None:
    """The one-call read of the warm path: the bytes of the whole file when it is at most
    `limit` bytes (None above), and the fstat of the descriptor it read them through."""
    from tokenmill import _core

    path = tmp_path_factory.mktemp("read") / "file"
    path.write_bytes(content)
    error, step, data, size, inode, mtime_ns, ctime_ns, generation = _core.read_small_file(
        str(path), limit, True
    )
    assert (error, step) == (0, 0)
    assert data == (content if len(content) <= limit else None)
    assert (size, inode, mtime_ns, ctime_ns, generation) == _status_of(path)
    assert _core.read_small_file(str(path), limit)[7] == -1  # the ioctl only when asked


def test_read_small_file_reports_errors_as_values(tmp_path: Path) -> None:
    from tokenmill import _core

    missing = _core.read_small_file(str(tmp_path / "missing"), 100)
    assert missing[:3] == (errno.ENOENT, OPEN, None)
    # a directory opens, and fstat refuses it before any read (step 6: not a regular file)
    directory = _core.read_small_file(str(tmp_path), 1 << 20)
    assert directory[:3] == (errno.EISDIR, NOT_REGULAR, None)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked"
        locked.write_bytes(b"x")
        locked.chmod(0)
        assert _core.read_small_file(str(locked), 100)[:2] == (errno.EACCES, OPEN)


def test_read_small_file_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    """A FIFO planted where a data or cache file is expected is opened without blocking
    (O_NONBLOCK) and refused after fstat; before, the open waited forever for a writer. Run in a
    child so that a blocking open fails the test by its timeout instead of hanging the run."""
    fifo = tmp_path / "planted.idx"
    os.mkfifo(fifo)
    script = (
        "import sys\nfrom tokenmill import _core\n"
        "print(_core.read_small_file(sys.argv[1], 100, False, True)[:3])"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(fifo)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.strip() == str((errno.EINVAL, NOT_REGULAR, None))
    from tokenmill.common.whole_read import NotARegularFile, read_whole

    with pytest.raises(NotARegularFile, match="is a FIFO, not a regular file") as raised:
        read_whole(str(fifo), 100)
    assert raised.value.filename == str(fifo)


def test_read_small_file_sees_a_file_longer_than_its_status(tmp_path: Path) -> None:
    """The read asks for one byte more than fstat reported: a file that grew between the two
    shows as longer than its size (readers refuse it), never silently cut. /proc files report
    size 0 and hold more."""
    from tokenmill import _core

    error, _, data, size, *_ = _core.read_small_file("/proc/self/stat", 100)
    assert error == 0 and size == 0
    assert data is not None and len(data) == 1


def test_errors_are_outcomes_naming_the_step(writer: FileWriter, tmp_path: Path) -> None:
    (tmp_path / "taken").write_bytes(b"old")
    assert writer.wait(writer.submit_write(str(tmp_path / "taken"), [b"new"]))[:2] == (
        errno.EEXIST,
        CREATE,
    )
    assert (tmp_path / "taken").read_bytes() == b"old"  # O_EXCL: never overwritten
    missing = str(tmp_path / "no" / "file")
    assert writer.wait(writer.submit_write(missing, [b"x"]))[:2] == (errno.ENOENT, CREATE)
    assert writer.sync_all([str(tmp_path / "taken"), missing]) == [(0, 0), (errno.ENOENT, OPEN)]
    # write and fsync in one job; the fsync's failure is its own step
    synced = writer.wait(writer.submit_write(str(tmp_path / "synced"), [b"abc"], True))
    assert synced[:3] == (0, 0, 3) and (tmp_path / "synced").read_bytes() == b"abc"
    _testing.inject_file_fault("write", 2, errno.ENOSPC)
    try:
        outcome = writer.wait(writer.submit_write(str(tmp_path / "full"), [b"a", b"b", b"c"]))
    finally:
        _testing.inject_file_fault("write", 0)
    assert outcome[:2] == (errno.ENOSPC, WRITE)
    assert (tmp_path / "full").read_bytes() == b"a"  # the caller removes what a failure left


def test_bad_arguments_and_tickets(tmp_path: Path) -> None:
    writer = FileWriter(2)
    with pytest.raises(TypeError, match="buffer protocol, got int"):
        writer.submit_write(str(tmp_path / "a"), [1])
    with pytest.raises(ValueError, match="not C-contiguous"):
        writer.submit_write(str(tmp_path / "a"), [np.arange(10)[::2]])
    assert not (tmp_path / "a").exists()  # nothing was submitted
    ticket = writer.submit_write(str(tmp_path / "b"), [b"x"])
    writer.wait(ticket)
    with pytest.raises(ValueError, match="already waited-for ticket"):
        writer.wait(ticket)
    with pytest.raises(ValueError, match="unknown"):
        writer.wait(10**6)
    with pytest.raises(ValueError, match="threads must be >= 0"):
        FileWriter(-1)


_TWO_WAITERS = """
import json, os, sys, threading, time
from tokenmill._core import FileWriter

fifo = sys.argv[1]
os.mkfifo(fifo)
writer = FileWriter(1)
ticket = writer.submit_sync(fifo)  # its worker blocks opening the FIFO until a writer opens it
start = threading.Barrier(2)
results = []

def wait():
    start.wait()
    try:
        results.append(["outcome", list(writer.wait(ticket))])
    except Exception as error:
        results.append([type(error).__name__, str(error)])

threads = [threading.Thread(target=wait) for _ in range(2)]
for thread in threads:
    thread.start()
time.sleep(0.5)  # not a measurement: lets both threads reach wait() while the job is stuck
os.close(os.open(fifo, os.O_WRONLY))  # the job goes on (fsync of a FIFO fails: an outcome)
for thread in threads:
    thread.join()
print(json.dumps(results))
"""


def test_two_threads_waiting_on_one_ticket_one_gets_a_value_error(tmp_path: Path) -> None:
    """Two threads wait on one ticket while its job runs: one gets the outcome, the other a
    ValueError (before the fix, both waited and the second, woken after the first had taken and
    erased the outcome, dereferenced the missing entry: a segfault). In a child process, so a
    crash fails this test rather than the test run."""
    result = subprocess.run(
        [sys.executable, "-c", _TWO_WAITERS, str(tmp_path / "fifo")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    results = sorted(json.loads(result.stdout), key=lambda pair: pair[0])
    assert [kind for kind, _ in results] == ["ValueError", "outcome"], results
    assert "already" in results[0][1], results
    error, step = results[1][1][:2]
    assert error == errno.EINVAL and step == 5  # fsync(2) of a FIFO: the job's own outcome


def test_the_writer_keeps_the_bytes_alive_until_waited_for(tmp_path: Path) -> None:
    writer = FileWriter(1)
    tickets = []
    for number in range(200):
        array = np.full(4096, number, dtype=np.int32)
        tickets.append(writer.submit_write(str(tmp_path / f"f{number}"), [array]))
        del array  # only the writer's view holds it now
    gc.collect()
    for number, ticket in enumerate(tickets):
        assert writer.wait(ticket)[0] == 0
        np.testing.assert_array_equal(
            np.fromfile(tmp_path / f"f{number}", dtype=np.int32), np.full(4096, number)
        )
    # a writer dropped with jobs in flight finishes them first
    late = FileWriter(2)
    for number in range(50):
        late.submit_write(str(tmp_path / f"late{number}"), [np.full(10, number, np.int16)])
    del late
    gc.collect()
    assert all((tmp_path / f"late{n}").stat().st_size == 20 for n in range(50))


def test_many_python_threads_share_one_writer(tmp_path: Path) -> None:
    writer = FileWriter(3)
    failures: list[str] = []

    def work(number: int) -> None:
        for index in range(100):
            name = tmp_path / f"t{number}-{index}"
            data = f"{number}-{index}".encode()
            if writer.wait(writer.submit_write(str(name), [data]))[0] != 0:
                failures.append(str(name))
            elif name.read_bytes() != data:
                failures.append(f"{name}: wrong bytes")

    threads = [threading.Thread(target=work, args=(number,)) for number in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(os.listdir(tmp_path)) == 600


def test_no_thread_can_start_then_jobs_run_in_line(tmp_path: Path) -> None:
    _testing.fail_file_writer_threads(True)
    try:
        writer = FileWriter(4)
        assert writer.wait(writer.submit_write(str(tmp_path / "a"), [b"x"]))[0] == 0
    finally:
        _testing.fail_file_writer_threads(False)
    assert (tmp_path / "a").read_bytes() == b"x"


_FORKED: list[FileWriter] = []  # the parent's writer, inherited by a forked child


def _write_in_child(path: str) -> int:
    writer = _FORKED[0]
    return writer.wait(writer.submit_write(path, [b"child"]))[0]


def test_a_forked_child_writes_in_line(tmp_path: Path) -> None:
    writer = FileWriter(2)
    writer.wait(writer.submit_write(str(tmp_path / "parent"), [b"parent"]))  # workers started
    _FORKED[:] = [writer]
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_write_in_child, (str(tmp_path / "child"),)) == 0
    finally:
        _FORKED.clear()
    assert (tmp_path / "child").read_bytes() == b"child"
    assert writer.wait(writer.submit_write(str(tmp_path / "again"), [b"x"]))[0] == 0


def _drop_the_parents_writer_then_commit(path: str) -> bytes:
    from tokenmill.common import atomic

    _FORKED.clear()  # the parent's writer is destroyed in the child: no wait for its threads
    gc.collect()
    atomic.WrittenFile(path, (b"from the child",)).commit()
    return Path(path).read_bytes()


def test_a_forked_child_drops_its_parents_writers_and_makes_its_own(tmp_path: Path) -> None:
    from tokenmill.common import atomic

    writer = FileWriter(4)
    atomic.WrittenFile(tmp_path / "parent", (b"x",)).commit()  # the module's writers started
    for number in range(64):  # the parent's workers busy at the fork
        writer.submit_write(str(tmp_path / f"busy{number}"), [b"y" * 100_000])
    _FORKED[:] = [writer]
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            result = pool.apply_async(
                _drop_the_parents_writer_then_commit, (str(tmp_path / "child"),)
            )
            assert result.get(timeout=60) == b"from the child"
    finally:
        _FORKED.clear()


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.binary(max_size=300), max_size=6),
    threads=st.integers(0, 3),
)
def test_any_chunks_round_trip(
    tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes], threads: int
) -> None:
    directory = tmp_path_factory.mktemp("chunks")
    writer = FileWriter(threads)
    outcome = writer.wait(writer.submit_write(str(directory / "f"), list(chunks)))
    assert outcome[0] == 0 and outcome[2] == sum(map(len, chunks))
    assert (directory / "f").read_bytes() == b"".join(chunks)
