"""Stale data: a `.bin/.idx` replaced behind a cached index is detected by its fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.errors import CacheError, DataFormatError, StaleCacheError
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.index import fingerprint

from conftest import TinyTokenizer, random_documents, write_megatron_shard

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")


def make_config(cache: Path, **fields: Any) -> GPTDatasetConfig:
    values: dict[str, Any] = {
        "random_seed": 5,
        "sequence_length": 40,
        "tokenizer": TinyTokenizer(),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
        "path_to_cache": str(cache),
    }
    values.update(fields)
    return GPTDatasetConfig(**values)


def build(shard: str, config: GPTDatasetConfig, num_samples: int = 300) -> GPTDataset:
    low_level = IndexedDataset(shard)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, shard, indices, num_samples, Split.train, config)


def arrays(dataset: GPTDataset) -> list[np.ndarray]:
    return [
        np.array(dataset.document_index),
        np.array(dataset.sample_index),
        np.array(dataset.shuffle_index),
    ]


def assert_same_arrays(first: GPTDataset, second: GPTDataset) -> None:
    for a, b in zip(arrays(first), arrays(second)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def retokenize(shard: str, seed: int, count: int = 200, same_lengths: bool = False) -> None:
    """Replace the shard's .bin/.idx in place with different documents (a new tokenization),
    optionally with the same document lengths (then every index array keeps its shape)."""
    stat = os.stat(shard + ".idx")
    rng = np.random.default_rng(seed)
    if same_lengths:
        lengths = IndexedDataset(shard).sequence_lengths.tolist()
        documents = [[*rng.integers(1, 1000, n - 1).tolist(), 0] for n in lengths]
    else:
        documents = random_documents(rng, count)
    write_megatron_shard(shard, documents)
    # make the mtime move even on filesystems with coarse timestamps, past every file written
    # so far (the cache entry's description included)
    later = max(stat.st_mtime_ns, time.time_ns()) + 10**9
    for suffix in (".bin", ".idx"):
        os.utime(shard + suffix, ns=(later, later))


def fresh_reference(shard: str, tmp_path: Path) -> GPTDataset:
    return build(shard, make_config(tmp_path / "reference", cache_data_check="off"))


def test_replaced_data_is_rebuilt_by_default(
    shard: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path / "cache")
    old = build(shard, config)
    retokenize(shard, seed=99, count=180)
    with caplog.at_level(logging.WARNING, logger="tokenmill.index.cache"):
        new = build(shard, config)
    assert "rebuilding stale index cache" in caplog.text
    assert f"{shard}.idx: size was" in caplog.text
    assert not all(np.array_equal(a, b) for a, b in zip(arrays(old), arrays(new)))
    assert_same_arrays(new, fresh_reference(shard, tmp_path))
    # the rebuilt entry records the new data, so the next run is a plain hit
    recorded = fingerprint.read_fingerprint(new._cache.fingerprint_path)  # type: ignore[union-attr]
    assert recorded is not None
    vouched = recorded.pop("arrays")  # the checked array files, by size, mtime and inode
    assert recorded == fingerprint.fingerprint_prefixes([shard])
    assert set(vouched) == {"document_index", "sample_index", "shuffle_index"}


def test_replaced_data_is_an_error_with_policy_error(shard: str, tmp_path: Path) -> None:
    config = make_config(tmp_path / "cache", cache_data_check="error")
    build(shard, config)
    retokenize(shard, seed=99)
    with pytest.raises(StaleCacheError, match=rf"{shard}\.bin: mtime_ns was \d+, now \d+"):
        build(shard, config)


def test_replaced_data_is_an_error_on_ranks_that_do_not_build(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path / "cache")
    build(shard, config)
    retokenize(shard, seed=99)
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
    with pytest.raises(StaleCacheError, match="built from different data"):
        build(shard, config)


def test_same_size_and_mtime_but_new_contents_is_detected(shard: str, tmp_path: Path) -> None:
    """The sampled sha256 catches a rewrite that keeps the size and restores the mtime."""
    config = make_config(tmp_path / "cache", cache_data_check="error")
    build(shard, config)
    stat = os.stat(shard + ".bin")
    tokens = np.fromfile(shard + ".bin", dtype=np.uint16)
    tokens[:10] = 7
    tokens.tofile(shard + ".bin")
    os.utime(shard + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(shard + ".bin").st_size == stat.st_size
    with pytest.raises(StaleCacheError, match=rf"{shard}\.bin: sample_xxh3_128 was"):
        build(shard, config)


def test_off_is_megatrons_path_only_behaviour(shard: str, tmp_path: Path) -> None:
    config = make_config(tmp_path / "cache", cache_data_check="off")
    old = build(shard, config)
    assert not list((tmp_path / "cache").glob("*.tokenmill.json"))
    retokenize(shard, seed=99, same_lengths=True)
    reused = build(shard, config)  # megatron-core silently reuses the stale entry
    assert_same_arrays(old, reused)
    assert not list((tmp_path / "cache").glob("*.tokenmill.json"))


def test_entry_without_fingerprint_is_adopted_when_data_is_older(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry megatron-core wrote (no sidecar) over unchanged data is a hit. A read adds
    nothing to its folder; only where the user asked for strict data checks
    (cache_data_check="error") does the entry get a sidecar (then fingerprints are compared)."""
    old = build(shard, make_config(tmp_path / "cache", cache_data_check="off"))
    (description,) = (tmp_path / "cache").glob("*-description.txt")
    later = os.stat(shard + ".idx").st_mtime_ns + 10**9
    os.utime(description, ns=(later, later))

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("rebuilt an entry whose data is unchanged")

    monkeypatch.setattr("tokenmill.datasets.gpt.build_gpt_indices", no_build)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert_same_arrays(old, build(shard, make_config(tmp_path / "cache")))
    assert sorted(os.listdir(tmp_path / "cache")) == files  # nothing added by a read
    adopted = build(shard, make_config(tmp_path / "cache", cache_data_check="error"))
    assert_same_arrays(old, adopted)
    (sidecar,) = (tmp_path / "cache").glob("*-GPTDataset-train-data.tokenmill.json")
    assert fingerprint.read_fingerprint(sidecar) == fingerprint.fingerprint_prefixes([shard])


