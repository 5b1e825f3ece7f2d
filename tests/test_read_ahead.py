"""The read ahead of data files (csrc/read_ahead.hpp, `tokenmill.common.whole_read.reading_ahead`):
what it returns is what a read of one's own returns, each result once, in any order, and a
failed read raises when the file is asked for, as it would without it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_jobs import build_datasets, committed_files, samples_digest, write_shards
from tokenmill import _core
from tokenmill.common import whole_read
from tokenmill.common.whole_read import NotARegularFile, read_whole, reading_ahead
from tokenmill.datasets.gpt import GPTDataset
from tokenmill.index import fingerprint

LIMIT = 1 << 16
SAMPLE = fingerprint.SAMPLE_BYTES


def _write(path: Path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def _same_status(found: whole_read.FileStatus, path: Path) -> None:
    status = os.stat(path)
    assert (found.st_size, found.st_ino, found.st_mtime_ns, found.st_ctime_ns) == (
        status.st_size,
        status.st_ino,
        status.st_mtime_ns,
        status.st_ctime_ns,
    )


@pytest.mark.parametrize("size", [0, 1, SAMPLE - 1, SAMPLE, 2 * SAMPLE + 1, 40_042, LIMIT])
def test_a_file_read_ahead_whole_is_its_bytes_and_status(tmp_path: Path, size: int) -> None:
    path = tmp_path / "a.idx"
    data = _write(path, size)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        contents, status = read_whole(str(path), LIMIT, ahead=True)
    assert isinstance(contents, _core.OwnedBuffer)  # taken from the read ahead, not read again
    assert len(contents) == size and bytes(memoryview(contents)) == data
    assert np.array_equal(np.frombuffer(contents, dtype=np.uint8), np.frombuffer(data, np.uint8))
    _same_status(status, path)


def test_a_file_over_the_limit_is_left_to_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "big.idx"
    _write(path, LIMIT + 1)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        contents, status = read_whole(str(path), LIMIT, keep_open=True, ahead=True)
    assert isinstance(contents, int)  # the reader's own open, kept for it to map
    os.close(contents)
    assert status.st_size == LIMIT + 1


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3 * SAMPLE + 7))
def test_a_sampled_read_ahead_gives_the_same_fingerprint(tmp_path_factory, size: int) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("sampled") / "a.bin"
    _write(path, size, seed=size)
    alone = fingerprint.fingerprint_file(path)
    with reading_ahead([(str(path), False)], LIMIT, SAMPLE):
        ahead = whole_read._AHEAD.get()
        assert ahead is not None and str(path) in ahead.sampled
        found = fingerprint.fingerprint_file(path)
        assert str(path) not in ahead.sampled  # it was taken from the read ahead
    assert found == alone


def test_each_result_is_taken_once(tmp_path: Path) -> None:
    path = tmp_path / "a.idx"
    before = _write(path, 1000, seed=1)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        first, _ = read_whole(str(path), LIMIT, ahead=True)
        after = _write(path, 1000, seed=2)
        second, _ = read_whole(str(path), LIMIT, ahead=True)  # read again: the file as it is now
    assert bytes(memoryview(first)) == before and isinstance(second, bytes) and second == after


def test_other_limits_sizes_and_paths_are_read_as_usual(tmp_path: Path) -> None:
    path, other = tmp_path / "a.idx", tmp_path / "b.idx"
    data, more = _write(path, 100), _write(other, 100, seed=3)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        assert read_whole(str(other), LIMIT, ahead=True)[0] == more  # not named
        assert read_whole(str(path), LIMIT - 1, ahead=True)[0] == data  # read with another limit
        assert whole_read.sampled_ahead(str(path), SAMPLE) is None  # named whole, not sampled
    with reading_ahead([(str(path), False)], LIMIT, SAMPLE):
        assert whole_read.sampled_ahead(str(path), SAMPLE // 2) is None  # another sample size


def test_takes_in_any_order_never_wait_for_the_window(tmp_path: Path) -> None:
    """More requests than the reader may keep ahead, taken last first: a take of a request the
    worker has not reached reads it on the taker's thread (no wait on the window)."""
    count = 3 * whole_read._MAX_PENDING
    paths = [tmp_path / f"{number}.idx" for number in range(count)]
    contents = [_write(path, 64 + number, seed=number) for number, path in enumerate(paths)]
    found: dict[int, bytes] = {}

    def take_all() -> None:
        with reading_ahead([(str(path), True) for path in paths], LIMIT, SAMPLE):
            for number in reversed(range(count)):
                data, _ = read_whole(str(paths[number]), LIMIT, ahead=True)
                found[number] = bytes(memoryview(data))

    taker = threading.Thread(target=take_all, daemon=True)
    taker.start()
    taker.join(60)
    assert not taker.is_alive(), "a take waited for the read ahead's window"
    assert found == dict(enumerate(contents))


