"""The index-cache protocol without a working lock (docs/cache-protocol.md), and resource
exhaustion reported as such: committed files are never removed, live writers' temporary files
are never touched, a failing lock only means duplicate work, and no lock file is left behind."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_stale_data import arrays, assert_same_arrays, build, fresh_reference, make_config
from tokenmill import _core
from tokenmill.common import owner
from tokenmill.datasets.utils import Split
from tokenmill.errors import DataFormatError, ResourceLimitError
from tokenmill.formats.npy import READ_BELOW, load_npy
from tokenmill.index import cache as cache_module

from conftest import random_documents, write_megatron_shard

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")


@pytest.fixture
def shard(tmp_path: Path) -> str:
    rng = np.random.default_rng(3)
    return write_megatron_shard(tmp_path / "corpus", random_documents(rng, 200))


def forbid_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the entry was rebuilt")

    monkeypatch.setattr("tokenmill.datasets.gpt.build_gpt_indices", fail)


def test_an_entry_is_megatrons_files_plus_one_and_no_lock(shard: str, tmp_path: Path) -> None:
    build(shard, make_config(tmp_path / "cache"))
    names = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").iterdir())
    assert names == [
        "GPTDataset-train-data.tokenmill.json",
        "GPTDataset-train-description.txt",
        "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy",
        "GPTDataset-train-shuffle_index.npy",
    ]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_failing_lock_means_building_without_it(
    shard: str, tmp_path: Path, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(descriptor: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    built = build(shard, make_config(tmp_path / "cache"))
    assert_same_arrays(built, fresh_reference(shard, tmp_path))
    forbid_builds(monkeypatch)
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)


def test_racing_builders_never_remove_a_committed_file(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build(shard, make_config(tmp_path / "cache"))
    committed = {str(p) for p in (tmp_path / "cache").iterdir()}
    removed: list[str] = []
    real_unlink = os.unlink

    def watch(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        removed.append(os.fspath(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", watch)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: watch(self))
    # a second builder that lost the race (no lock, the entry looked missing) writes it again
    entry = first._cache
    assert entry is not None
    entry.save({name: np.asarray(a) for name, a in zip(entry.array_names, arrays(first))})
    assert not committed & set(removed)
    assert {str(p) for p in (tmp_path / "cache").iterdir()} == committed
    forbid_builds(monkeypatch)
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), first)


def test_only_provably_abandoned_temporaries_are_removed(shard: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    tag = owner.owner_tag()  # tm-<host>-<boot>-<pid namespace>-<pid>
    stem = tag.rsplit("-", 1)[0]
    host, boot, namespace = stem.split("-")[1:-2], stem.split("-")[-2], stem.split("-")[-1]
    # the same host name and pid namespace inode on another machine (machine images and
    # containers share host names; a namespace outside containers has one inode everywhere)
    other_boot = f"{(int(boot, 16) + 1) % 16**12:012x}"
    same_name = f"tm-{'-'.join(host)}-{other_boot}-{namespace}"
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        pass
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            files = {
                "dead": f".x-a.npy.{stem}-{gone.pid}.abc.tmp",
                "live": f".x-b.npy.{stem}-{live.pid}.abc.tmp",
                "other_host": f".x-c.npy.{owner.tag('elsewhere', 1, gone.pid)}.abc.tmp",
                "untagged": ".x-d.npy.abc123.tmp",
                "old": f".x-e.npy.{owner.tag('elsewhere', 1, live.pid)}.abc.tmp",
                "same_name_other_machine": f".x-f.npy.{same_name}-{gone.pid}.abc.tmp",
                "before_boot_ids": f".x-g.npy.{stem.replace('-' + boot, '')}-{gone.pid}.7.tmp",
            }
            for name in files.values():
                (cache / name).write_bytes(b"partial")
            old = time.time() - owner.MAX_AGE - 60
            os.utime(cache / files["old"], (old, old))
            build(shard, make_config(cache))  # a miss: the builder sweeps the directory once
            left = {p.name for p in cache.iterdir()}
        finally:
            live.kill()
    assert files["dead"] not in left and files["old"] not in left
    kept = ("live", "other_host", "untagged", "same_name_other_machine", "before_boot_ids")
    assert {files[kind] for kind in kept} <= left


def test_running_out_of_descriptors_is_reported_and_never_rebuilds(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(shard, make_config(tmp_path / "cache"))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    real_open = os.open

    def exhausted(path: str, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".npy"):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    real_read = _core.read_small_file

    def exhausted_read(path: str, *args: object) -> object:  # the one-call read of small files
        if str(path).endswith(".npy"):
            return (errno.EMFILE, 4, None, 0, 0, 0, 0, -1)
        return real_read(path, *args)  # type: ignore[arg-type]

    forbid_builds(monkeypatch)
    monkeypatch.setattr(os, "open", exhausted)
    monkeypatch.setattr(_core, "read_small_file", exhausted_read)
    with pytest.raises(ResourceLimitError, match=r"ulimit -n") as raised:
        build(shard, make_config(tmp_path / "cache"))
    assert raised.value.errno == errno.EMFILE
    monkeypatch.undo()
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == before


@pytest.mark.parametrize(
    ("code", "limit"), [(errno.ENOMEM, "vm.max_map_count"), (errno.EPERM, "refused")]
)
def test_a_refused_map_is_reported_as_such(
    tmp_path: Path, code: int, limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.npy"
    np.save(path, np.arange(READ_BELOW // 8 + 10, dtype=np.int64))

    def refuse(descriptor: int, length: int) -> object:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("tokenmill._core.map_readonly", refuse)
    with pytest.raises(ResourceLimitError, match=limit):
        load_npy(path)


def test_a_large_array_is_opened_once_and_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An array over READ_BELOW is mapped through the descriptor the one-call read opened (no
    second open), with that descriptor's status, and the descriptor is closed."""
    from tokenmill.formats.npy import load_npy_and_status

    path = tmp_path / "big.npy"
    values = np.arange(READ_BELOW // 8 + 10, dtype=np.int64)
    np.save(path, values)
    opens: list[str] = []
    real_open = os.open

    def counting(name: str, *args: object, **kwargs: object) -> int:
        opens.append(str(name))
        return real_open(name, *args, **kwargs)  # type: ignore[arg-type]

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "open", counting)
    array, status = load_npy_and_status(path)
    monkeypatch.undo()
    assert opens == []
    assert np.array_equal(array, values) and not array.flags.writeable
    on_disk = path.stat()
    assert (status.st_size, status.st_ino, status.st_mtime_ns) == (
        on_disk.st_size,
        on_disk.st_ino,
        on_disk.st_mtime_ns,
    )
    assert len(os.listdir("/proc/self/fd")) == before