_READ_CACHE = """
import hashlib, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_stale_data import build, make_config
dataset = build({shard!r}, make_config({cache!r}))
digest = hashlib.sha256()
for index in range(len(dataset)):
    digest.update(np.asarray(dataset[index]["tokens"]).tobytes())
print(digest.hexdigest())
"""


def test_a_read_only_megatron_cache_folder_is_read_and_left_as_it_was(
    shard: str, tmp_path: Path
) -> None:
    """A cache megatron built (no tokenmill sidecar), in a folder nobody may write (a read-only
    bind mount for root, permissions otherwise): a default read serves its samples and leaves
    the folder as it was."""
    import shutil
    import subprocess
    import sys

    cache = tmp_path / "cache"
    built = build(shard, make_config(cache, cache_data_check="off"))
    expected = hashlib.sha256()
    for index in range(len(built)):
        expected.update(np.asarray(built[index]["tokens"]).tobytes())
    (description,) = cache.glob("*-description.txt")
    later = os.stat(shard + ".idx").st_mtime_ns + 10**9
    os.utime(description, ns=(later, later))
    files = sorted(os.listdir(cache))
    code = _READ_CACHE.format(tests=os.path.dirname(__file__), shard=shard, cache=str(cache))
    if os.geteuid() == 0:  # root writes through permissions: mount the folder read-only
        assert shutil.which("unshare"), "unshare (util-linux) is needed to mount read-only"
        command = [
            "unshare", "-m", "sh", "-c",
            'mount --bind -o ro "$0" "$0" && exec "$1" -c "$2"', str(cache), sys.executable, code,
        ]  # fmt: skip
    else:
        cache.chmod(0o555)
        command = [sys.executable, "-c", code]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        cache.chmod(0o755)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == expected.hexdigest()
    assert sorted(os.listdir(cache)) == files


def test_entry_without_fingerprint_and_newer_data_is_stale(shard: str, tmp_path: Path) -> None:
    build(shard, make_config(tmp_path / "cache", cache_data_check="off"))
    retokenize(shard, seed=99)
    with pytest.raises(StaleCacheError, match="is newer than the cache entry"):
        build(shard, make_config(tmp_path / "cache", cache_data_check="error"))
    rebuilt = build(shard, make_config(tmp_path / "cache"))
    assert_same_arrays(rebuilt, fresh_reference(shard, tmp_path))


