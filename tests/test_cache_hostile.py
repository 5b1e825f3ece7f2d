"""The index cache's lock files are not followed through a planted symlink and do not block
on a planted FIFO, and a cache directory every user can write is refused (issue #37, "Links and
special files" and "a world-writable cache directory lets another user plant valid-looking
arrays that are served")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_stale_data import make_config
from tokenmill.common.cache_directory import ALLOW_VARIABLE
from tokenmill.common.locks import best_effort_lock
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.gpt import GPTDataset
from tokenmill.errors import CacheError, SharedCacheDirectoryError
from tokenmill.index.cache import IndexCache

from conftest import random_documents, write_megatron_shard

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")


def test_symlink_at_lock_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    lock = tmp_path / "entry.lock"
    lock.symlink_to(target)
    with (
        pytest.raises(OSError, match="symbolic link") as caught,
        best_effort_lock(str(lock), "building", remove_on_release=True),
    ):
        pass
    assert str(lock) in str(caught.value)
    assert target.read_bytes() == b"keep"
    assert lock.is_symlink()


def test_fifo_at_lock_does_not_block(tmp_path):
    lock = tmp_path / "entry.lock"
    os.mkfifo(lock)
    code = (
        "import sys\n"
        "from tokenmill.common.locks import best_effort_lock\n"
        "try:\n"
        "    with best_effort_lock(sys.argv[1], 'building'):\n"
        "        pass\n"
        "except OSError as error:\n"
        "    print('refused:', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(lock)], capture_output=True, text=True, timeout=60
    )
    assert "refused:" in result.stdout and str(lock) in result.stdout, result


def _blend(tmp_path: Path, sources: int) -> list[str]:
    rng = np.random.default_rng(sources)
    return [
        write_megatron_shard(tmp_path / f"s{i}", random_documents(rng, 40)) for i in range(sources)
    ]


def _build_blend(cache: Path, prefixes: list[str]) -> list[Any]:
    config = make_config(cache, split="100,0,0", blend=(prefixes, [1] * len(prefixes)))
    return BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*-description.txt")) if cache.is_dir() else []


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["world-writable", "sticky"])
def test_a_world_writable_cache_directory_is_refused_naming_it_and_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """Another user could plant valid-looking arrays in it that every rank would serve; the
    sticky bit (/tmp's 1777) does not stop anyone creating an entry's files first."""
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    prefixes = _blend(tmp_path, 2)
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(SharedCacheDirectoryError) as caught:
        _build_blend(cache, prefixes)
    message = str(caught.value)
    assert str(cache) in message
    assert oct(mode) in message
    assert f"uid {os.getuid()}" in message
    assert "plant" in message and ALLOW_VARIABLE in message
    assert isinstance(caught.value, CacheError)
    assert _entries(cache) == []  # refused before anything was read or written


def test_the_opt_in_lets_a_world_writable_cache_directory_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prefixes = _blend(tmp_path, 2)
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o1777)
    monkeypatch.setenv(ALLOW_VARIABLE, "1")
    with caplog.at_level("WARNING", logger="tokenmill.common.cache_directory"):
        _build_blend(cache, prefixes)
    assert len(_entries(cache)) == 3  # two sources and the blend
    assert any(str(cache) in record.getMessage() for record in caplog.records)
    monkeypatch.setenv(ALLOW_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{ALLOW_VARIABLE} must be 0 or 1, got 'yes'"):
        _build_blend(cache, prefixes)


@pytest.mark.parametrize("mode", [0o770, 0o2775, 0o555])
def test_group_writable_and_read_only_cache_directories_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """A cache shared by a group is normal on a cluster; a read-only one (a colleague's, or a
    published copy) is trusted as its owner is."""
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    prefixes = _blend(tmp_path, 2)
    cache = tmp_path / "cache"
    _build_blend(cache, prefixes)
    cache.chmod(mode)
    try:
        _build_blend(cache, prefixes)
    finally:
        cache.chmod(0o755)
    assert len(_entries(cache)) == 3


def test_the_cache_directory_is_statted_once_per_build_whatever_the_number_of_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/bench_scale.py counts filesystem calls per source: the check adds one call
    per build, not one per entry."""
    from tokenmill.common import cache_directory

    checked: Counter[str] = Counter()
    real_check = cache_directory.check_cache_directory

    def counting(directory: str, *args: Any) -> None:
        checked[directory] += 1
        real_check(directory, *args)

    monkeypatch.setattr("tokenmill.index.cache.check_cache_directory", counting)
    statted: Counter[str] = Counter()
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        statted[os.fspath(path)] += 1
        return real_stat(path, *args, **kwargs)

    found = {}
    for sources in (2, 6):
        cache = tmp_path / f"cache{sources}"
        data = tmp_path / f"data{sources}"
        data.mkdir()
        prefixes = _blend(data, sources)
        for state in ("cold", "warm"):
            cache.mkdir(exist_ok=True)
            checked.clear()
            statted.clear()
            monkeypatch.setattr(os, "stat", counting_stat)
            _build_blend(cache, prefixes)
            monkeypatch.setattr(os, "stat", real_stat)
            assert checked == {str(cache): 1}, (sources, state)
            found[sources, state] = statted[str(cache)]
        assert len(_entries(cache)) == sources + 1
    # every stat of the directory itself, the check's included, is per build, not per entry
    assert found[2, "cold"] == found[6, "cold"] and found[2, "warm"] == found[6, "warm"], found


def test_a_world_writable_node_mirror_of_a_remote_cache_is_refused_before_any_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``s3://`` cache's entries are fetched into a node-local mirror and served from it (an
    entry complete there costs no request): the mirror is judged like a local cache directory,
    before anything is fetched into it."""
    from tokenmill.storage import remote_cache

    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "node"))
    location = "s3://bucket/index-cache"
    mirror = Path(remote_cache.local_cache_directory(location))
    mirror.mkdir(parents=True)
    mirror.chmod(0o777)

    def no_requests(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("fetched before the mirror was checked")

    monkeypatch.setattr(remote_cache, "fetch_cache_entry", no_requests)
    with pytest.raises(SharedCacheDirectoryError, match=str(mirror)):
        IndexCache.create(location, "0" * 32, "GPTDataset", "train", "{}", ["document_index"])


def test_a_world_writable_raw_text_cache_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw-text pieces are reused by a key anyone can compute (path, size, times, tokenizer):
    their directory, and the path_to_cache it defaults to, are judged too."""
    from tokenmill.raw_text import RawText
    from tokenmill.raw_text.resolver import tokenize_raw_text

    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    pieces.chmod(0o1777)
    with pytest.raises(SharedCacheDirectoryError, match="raw-text cache directory"):
        tokenize_raw_text([str(tmp_path / "a.jsonl")], None, str(pieces))
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    config = make_config(cache)
    with pytest.raises(SharedCacheDirectoryError, match=str(cache)):
        RawText().resolve([str(tmp_path / "a.jsonl")], config)
    assert not (cache / "raw_text").exists()