def test_maps_keep_no_descriptor_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    """300 sources (a .bin and an .idx map each, plus a mapped cache array each) stay open in a
    process limited to 64 descriptors; then, out of descriptors, opening one more names the
    limit instead of calling the file corrupt."""
    rng = np.random.default_rng(1)
    prefix = write_megatron_shard(tmp_path / "shard", random_documents(rng, 50))
    big = tmp_path / "big.npy"
    np.save(big, np.arange(READ_BELOW // 8 + 10, dtype=np.int64))
    code = textwrap.dedent(
        f"""
        import resource, os
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from tokenmill.formats.megatron import IndexedDataset
        from tokenmill.formats.npy import load_npy
        from tokenmill.errors import ResourceLimitError
        held = [(IndexedDataset({prefix!r}), load_npy({str(big)!r})) for _ in range(300)]
        assert all(int(d[len(d) - 1][-1]) >= 0 for d, _ in held)
        spare = []
        try:
            while True:
                spare.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            load_npy({str(big)!r})
        except ResourceLimitError as error:
            print("LIMIT", error)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LIMIT" in done.stdout and "ulimit -n" in done.stdout, done.stderr


def test_a_rank_that_does_not_build_trusts_the_builders_verdict(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cache_module.vouching() as vouched:  # the builder's digests of what it checked
        built = build(shard, make_config(tmp_path / "cache"))
    forbid_builds(monkeypatch)
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)

    def no_fingerprints(path: object, *hashed_with: str) -> None:
        raise AssertionError(f"{path} fingerprinted on a rank that does not build")

    monkeypatch.setattr("tokenmill.index.fingerprint.fingerprint_file", no_fingerprints)

    def no_scans(self: object) -> None:
        raise AssertionError("the .idx scanned again on a rank that does not build")

    monkeypatch.setattr("tokenmill.formats.megatron_index._IndexReader.validate", no_scans)
    from tokenmill.datasets.gpt import GPTDataset

    with cache_module.trusting_builder(vouched):
        low_level = GPTDataset.build_low_level_dataset(shard, make_config(tmp_path / "cache"))
        opened = GPTDataset(
            low_level,
            shard,
            np.arange(len(low_level), dtype=np.int32),
            300,
            Split.train,
            make_config(tmp_path / "cache"),
        )
    assert_same_arrays(opened, built)
    # a DataLoader worker's copy does not fingerprint either
    import pickle

    copy = pickle.loads(pickle.dumps(opened))
    assert copy[0]["tokens"].shape == opened[0]["tokens"].shape


def test_a_trusting_rank_skips_value_checks_but_not_the_structure(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.errors import CacheError

    with cache_module.vouching() as vouched:
        built = build(shard, make_config(tmp_path / "cache"))
    forbid_builds(monkeypatch)
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)

    def no_value_checks(*args: object, **kwargs: object) -> list[str]:
        raise AssertionError("values checked again on a rank that trusts the builders")

    def open_as_trusting_rank() -> GPTDataset:
        with cache_module.trusting_builder(vouched):
            low_level = GPTDataset.build_low_level_dataset(shard, make_config(tmp_path / "cache"))
            return GPTDataset(
                low_level,
                shard,
                np.arange(len(low_level), dtype=np.int32),
                300,
                Split.train,
                make_config(tmp_path / "cache"),
            )

    with monkeypatch.context() as scoped:
        scoped.setattr(cache_module.cache_checks, "value_problems", no_value_checks)
        assert_same_arrays(open_as_trusting_rank(), built)
    # what the builders cannot vouch for is still checked: a file replaced by one of another shape
    (path,) = tmp_path.glob("cache/*-shuffle_index.npy")
    np.save(path, np.arange(3, dtype=np.uint32))
    with pytest.raises(CacheError, match=r"shuffle_index\.npy: shape"):
        open_as_trusting_rank()


def _count_value_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gains "values" at each value check of a cache load."""
    checked: list[str] = []
    real = cache_module.cache_checks.value_problems

    def counting(arrays: Any, checks: Any, full: bool, path_of: Any) -> list[str]:
        checked.append("values")
        return list(real(arrays, checks, full, path_of))

    monkeypatch.setattr(cache_module.cache_checks, "value_problems", counting)
    return checked


def test_the_builder_rechecks_values_only_of_files_its_sidecar_does_not_vouch_for(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.index import fingerprint

    built = build(shard, make_config(tmp_path / "cache"))
    forbid_builds(monkeypatch)
    checked = _count_value_checks(monkeypatch)
    # the very files the builder checked and recorded: no second check
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)
    assert checked == []
    # the same bytes in a new file (another inode and mtime): the values are checked again
    (path,) = tmp_path.glob("cache/*-sample_index.npy")
    copy = path.with_name("copy.npy")
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)
    assert checked == ["values"]
    # a record that is not the sidecar format is a bad sidecar: the entry is rebuilt
    (sidecar,) = tmp_path.glob("cache/*-data.tokenmill.json")
    payload = fingerprint.read_fingerprint(sidecar)
    assert payload is not None
    payload["arrays"]["sample_index"]["inode"] = -1
    sidecar.write_text(json.dumps(payload))
    with pytest.raises(DataFormatError, match=r"arrays\['sample_index'\] field 'inode'"):
        fingerprint.read_fingerprint(sidecar)


def test_a_reused_inode_number_is_caught_by_its_generation(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that took the place of a vouched-for array file with the same size, mtime and
    inode number (the original freed, its number reused within one clock tick) differs in the
    inode's generation: its values are checked."""
    from tokenmill import _core
    from tokenmill.index import fingerprint

    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    descriptor = os.open(probe, os.O_RDONLY)
    try:
        reported = _core.inode_generation(descriptor) >= 0
    finally:
        os.close(descriptor)
    if not reported:
        pytest.skip(f"the filesystem of {tmp_path} reports no inode generations")
    built = build(shard, make_config(tmp_path / "cache"))
    forbid_builds(monkeypatch)
    checked = _count_value_checks(monkeypatch)
    (sidecar,) = tmp_path.glob("cache/*-data.tokenmill.json")
    payload = fingerprint.read_fingerprint(sidecar)
    assert payload is not None
    record = payload["arrays"]["sample_index"]
    (path,) = tmp_path.glob("cache/*-sample_index.npy")
    status = path.stat()
    assert record == {
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "inode": status.st_ino,
        "generation": record["generation"],
    }
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)
    assert checked == []
    # the record of the file that was there before: same size, mtime and number, another
    # generation
    record["generation"] = (record["generation"] + 1) % 2**32
    sidecar.write_text(json.dumps(payload))
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)
    assert checked == ["values"]
    # a record of older tokenmill (no generation) vouches on the other fields, as it did
    del record["generation"]
    sidecar.write_text(json.dumps(payload))
    assert_same_arrays(build(shard, make_config(tmp_path / "cache")), built)
    assert checked == ["values"]


def test_vouching_compares_generations_only_where_both_sides_have_one() -> None:
    from tokenmill.index.fingerprint import vouches_for as vouches

    def vouches_for(recorded: dict[str, Any], current: dict[str, dict[str, int]]) -> bool:
        # each file last changed (ctime 1) before the sidecar was written (ctime 2)
        now = {name: {**status, "ctime_ns": 1} for name, status in current.items()}
        return vouches(recorded, now, 2)

    fields = {"size": 10, "mtime_ns": 5, "inode": 7}
    with_generation = {**fields, "generation": 3}
    assert vouches_for({"arrays": {"a": with_generation}}, {"a": with_generation})
    assert vouches_for({"arrays": {"a": fields}}, {"a": fields})
    assert vouches_for({"arrays": {"a": fields}}, {"a": with_generation})  # older record
    # recorded, but the filesystem reports none now (another mount): check the values
    assert not vouches_for({"arrays": {"a": with_generation}}, {"a": fields})
    assert not vouches_for({"arrays": {"a": {**fields, "generation": 4}}}, {"a": with_generation})
    assert not vouches_for({"arrays": {"a": {**fields, "inode": 8}}}, {"a": with_generation})
    assert not vouches_for({"arrays": {"a": {**fields, "extra": 1}}}, {"a": with_generation})
    # a file changed after the sidecar was written (its ctime is later) is not vouched for
    changed = {"a": {**with_generation, "ctime_ns": 3}}
    assert not vouches({"arrays": {"a": with_generation}}, changed, 2)
    assert not vouches({"arrays": {"a": with_generation}}, {"a": with_generation}, 2)


def test_a_blend_fingerprints_each_data_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.index import fingerprint

    rng = np.random.default_rng(4)
    prefixes = [
        write_megatron_shard(tmp_path / f"s{i}", random_documents(rng, 60)) for i in range(4)
    ]
    calls: list[str] = []
    from_reads: list[str] = []
    real, real_read = fingerprint.fingerprint_file, fingerprint.fingerprint_read

    def counting(path: str, *hashed_with: str) -> dict[str, object]:
        calls.append(str(path))
        return real(path, *hashed_with)

    def counting_read(path: str, *read: Any) -> dict[str, object] | None:
        from_reads.append(str(path))
        return real_read(path, *read)

    monkeypatch.setattr(fingerprint, "fingerprint_file", counting)
    monkeypatch.setattr(fingerprint, "fingerprint_read", counting_read)
    config = make_config(tmp_path / "cache", split="80,20,0", blend=(prefixes, [1, 2, 3, 4]))
    BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, 0], lambda: True, config).build()
    # each .bin read for its fingerprint once; each .idx fingerprinted from its reader's bytes
    assert sorted(calls) == sorted(p + ".bin" for p in prefixes)
    assert sorted(from_reads) == sorted(p + ".idx" for p in prefixes)