def test_corrupt_fingerprint_is_stale(shard: str, tmp_path: Path) -> None:
    config = make_config(tmp_path / "cache")
    build(shard, config)
    (sidecar,) = (tmp_path / "cache").glob("*.tokenmill.json")
    sidecar.write_text("{not json")
    with pytest.raises(StaleCacheError, match="not a JSON fingerprint"):
        build(shard, make_config(tmp_path / "cache", cache_data_check="error"))
    build(shard, config)  # rebuilt, with a valid sidecar again
    assert fingerprint.read_fingerprint(sidecar) is not None


def test_deferred_load_of_stale_data_raises(shard: str, tmp_path: Path) -> None:
    build(shard, make_config(tmp_path / "cache"))
    retokenize(shard, seed=99)
    deferred = build(shard, make_config(tmp_path / "cache", defer_npy_index_mmap=True))
    with pytest.raises(StaleCacheError, match="deferred load cannot rebuild"):
        deferred[0]


def test_blend_is_rebuilt_when_a_member_changes(tmp_path: Path) -> None:
    shards = [
        write_megatron_shard(tmp_path / f"part{i}", random_documents(np.random.default_rng(i), 60))
        for i in range(2)
    ]
    config = make_config(tmp_path / "cache", blend=(shards, None))

    def blend() -> BlendedDataset:
        members = [build(shard, config, num_samples=None) for shard in shards]  # type: ignore[arg-type]
        return BlendedDataset(members, [len(m) for m in members], None, config)

    before = blend()
    assert len(list((tmp_path / "cache").glob("*-BlendedDataset-train-data.tokenmill.json"))) == 1
    retokenize(shards[1], seed=7, count=150)
    after = blend()
    assert len(after) != len(before)
    members = [build(shard, make_config(tmp_path / "ref"), num_samples=None) for shard in shards]  # type: ignore[arg-type]
    reference = BlendedDataset(
        members, [len(m) for m in members], None, make_config(tmp_path / "ref")
    )
    np.testing.assert_array_equal(np.array(after.dataset_index), np.array(reference.dataset_index))
    np.testing.assert_array_equal(
        np.array(after.dataset_sample_index), np.array(reference.dataset_sample_index)
    )


def test_invalid_policy_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_data_check must be 'rebuild', 'error' or 'off'"):
        make_config(tmp_path, cache_data_check="sometimes")


# -- the fingerprint module ------------------------------------------------------------------


def test_fingerprint_fields_and_differences(shard: str) -> None:
    payload = fingerprint.fingerprint_prefixes([shard])
    entry = payload["datasets"][shard][".idx"]
    assert entry["size"] == os.path.getsize(shard + ".idx")
    assert entry["mtime_ns"] == os.stat(shard + ".idx").st_mtime_ns
    assert fingerprint.differences(payload, payload) == []
    changed = json.loads(json.dumps(payload))
    changed["datasets"][shard][".bin"]["size"] += 2
    assert fingerprint.differences(payload, changed) == [
        f"{shard}.bin: size was {entry_size(payload, shard)}, now {entry_size(payload, shard) + 2}"
    ]
    other = fingerprint.fingerprint_prefixes([])
    assert fingerprint.differences(payload, other) == [
        f"dataset {shard!r} is recorded but not part of this config"
    ]
    assert fingerprint.differences(other, payload) == [
        f"dataset {shard!r} has no recorded fingerprint"
    ]


def entry_size(payload: dict[str, Any], shard: str) -> int:
    return int(payload["datasets"][shard][".bin"]["size"])