def test_a_failed_read_ahead_raises_when_the_file_is_asked_for(tmp_path: Path) -> None:
    missing, fifo = tmp_path / "missing.idx", tmp_path / "fifo.idx"
    os.mkfifo(fifo)
    with reading_ahead([(str(missing), True), (str(fifo), True)], LIMIT, SAMPLE):
        with pytest.raises(FileNotFoundError) as error:
            read_whole(str(missing), LIMIT, ahead=True)
        assert error.value.filename == str(missing)
        with pytest.raises(NotARegularFile, match="FIFO"):
            read_whole(str(fifo), LIMIT, ahead=True)
    with reading_ahead([(str(missing), False)], LIMIT, SAMPLE), pytest.raises(FileNotFoundError):
        fingerprint.fingerprint_file(missing)


def test_the_core_reader_takes_once_and_refuses_unknown_requests(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    data = _write(path, 3 * SAMPLE)
    reader = _core.ReadAhead([(str(path), False, 0, SAMPLE)], 4, 1 << 20)
    error, step, sampled, head, size, *_ = reader.take(0)
    assert (error, step, head, size) == (0, 0, SAMPLE, 3 * SAMPLE)
    assert bytes(memoryview(sampled)) == data[:SAMPLE] + data[-SAMPLE:]
    assert reader.take(0) is None and reader.take(1) is None and len(reader) == 1


def test_a_forked_child_reads_for_itself(tmp_path: Path) -> None:
    """A forked child has a copy of the reader but not its thread: it reads the file itself."""
    path = tmp_path / "a.idx"
    data = _write(path, 5000)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        child = os.fork()
        if child == 0:
            try:
                contents, _ = read_whole(str(path), LIMIT, ahead=True)
                os._exit(0 if contents == data and isinstance(contents, bytes) else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(child, 0)
        taken, _ = read_whole(str(path), LIMIT, ahead=True)  # still the parent's to take
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(memoryview(taken)) == data


def test_a_cold_blend_build_takes_every_source_from_the_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each source's .idx and the .bin's fingerprint come from the read ahead (no read of the
    builder's own), and the entries and samples are those of a build without it."""
    (tmp_path / "data").mkdir()
    shards = write_shards(tmp_path / "data")
    read_here: list[str] = []
    real_read = whole_read._core.read_small_file

    def counted(path: str, *rest: object) -> object:
        read_here.append(path)
        return real_read(path, *rest)

    monkeypatch.setattr(whole_read._core, "read_small_file", counted)
    sampled_here: list[str] = []
    real_open = fingerprint.os.open

    def counted_open(path: str, *rest: object) -> int:
        sampled_here.append(os.fspath(path))
        return real_open(path, *rest)

    monkeypatch.setattr(fingerprint.os, "open", counted_open)
    ahead = build_datasets(shards, str(tmp_path / "ahead"), 5, "global")
    assert not [path for path in read_here if path.endswith(".idx")]
    assert not [path for path in sampled_here if path.endswith(".bin")]
    monkeypatch.setattr(GPTDataset, "_files_read_ahead", staticmethod(lambda *_: []))
    alone = build_datasets(shards, str(tmp_path / "alone"), 5, "global")
    assert [path for path in read_here if path.endswith(".idx")]  # the count can fail
    assert samples_digest(ahead) == samples_digest(alone)

    def arrays(cache: Path) -> dict[str, bytes]:
        names = [name for name in committed_files(cache) if not name.endswith(".json")]
        assert len(names) >= 8  # the arrays and descriptions of both splits' entries
        return {os.path.basename(name): (cache / name).read_bytes() for name in names}

    assert arrays(tmp_path / "ahead") == arrays(tmp_path / "alone")


def test_results_nobody_takes_do_not_stop_the_read_ahead(tmp_path: Path) -> None:
    """A warm open takes each .idx and never the .bin read ahead beside it (a hit needs no
    fingerprint): those are passed over and freed, and the worker keeps reading ahead for every
    source, well past its window (it stopped after 64 before: untaken results filled it)."""
    import time

    count = 4 * whole_read._MAX_PENDING
    requests: list[tuple[str, bool, int, int]] = []
    for number in range(count):
        for suffix, whole in ((".idx", True), (".bin", False)):
            path = tmp_path / f"{number}{suffix}"
            _write(path, 100, seed=number)
            requests.append((str(path), whole, LIMIT, SAMPLE))
    reader = _core.ReadAhead(requests, whole_read._MAX_PENDING, 1 << 26)
    for number in range(count):
        deadline = time.monotonic() + 5
        while reader.read_by_worker < min(2 * number + 2, len(requests)):
            assert time.monotonic() < deadline, f"the worker stopped at {reader.read_by_worker}"
            time.sleep(0.0005)
        found = reader.take(2 * number)
        assert (
            found is not None
            and bytes(memoryview(found[2])) == Path(requests[2 * number][0]).read_bytes()
        )
    assert reader.read_by_worker == len(requests)
    # a result passed over is gone; one within the slack is not
    reader = _core.ReadAhead(
        [(str(path), True, LIMIT, 0) for path, *_ in requests[:40]], 8, 1 << 20
    )
    assert reader.take(39) is not None
    assert reader.take(0) is None  # far behind the take of 39
    assert reader.take(38) is not None  # just behind it


def test_only_a_reader_that_asks_takes_a_read_ahead(tmp_path: Path) -> None:
    """Callers that do not ask (`ahead`) get bytes, read as usual, and leave the read ahead's
    result for the one that asks."""
    path = tmp_path / "a.idx"
    data = _write(path, 300)
    with reading_ahead([(str(path), True)], LIMIT, SAMPLE):
        plain, _ = read_whole(str(path), LIMIT)
        taken, _ = read_whole(str(path), LIMIT, ahead=True)
    assert isinstance(plain, bytes) and plain == data
    assert isinstance(taken, _core.OwnedBuffer) and bytes(memoryview(taken)) == data


def test_a_rank_that_trusts_the_builders_reads_no_bin_ahead(tmp_path: Path) -> None:
    """A rank that does not build trusts the builders' check of the data: it fingerprints no
    .bin, so none is read ahead for it (five system calls per source for nothing)."""
    from rank_jobs import _config
    from tokenmill.index.cache import encode_evidence, trusting_builder

    prefix = str(tmp_path / "shard")
    config = _config([prefix] * 3, str(tmp_path / "cache"), 1, "global")  # its 3 weights
    assert GPTDataset._files_read_ahead(prefix, config) == [
        (prefix + ".idx", True),
        (prefix + ".bin", False),
    ]
    with trusting_builder(encode_evidence({})):
        assert GPTDataset._files_read_ahead(prefix, config) == [(prefix + ".idx", True)]