def test_a_trusting_rank_refuses_negative_ids_of_a_damaged_blend_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    rng = np.random.default_rng(8)
    prefixes = [
        write_megatron_shard(tmp_path / f"s{i}", random_documents(rng, 60)) for i in range(2)
    ]
    config = make_config(tmp_path / "cache", split="100,0,0", blend=(prefixes, [1, 1]))

    def open_blend() -> Any:
        return BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()[
            0
        ]

    with cache_module.vouching() as vouched:
        built = open_blend()
    for name, position in (("dataset_index", 3), ("dataset_sample_index", 5)):
        (path,) = tmp_path.glob(f"cache/*-BlendedDataset-train-{name}.npy")
        original = np.load(path)
        damaged = original.copy()
        damaged[position] = -1  # wraps around to another sample under numpy/list indexing
        np.save(path, damaged)
        with monkeypatch.context() as scoped:
            scoped.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
            scoped.setattr("tokenmill.datasets.blended.is_cache_builder", lambda scope: False)
            with cache_module.trusting_builder(vouched):
                trusted = open_blend()
        damage = rf"{name[:7]}.*sample {position} .*damaged index"
        with pytest.raises(IndexError, match=damage):
            trusted[position]
        with pytest.raises(IndexError, match=damage):
            trusted.get_batch([0, position])
        np.testing.assert_array_equal(trusted[0]["tokens"], built[0]["tokens"])
        np.save(path, original)