def test_patched_megatron_refuses_a_world_writable_cache_directory(tmp_path: Path) -> None:
    """Megatron's own imports after `patch_megatron()` reach the same cache and the same
    refusal (a fresh process: patching is process-global)."""
    prefix = write_megatron_shard(tmp_path / "s0", random_documents(np.random.default_rng(1), 40))
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    script = textwrap.dedent(
        f"""
        import os, sys
        os.environ.pop({ALLOW_VARIABLE!r}, None)
        import tokenmill
        tokenmill.patch_megatron()
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder)
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        class Tokenizer:
            vocab_size, eod = 1000, 0
            unique_identifiers = {{"class": "Tokenizer", "vocab_size": 1000}}

        config = GPTDatasetConfig(
            random_seed=1, sequence_length=32, blend=([{prefix!r}], None), split="1,0,0",
            path_to_cache={str(cache)!r}, tokenizer=Tokenizer(), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False)
        try:
            BlendedMegatronDatasetBuilder(GPTDataset, [50, 0, 0], lambda: True, config).build()
        except Exception as error:
            print("refused:", type(error).__module__, type(error).__name__, error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert "refused: tokenmill.errors SharedCacheDirectoryError" in result.stdout, result
    assert str(cache) in result.stdout and "0o777" in result.stdout
    assert not list(cache.iterdir())