def test_fingerprint_reads_both_ends_of_large_files(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    data = bytearray(3 * fingerprint.SAMPLE_BYTES)
    path.write_bytes(bytes(data))
    first = fingerprint.fingerprint_file(path)
    data[-1] = 1  # only the tail differs
    path.write_bytes(bytes(data))
    assert fingerprint.fingerprint_file(path)["sample_xxh3_128"] != first["sample_xxh3_128"]
    data[-1] = 0
    data[len(data) // 2] = 1  # the middle is not sampled
    path.write_bytes(bytes(data))
    assert fingerprint.fingerprint_file(path)["sample_xxh3_128"] == first["sample_xxh3_128"]


def test_fingerprint_round_trip_and_missing(shard: str, tmp_path: Path) -> None:
    payload = fingerprint.fingerprint_prefixes([shard])
    fingerprint.write_fingerprint(tmp_path / "f.json", payload)
    assert fingerprint.read_fingerprint(tmp_path / "f.json") == payload
    assert fingerprint.read_fingerprint(tmp_path / "absent.json") is None
    with pytest.raises(FileNotFoundError):
        fingerprint.fingerprint_prefixes([str(tmp_path / "nothing")])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\xff\xfe", "not a JSON fingerprint"),
        (b"[]", "format is 'list'"),
        (b'{"format": "other"}', "format is 'other'"),
        (b'{"format": "tokenmill.data-fingerprint", "version": 2}', "unsupported fingerprint"),
        (b'{"format": "tokenmill.data-fingerprint", "version": 1, "datasets": 3}', "'datasets'"),
        (
            b'{"format": "tokenmill.data-fingerprint", "version": 1, "datasets": {"a": {}}}',
            "dataset 'a' must map",
        ),
        (
            b'{"format": "tokenmill.data-fingerprint", "version": 1, "datasets": {"a": '
            b'{".bin": {"size": -1, "mtime_ns": 0, "sample_sha256": ""}, ".idx": 5}}}',
            "field 'size' is invalid: -1",
        ),
    ],
)
def test_malformed_fingerprint_is_a_data_format_error(
    tmp_path: Path, text: bytes, message: str
) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(text)
    with pytest.raises(DataFormatError, match=message):
        fingerprint.read_fingerprint(path)


def test_stale_error_is_a_cache_error() -> None:
    assert issubclass(StaleCacheError, CacheError)


def _counting_fingerprints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    read: list[str] = []
    real = fingerprint.fingerprint_file

    def counting(path: Any, *hashed_with: str) -> dict[str, Any]:
        read.append(os.fspath(path))
        return real(path, *hashed_with)

    monkeypatch.setattr(fingerprint, "fingerprint_file", counting)
    return read