def test_a_warm_blend_stats_each_data_file_once_for_its_data_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blend's entry names the files its members' entries have just proven unchanged: one
    ``stat`` per file serves both data checks (fingerprint.once_per_file). The ``.bin`` has one
    more, the reader's own check of its size."""
    from collections import Counter

    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.index import fingerprint

    rng = np.random.default_rng(5)
    prefixes = [
        write_megatron_shard(tmp_path / f"s{i}", random_documents(rng, 60)) for i in range(3)
    ]
    config = make_config(tmp_path / "cache", split="100,0,0", blend=(prefixes, [1, 2, 3]))
    BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()
    # a stat proves a file unchanged only if it last changed well before its sidecar was
    # written (fingerprint.IDENTITY_MARGIN_NS): date the sidecars later
    later = time.time_ns() + 10 * fingerprint.IDENTITY_MARGIN_NS
    for sidecar in (tmp_path / "cache").glob("*-data.tokenmill.json"):
        os.utime(sidecar, ns=(later, later))
    stats: Counter[str] = Counter()
    real_stat = os.stat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stats[os.fspath(path)] += 1
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting)
    hashed: list[str] = []
    monkeypatch.setattr(fingerprint, "fingerprint_file", hashed.append)
    BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()
    monkeypatch.undo()
    assert hashed == []  # every file proven by its stat
    data_files = [prefix + suffix for prefix in prefixes for suffix in (".idx", ".bin")]
    assert {path: stats[path] for path in data_files} == {
        **{p + ".idx": 1 for p in prefixes},
        **{p + ".bin": 2 for p in prefixes},
    }


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failing_member_stops_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """The first member that fails ends the blend's build: no later member is built or
    committed (on main every remaining member was built and committed), and its error is
    raised."""
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    rng = np.random.default_rng(9)
    prefixes = [
        write_megatron_shard(tmp_path / f"m{i}", random_documents(rng, 40)) for i in range(6)
    ]
    real = GPTDataset.build_low_level_dataset

    def failing(path: str, config: Any) -> Any:
        if path == prefixes[1]:
            raise DataFormatError(f"{path}.idx: broken on purpose")
        return real(path, config)

    monkeypatch.setattr(GPTDataset, "build_low_level_dataset", staticmethod(failing))
    config = make_config(
        tmp_path / "cache",
        split="100,0,0",
        blend=(prefixes, [1] * len(prefixes)),
        num_dataset_builder_threads=threads,
    )
    with pytest.raises(DataFormatError, match="broken on purpose"):
        BlendedMegatronDatasetBuilder(GPTDataset, [60, 0, 0], lambda: True, config).build()
    committed = list((tmp_path / "cache").glob("*-GPTDataset-*-description.txt"))
    # at most the members before the failing one (member 0), nothing after it
    assert len(committed) <= 1