def test_unchanged_data_is_checked_by_its_stat_alone(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Size, mtime, ctime and inode as recorded, and older than the sidecar: no read."""
    monkeypatch.setattr(fingerprint, "IDENTITY_MARGIN_NS", 0)  # the shard was written just now
    config = make_config(tmp_path / "cache", cache_data_check="error")
    first = build(shard, config)
    sidecar = json.loads(next((tmp_path / "cache").glob("*-data.tokenmill.json")).read_text())
    recorded = sidecar["datasets"][shard][".bin"]
    status = os.stat(shard + ".bin")
    assert (recorded["ctime_ns"], recorded["inode"]) == (status.st_ctime_ns, status.st_ino)
    read = _counting_fingerprints(monkeypatch)
    assert_same_arrays(first, build(shard, config))
    assert read == []


def test_data_changed_in_the_tick_of_its_fingerprint_is_hashed(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose last change is not well before the sidecar ("racy") is read and hashed:
    a second write in the same clock tick could have left the same times."""
    config = make_config(tmp_path / "cache", cache_data_check="error")
    build(shard, config)  # the shard was written moments ago: within IDENTITY_MARGIN_NS
    read = _counting_fingerprints(monkeypatch)
    build(shard, config)
    assert sorted(set(read)) == [shard + ".bin", shard + ".idx"]


def test_rewrite_that_restores_size_and_mtime_is_hashed_and_caught(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite in place moves the ctime (no user can set it back): the stat no longer vouches,
    the sampled hash is compared and the change is caught, even past the margin."""
    monkeypatch.setattr(fingerprint, "IDENTITY_MARGIN_NS", 0)
    config = make_config(tmp_path / "cache", cache_data_check="error")
    build(shard, config)
    status = os.stat(shard + ".bin")
    tokens = np.fromfile(shard + ".bin", dtype=np.uint16)
    tokens[:10] = 7
    time.sleep(0.01)  # past the filesystem's timestamp tick
    tokens.tofile(shard + ".bin")
    os.utime(shard + ".bin", ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(shard + ".bin").st_ctime_ns != status.st_ctime_ns
    with pytest.raises(StaleCacheError, match=rf"{shard}\.bin: sample_xxh3_128 was"):
        build(shard, config)


def test_sidecars_without_identity_fields_are_still_valid(shard: str, tmp_path: Path) -> None:
    """Sidecars of earlier versions (no ctime_ns / inode) are read and compared by hash."""
    config = make_config(tmp_path / "cache", cache_data_check="error")
    first = build(shard, config)
    path = next((tmp_path / "cache").glob("*-data.tokenmill.json"))
    payload = json.loads(path.read_text())
    for files in payload["datasets"].values():
        for entry in files.values():
            del entry["ctime_ns"], entry["inode"]
    path.write_text(json.dumps(payload))
    assert_same_arrays(first, build(shard, config))
    payload["datasets"][shard][".bin"]["inode"] = -1
    path.write_text(json.dumps(payload))
    with pytest.raises(DataFormatError, match=r"\.bin field 'inode' is invalid: -1"):
        fingerprint.read_fingerprint(path)


def test_a_sidecar_larger_than_any_fingerprint_is_refused(tmp_path: Path) -> None:
    """A sidecar over the size limit is not read at all (the one-call read returns no data):
    DataFormatError naming the file and its size."""
    sidecar = tmp_path / "x-GPTDataset-train-data.tokenmill.json"
    with open(sidecar, "wb") as stream:
        stream.truncate((1 << 24) + 1)  # sparse: nothing is written
    with pytest.raises(DataFormatError, match=r"data\.tokenmill\.json: 16777217 bytes, larger"):
        fingerprint.read_fingerprint(sidecar)


def _swap_middle_documents(prefix: str, into: str) -> None:
    """Write to `into` the shard at `prefix` with two documents of different lengths in the
    middle swapped: the same sizes of both files, changes only past the first and before the
    last 4 KiB of the `.idx` (its sizes and pointers there)."""
    old = IndexedDataset(prefix)
    documents = [np.asarray(old[i]).tolist() for i in range(len(old))]
    del old
    at = next(
        i
        for i in range(len(documents) // 2, len(documents))
        if len(documents[i]) != len(documents[i + 1])
    )
    documents[at], documents[at + 1] = documents[at + 1], documents[at]
    write_megatron_shard(into, documents)


def _as_older_records(cache: Path) -> None:
    """Rewrite each sidecar of `cache` as tokenmill wrote them before xxh3-128: every data
    file's record with sha256 hashes (same stat fields; the arrays' records kept)."""
    for sidecar in cache.glob("*-" + fingerprint.FINGERPRINT_SUFFIX):
        payload = json.loads(sidecar.read_text())
        for prefix, files in payload["datasets"].items():
            for suffix in files:
                files[suffix] = fingerprint.fingerprint_file(prefix + suffix, "sha256")
                assert "sample_sha256" in files[suffix]
                assert ("sha256" in files[suffix]) == (suffix == ".idx")
        sidecar.write_text(json.dumps(payload))


@pytest.mark.parametrize("records", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("how", ["in_place", "cp_p_and_rename"])
def test_an_idx_changed_in_the_middle_with_size_and_mtime_restored_is_stale(
    tmp_path: Path, how: str, records: str
) -> None:
    """The whole `.idx` is hashed (the index arrays are computed from it alone), and its ctime
    makes the stat shortcut look again: a same-size change in the middle of the `.idx` with the
    mtime put back is caught, whether rewritten in place or copied with ``cp -p`` and renamed
    over (main hashed the first and last 4 KiB and served the old arrays). Sidecars written
    before xxh3-128 (sha256 records) are hashed with sha256: a hit while the data is unchanged,
    stale once it changed."""
    import shutil

    rng = np.random.default_rng(21)
    shard = write_megatron_shard(tmp_path / "big", random_documents(rng, 3000, 20))
    assert os.path.getsize(shard + ".idx") > 6 * fingerprint.SAMPLE_BYTES
    config = make_config(tmp_path / "cache", cache_data_check="error")
    first = build(shard, config)
    if records == "sha256":
        _as_older_records(tmp_path / "cache")
        assert_same_arrays(build(shard, config), first)  # hashed with sha256: unchanged
    before = {suffix: os.stat(shard + suffix) for suffix in (".bin", ".idx")}
    time.sleep(0.01)  # past the filesystem's timestamp tick
    if how == "in_place":
        _swap_middle_documents(shard, shard)
    else:
        _swap_middle_documents(shard, str(tmp_path / "other"))
        for suffix in (".bin", ".idx"):
            shutil.copy2(tmp_path / f"other{suffix}", tmp_path / f"copy{suffix}")  # cp -p
    for suffix, status in before.items():
        path = shard + suffix if how == "in_place" else str(tmp_path / f"copy{suffix}")
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
        if how != "in_place":
            os.replace(path, shard + suffix)
        now = os.stat(shard + suffix)
        assert (now.st_size, now.st_mtime_ns) == (status.st_size, status.st_mtime_ns)
    with pytest.raises(StaleCacheError, match=rf"{shard}\.idx: {records} was"):
        build(shard, config)


def test_an_array_rewritten_in_place_with_its_mtime_restored_is_checked_again(
    shard: str, tmp_path: Path
) -> None:
    """The sidecar vouches for its arrays only while their ctime is not later than its own: an
    array file rewritten in place with size and mtime put back has its values checked (a
    shuffle that is no permutation is refused and rebuilt)."""
    config = make_config(tmp_path / "cache")
    built = build(shard, config)
    (path,) = (tmp_path / "cache").glob("*-shuffle_index.npy")
    status = os.stat(path)
    broken = np.load(path)
    broken[1] = broken[0]  # a repeated sample: not a permutation
    time.sleep(0.01)
    with open(path, "r+b") as file:  # in place: same inode
        file.seek(status.st_size - broken.nbytes)
        file.write(broken.tobytes())
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(path).st_ino == status.st_ino
    rebuilt = build(shard, config)  # the builder sees the bad values and rebuilds
    np.testing.assert_array_equal(
        np.asarray(rebuilt.shuffle_index), np.asarray(built.shuffle_index)
    )


def test_a_racy_fingerprint_is_resealed_once_its_data_is_past_the_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data fingerprinted within the margin of its last change (a cache built right after the
    data was written: tokenize then train, raw-text launches) is hashed on a later open, which
    then re-dates the sidecar (same bytes); the open after that takes one stat per file. A
    change made after the reseal is still caught."""
    monkeypatch.setattr(fingerprint, "IDENTITY_MARGIN_NS", 500_000_000)
    rng = np.random.default_rng(3)
    shard = write_megatron_shard(tmp_path / "fresh", random_documents(rng, 3000, 20))
    config = make_config(tmp_path / "cache", cache_data_check="error")
    first = build(shard, config)
    (sidecar,) = (tmp_path / "cache").glob("*-data.tokenmill.json")
    raw = sidecar.read_bytes()
    changed = max(os.stat(shard + suffix).st_ctime_ns for suffix in (".bin", ".idx"))
    os.utime(sidecar, ns=(changed, changed + 1))  # dated within the margin: racy, whatever the load
    while time.time_ns() <= changed + fingerprint.IDENTITY_MARGIN_NS + 10_000_000:
        time.sleep(0.05)
    read = _counting_fingerprints(monkeypatch)
    assert_same_arrays(first, build(shard, config))
    assert sorted(set(read)) == [shard + ".bin", shard + ".idx"]  # hashed, then resealed
    assert sidecar.read_bytes() == raw  # the entry digest ranks compare is unchanged
    assert os.stat(sidecar).st_mtime_ns > changed + fingerprint.IDENTITY_MARGIN_NS
    read.clear()
    assert_same_arrays(first, build(shard, config))
    assert read == []  # proven by stat alone from now on
    before = {suffix: os.stat(shard + suffix) for suffix in (".bin", ".idx")}
    time.sleep(0.01)  # past the filesystem's timestamp tick
    _swap_middle_documents(shard, shard)
    for suffix, status in before.items():
        os.utime(shard + suffix, ns=(status.st_atime_ns, status.st_mtime_ns))
    with pytest.raises(StaleCacheError, match=rf"{shard}\.idx: xxh3_128 was"):
        build(shard, config)


def test_a_racy_fingerprint_is_not_resealed_while_an_array_is_not_vouched_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resealing moves the sidecar's ctime, the seal its arrays are compared with: it is done
    only when every array is vouched for under the old seal, so an array rewritten in place
    before the reseal is not vouched for after it."""
    monkeypatch.setattr(fingerprint, "IDENTITY_MARGIN_NS", 500_000_000)
    rng = np.random.default_rng(4)
    shard = write_megatron_shard(tmp_path / "fresh", random_documents(rng, 300, 20))
    config = make_config(tmp_path / "cache", cache_data_check="error")
    build(shard, config)
    (sidecar,) = (tmp_path / "cache").glob("*-data.tokenmill.json")
    changed = max(os.stat(shard + suffix).st_ctime_ns for suffix in (".bin", ".idx"))
    os.utime(sidecar, ns=(changed, changed + 1))
    (array,) = (tmp_path / "cache").glob("*-shuffle_index.npy")
    time.sleep(0.01)
    status = os.stat(array)
    os.utime(array, ns=(status.st_atime_ns, status.st_mtime_ns))  # ctime now after the seal
    while time.time_ns() <= changed + fingerprint.IDENTITY_MARGIN_NS + 10_000_000:
        time.sleep(0.05)
    sealed = os.stat(sidecar).st_ctime_ns
    build(shard, config)
    assert os.stat(sidecar).st_ctime_ns == sealed


@pytest.mark.parametrize("size", [0, 100, 4096, 5000, 8192, 9000, 70000])
def test_a_fingerprint_from_a_whole_read_is_the_files_fingerprint(
    tmp_path: Path, size: int
) -> None:
    """fingerprint.fingerprint_read (from bytes already read, and the fstat of that open) gives
    fingerprint_file's record, whole-file hash and sampled ends alike, and refuses bytes that
    are not the whole file."""
    from tokenmill.common.whole_read import read_whole

    path = tmp_path / "data.idx"
    path.write_bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    contents, status = read_whole(str(path), 1 << 20)
    assert isinstance(contents, bytes)
    assert fingerprint.fingerprint_read(
        str(path), status, contents
    ) == fingerprint.fingerprint_file(path)
    assert fingerprint.fingerprint_read(str(path), status, contents + b"x") is None


def test_the_fingerprint_of_an_idx_is_of_the_bytes_its_indices_were_built_from(
    shard: str, tmp_path: Path
) -> None:
    """The `.idx` read whole by the dataset is fingerprinted from those very bytes: data that
    changes between the read and the build (documents permuted, same lengths, so every array
    keeps its shape) is seen as stale by the next build. Fingerprinted by a second read at build
    time, the entry recorded the new file beside arrays built from the old one, and served them
    as a hit."""
    low_level = IndexedDataset(shard)  # reads the .idx
    retokenize(shard, seed=99, same_lengths=True)
    indices = np.arange(len(low_level), dtype=np.int32)
    GPTDataset(low_level, shard, indices, 300, Split.train, make_config(tmp_path / "cache"))
    with pytest.raises(StaleCacheError, match=rf"{shard}\.idx: "):
        build(shard, make_config(tmp_path / "cache", cache_data_check="error"))


def test_a_fingerprint_hashes_with_xxh3_128(tmp_path: Path) -> None:
    """The sampled and whole hashes of a record are xxh3-128's of those bytes."""
    import xxhash

    data = bytes(np.random.default_rng(5).integers(0, 256, 3 * fingerprint.SAMPLE_BYTES, np.uint8))
    for name in ("a.bin", "a.idx"):
        (tmp_path / name).write_bytes(data)
        record = fingerprint.fingerprint_file(tmp_path / name)
        sampled = data[: fingerprint.SAMPLE_BYTES] + data[-fingerprint.SAMPLE_BYTES :]
        assert record["sample_xxh3_128"] == xxhash.xxh3_128_hexdigest(sampled)
        assert record.get("xxh3_128") == (
            xxhash.xxh3_128_hexdigest(data) if name == "a.idx" else None
        )
        assert "sample_sha256" not in record and "sha256" not in record


def test_records_of_two_hashes_are_a_difference_not_a_match(shard: str) -> None:
    """A record compared with one of another hash is a change (nothing to compare), and
    fingerprint_as_recorded hashes as the record did: an older build record matches."""
    older = fingerprint.fingerprint_prefixes([shard])
    for suffix in (".bin", ".idx"):
        older["datasets"][shard][suffix] = fingerprint.fingerprint_file(shard + suffix, "sha256")
    found = fingerprint.differences(older, fingerprint.fingerprint_prefixes([shard]))
    assert found == [
        f"{shard}{suffix}: hashed with sha256, now with xxh3_128" for suffix in (".bin", ".idx")
    ]
    assert fingerprint.differences(older, fingerprint.fingerprint_as_recorded([shard], older)) == []