def test_a_trusting_rank_checks_a_mirror_copy_the_builders_did_not_vouch_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node mirror (or an s3:// copy fetched into one) is another directory holding a copy of
    the entry: when that copy is older than the data the builders checked, its digest differs
    from theirs and the trusting rank checks it, raising StaleCacheError instead of serving it.
    The copy the builders did vouch for is still opened without fingerprinting anything."""
    import shutil

    from tokenmill.errors import StaleCacheError
    from tokenmill.index import fingerprint

    rng = np.random.default_rng(12)
    shard = write_megatron_shard(tmp_path / "data", random_documents(rng, 200))
    build(shard, make_config(tmp_path / "old"))  # the mirror's copy, of the old data
    documents = random_documents(np.random.default_rng(13), 200)
    time.sleep(0.01)
    write_megatron_shard(tmp_path / "data", documents)  # new data behind the same prefix
    with cache_module.vouching() as vouched:  # the builders check (and rebuild) their copy
        fresh = build(shard, make_config(tmp_path / "shared"))
    shutil.copytree(tmp_path / "old", tmp_path / "mirror")
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
    with cache_module.trusting_builder(vouched):
        with pytest.raises(StaleCacheError, match="built from different data"):
            build(shard, make_config(tmp_path / "mirror"))

        def no_fingerprints(path: object) -> None:
            raise AssertionError(f"{path} fingerprinted for a copy the builders vouched for")

        monkeypatch.setattr(fingerprint, "fingerprint_file", no_fingerprints)
        assert_same_arrays(build(shard, make_config(tmp_path / "shared")), fresh)
