"""tokenmill build-cache: the trainer's cache, byte for byte, built offline; hits; --check."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmill.cli.main import main
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.runs.cache_build import build_cache, check_cache
from tokenmill.runs.config_file import load_run_config, parse_sizes

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from oracles import import_oracle

SIZES = [300, 40, 8]
TOKENIZER = {
    "vocab_size": 1000,
    "eod": 0,
    "unique_identifiers": {"class": "TinyTokenizer", "vocab_size": 1000},
}


def make_shards(directory: Path, count: int = 3) -> list[str]:
    rng = np.random.default_rng(7)
    return [
        write_megatron_shard(directory / f"shard{i}", random_documents(rng, 80, 120))
        for i in range(count)
    ]


def fields(prefixes: list[str], cache: Path, **extra: Any) -> dict[str, Any]:
    return {
        "random_seed": 1234,
        "sequence_length": 31,
        "blend": [prefixes, [0.5, 0.3, 0.2][: len(prefixes)]],
        "split": "90,8,2",
        "path_to_cache": str(cache),
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
        "mid_level_dataset_surplus": 0.5,
        "tokenizer": TOKENIZER,
        **extra,
    }


def write_config(path: Path, values: dict[str, Any]) -> str:
    if path.suffix == ".json":
        path.write_text(json.dumps(values))
    elif path.suffix in (".yaml", ".yml"):
        yaml = pytest.importorskip("yaml")
        path.write_text(yaml.safe_dump(values))
    else:
        raise AssertionError(path)
    return str(path)


def cache_files(directory: Path) -> dict[str, bytes]:
    """The cache entries' files (not the lock files nor tokenmill's build record)."""
    return {
        p.name: p.read_bytes()
        for p in directory.iterdir()
        if not p.name.startswith((".", "tokenmill-build-"))
        and not p.name.endswith("-data.tokenmill.json")
    }


def stats(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
        for p in directory.iterdir()
    }


@pytest.fixture
def built(tmp_path: Path) -> tuple[str, Path, list[str]]:
    prefixes = make_shards(tmp_path)
    cache = tmp_path / "cache"
    config = write_config(tmp_path / "run.yaml", fields(prefixes, cache))
    assert main(["build-cache", config, "--sizes", *map(str, SIZES), "--quiet"]) == 0
    return config, cache, prefixes


def test_cache_equals_the_trainers_cache(
    tmp_path: Path, built: tuple[str, Path, list[str]]
) -> None:
    _, cache, prefixes = built
    trainer = GPTDatasetConfig(
        **{**fields(prefixes, tmp_path / "trainer"), "blend": (prefixes, [0.5, 0.3, 0.2])}
        | {"tokenizer": TinyTokenizer()}
    )
    BlendedMegatronDatasetBuilder(GPTDataset, SIZES, lambda: True, trainer).build()
    ours, theirs = cache_files(cache), cache_files(tmp_path / "trainer")
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 3 * 3 * 4 + 3 * 3  # 9 GPTDatasets x 4 files, 3 blends x 3 files
    for name, data in theirs.items():
        assert ours[name] == data, name


@pytest.mark.megatron
def test_cache_equals_megatron_cores_cache(
    tmp_path: Path, built: tuple[str, Path, list[str]]
) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841 - megatron-core needs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_builder = import_oracle("megatron.core.datasets.blended_megatron_dataset_builder")
        megatron_gpt = import_oracle("megatron.core.datasets.gpt_dataset")
    _, cache, prefixes = built
    values = fields(prefixes, tmp_path / "megatron")
    values["blend"] = (prefixes, [0.5, 0.3, 0.2])
    values["tokenizer"] = TinyTokenizer()
    megatron_builder.BlendedMegatronDatasetBuilder(
        megatron_gpt.GPTDataset, SIZES, lambda: True, megatron_gpt.GPTDatasetConfig(**values)
    ).build()
    assert cache_files(cache) == cache_files(tmp_path / "megatron")


def test_second_build_is_a_hit_and_rewrites_nothing(built: tuple[str, Path, list[str]]) -> None:
    config, cache, _ = built
    before = stats(cache)
    report = build_cache(load_run_config(config), SIZES, progress=False)
    assert report.built == 0 and report.hits == len(report.entries) == 12
    assert report.bytes_written == 0
    assert stats(cache) == before
    # and a trainer with this config hits every entry too
    report = check_cache(load_run_config(config), SIZES)
    assert report.problems == [] and stats(cache) == before


def test_summary_reports_sources_and_bytes(tmp_path: Path) -> None:
    prefixes = make_shards(tmp_path)
    config = write_config(tmp_path / "run.json", {**fields(prefixes, tmp_path / "c")})
    report = build_cache(load_run_config(config), SIZES, progress=False)
    assert report.splits == [
        ("BlendedDataset", 300),
        ("BlendedDataset", 40),
        ("BlendedDataset", 9),  # megatron blends sum(ceil(8 * w)) samples
    ]
    assert len(report.sources) == 9
    train = [s for s in report.sources if s.split == "train"]
    assert [s.dataset_path for s in train] == prefixes
    assert sum(s.drawn or 0 for s in train) == 300
    assert all(s.epochs >= 1 and s.samples >= (s.drawn or 0) for s in report.sources)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
    assert report.bytes_written == on_disk
    text = report.summary()
    assert "train: BlendedDataset with 300 samples" in text and "12 cache entries" in text


def test_progress_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefixes = make_shards(tmp_path)
    config = write_config(tmp_path / "run.json", fields(prefixes, tmp_path / "c"))
    assert main(["build-cache", config, "--sizes", "300", "40", "8"]) == 0
    captured = capsys.readouterr()
    assert "[build-cache] 12 entries (12 built)" in captured.err
    assert "bytes written" in captured.out


def run_check(config: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["build-cache", config, "--sizes", *map(str, SIZES), "--check"])
    return code, capsys.readouterr().out


def test_check_passes_on_a_good_cache(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_check(built[0], capsys)
    assert code == 0 and "cache OK: 12 entries" in out


def test_check_catches_a_truncated_file(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, cache, _ = built
    victim = sorted(cache.glob("*-GPTDataset-train-sample_index.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:-9])
    before = stats(cache)
    code, out = run_check(config, capsys)
    assert code == 1
    assert f"{victim}: unreadable or truncated" in out
    assert stats(cache) == before  # --check writes nothing


def test_check_catches_a_missing_file(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, cache, _ = built
    victim = sorted(cache.glob("*-BlendedDataset-valid-dataset_index.npy"))[0]
    victim.unlink()
    code, out = run_check(config, capsys)
    assert code == 1 and f"{victim}: missing" in out
    assert not victim.exists()


def test_check_catches_a_replaced_shard(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, _, prefixes = built
    # Same document lengths, different tokens: megatron's key and every shape stay the same.
    path = Path(prefixes[1] + ".bin")
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out = run_check(config, capsys)
    assert code == 1
    assert f"data changed since the cache was built: {prefixes[1]}.bin: " in out
    # every entry built from it is stale (the blends too), none of the others
    stale = [line for line in out.splitlines() if "built from other data" in line]
    assert all("shard1.bin" in line for line in stale)
    assert len({line.split(": built from")[0] for line in stale}) == 3 + 3
    # building again rebuilds exactly those entries (cache_data_check="rebuild"), then all is well
    report = build_cache(load_run_config(config), SIZES, progress=False)
    assert report.built == 6
    assert run_check(config, capsys)[0] == 0


def test_check_catches_a_replaced_shard_with_the_data_check_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefixes = make_shards(tmp_path)
    values = fields(prefixes, tmp_path / "c", cache_data_check="off")
    config = write_config(tmp_path / "run.json", values)
    build_cache(load_run_config(config), SIZES, progress=False)
    path = Path(prefixes[2] + ".bin")
    path.write_bytes(path.read_bytes()[::-1])
    code, out = run_check(config, capsys)
    assert code == 1 and f"{prefixes[2]}.bin: " in out and "data changed" in out


def test_check_catches_a_shard_with_other_documents(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, _, prefixes = built
    rng = np.random.default_rng(99)
    write_megatron_shard(prefixes[0], random_documents(rng, 95, 120))
    code, out = run_check(config, capsys)
    assert code == 1
    assert f"data changed since the cache was built: {prefixes[0]}.idx: size was" in out
    assert "GPTDataset-train-document_index.npy: shape" in out


def test_check_catches_a_foreign_description(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, cache, _ = built
    victim = sorted(cache.glob("*-GPTDataset-test-description.txt"))[0]
    victim.write_text(victim.read_text().replace("1234", "4321"))
    code, out = run_check(config, capsys)
    assert code == 1 and f"{victim}: description differs from config" in out


def test_check_without_a_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefixes = make_shards(tmp_path)
    config = write_config(tmp_path / "run.json", fields(prefixes, tmp_path / "c"))
    code, out = run_check(config, capsys)
    assert code == 1
    assert "no build-cache record" in out and "description.txt: missing" in out
    assert not (tmp_path / "c").exists()


def test_packing_plans_are_built_and_hit(tmp_path: Path) -> None:
    from tokenmill.datasets.packed import PackedDataset, PackingConfig
    from tokenmill.formats.megatron import IndexedDataset

    prefixes = make_shards(tmp_path, 2)
    values = fields(prefixes, tmp_path / "c", packing={"sequence_length": 64})
    config = write_config(tmp_path / "run.json", values)
    report = build_cache(load_run_config(config), SIZES, progress=False)
    assert sum("PackedDataset" in e.cache.base for e in report.entries) == 2
    before = stats(tmp_path / "c")
    packed = PackedDataset(
        IndexedDataset(prefixes[0]),
        PackingConfig(sequence_length=64, path_to_cache=str(tmp_path / "c")),
    )
    assert len(packed) > 0 and stats(tmp_path / "c") == before  # the trainer hits


def test_toml_json_and_yaml_configs_agree(tmp_path: Path) -> None:
    prefixes = make_shards(tmp_path)
    values = fields(prefixes, tmp_path / "c", sizes=SIZES)
    as_json = load_run_config(write_config(tmp_path / "a.json", values))
    as_yaml = load_run_config(write_config(tmp_path / "a.yaml", values))
    toml = tmp_path / "a.toml"
    toml.write_text(
        f"random_seed = 1234\nsequence_length = 31\nsplit = '90,8,2'\n"
        f"path_to_cache = '{tmp_path / 'c'}'\nreset_position_ids = false\n"
        "reset_attention_mask = false\neod_mask_loss = false\ncreate_attention_mask = false\n"
        "mid_level_dataset_surplus = 0.5\nsizes = [300, 40, 8]\n"
        f"blend = [{json.dumps(prefixes)}, [0.5, 0.3, 0.2]]\n"
        "[tokenizer]\nvocab_size = 1000\neod = 0\n"
        "[tokenizer.unique_identifiers]\nclass = 'TinyTokenizer'\nvocab_size = 1000\n"
    )
    as_toml = load_run_config(toml)
    assert as_json.identity == as_yaml.identity == as_toml.identity
    assert as_json.sizes == as_toml.sizes == tuple(SIZES)
    assert as_json.config.blend == (prefixes, [0.5, 0.3, 0.2])


def test_megatron_blend_list_and_sizes_from_the_file(tmp_path: Path) -> None:
    prefixes = make_shards(tmp_path)
    values = fields(prefixes, tmp_path / "c", sizes=[100, "none", None])
    values["blend"] = [prefixes[0]]
    values["split"] = "100,0,0"
    run = load_run_config(write_config(tmp_path / "run.json", values))
    assert run.config.blend == ([prefixes[0]], None)
    report = build_cache(run, progress=False)
    assert report.splits == [("GPTDataset", report.splits[0][1]), None, None]  # type: ignore[index]


def test_tokenmill_tokenizer_in_the_config(tmp_path: Path) -> None:
    prefixes = make_shards(tmp_path, 1)
    values = fields(prefixes, tmp_path / "c", tokenizer={"kind": "bytes"})
    values["blend"] = [prefixes, None]
    run = load_run_config(write_config(tmp_path / "run.json", values))
    assert run.config.tokenizer.vocab_size == 258
    assert run.identity["tokenizer"]["kind"] == "bytes"
    assert build_cache(run, SIZES, progress=False).built == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1}, "unknown field 'bogus'"),
        ({"tokenizer": None}, "tokenizer: must be a mapping"),
        ({"tokenizer": {"vocab_size": 10, "eod": 0}}, "missing 'unique_identifiers'"),
        ({"tokenizer": {**TOKENIZER, "colour": 1}}, "unknown key 'colour'"),
        ({"tokenizer": {**TOKENIZER, "eod": "zero"}}, r"tokenizer.eod: must be an integer"),
        ({"tokenizer": {"kind": "bytes", "file": "x"}}, "unknown key 'file'"),
        ({"blend": "shard0"}, "blend: expected"),
        ({"blend": [["a"], ["x"]]}, "weights must be a list of numbers"),
        ({"blend": None, "split": None}, "mock data has nothing to cache"),
        ({"blend_per_split": [None]}, "blend_per_split must be a list of 3"),
        ({"sequence_length": 0}, "sequence_length must be >= 1"),
        ({"sizes": [1, 2]}, "sizes must be 3 values"),
        ({"sizes": [1, "many", 2]}, "size 'many' is not an integer"),
        ({"sizes": [1, -2, 2]}, "must be a whole number >= 0"),
        ({"packing": {"sequence_length": 1}}, "packing: sequence_length must be >= 2"),
        ({"packing": 3}, "packing must be a mapping"),
    ],
)
def test_bad_configs_name_file_and_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    values = {**fields(["shard0"], tmp_path / "c"), **change}
    values = {k: v for k, v in values.items() if v is not None or k == "tokenizer"}
    config = write_config(tmp_path / "run.json", values)
    with pytest.raises(ValueError, match=message) as error:
        load_run_config(config)
    assert "run.json" in str(error.value)


def test_missing_tokenizer_and_bad_files(tmp_path: Path) -> None:
    values = fields(["shard0"], tmp_path / "c")
    del values["tokenizer"]
    with pytest.raises(ValueError, match=r"run.json: missing field 'tokenizer'"):
        load_run_config(write_config(tmp_path / "run.json", values))
    (tmp_path / "run.ini").write_text("x")
    with pytest.raises(ValueError, match=r"unknown config extension '.ini'"):
        load_run_config(tmp_path / "run.ini")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad.json"):
        load_run_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="must be a mapping, got list"):
        load_run_config(tmp_path / "list.json")
    (tmp_path / "bad.yaml").write_text("a: [")
    with pytest.raises(ValueError, match=r"bad.yaml: cannot parse config"):
        load_run_config(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        load_run_config(tmp_path / "absent.json")


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefixes = make_shards(tmp_path)
    values = fields(prefixes, tmp_path / "c")
    config = write_config(tmp_path / "run.json", values)
    assert main(["build-cache", config]) == 2
    assert "no sizes" in capsys.readouterr().err
    assert main(["build-cache", config, "--sizes", "1", "x", "2"]) == 2
    assert "--sizes: size 'x'" in capsys.readouterr().err
    del values["path_to_cache"]
    config = write_config(tmp_path / "nocache.json", values)
    assert main(["build-cache", config, "--sizes", "1", "1", "1"]) == 2
    assert "path_to_cache must be set" in capsys.readouterr().err


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefixes = make_shards(tmp_path)
    config = write_config(tmp_path / "run.json", fields(prefixes, tmp_path / "c", sizes=SIZES))
    assert main(["build-cache", config, "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["built"] == 12 and report["problems"] == []
    assert os.path.exists(report["record"])


def test_parse_sizes() -> None:
    assert parse_sizes(["10", "none", "-"], "x") == (10, None, None)
    assert parse_sizes([1, None, 2.0], "x") == (1, None, 2)
    with pytest.raises(ValueError, match="whole number"):
        parse_sizes([1.5, 1, 1], "x")


def test_check_catches_a_wrong_dtype(
    built: tuple[str, Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, cache, _ = built
    victim = sorted(cache.glob("*-GPTDataset-valid-sample_index.npy"))[0]
    np.save(victim, np.load(victim).astype(np.int64))
    code, out = run_check(config, capsys)
    assert code == 1 and f"{victim}: dtype int64 (expected int32)" in out


def test_one_cache_session_at_a_time() -> None:
    from tokenmill.index.cache import CacheSession, cache_session

    outer = cache_session(CacheSession())
    with outer, pytest.raises(RuntimeError, match="already active"), cache_session(CacheSession()):
        pass
    with cache_session(CacheSession()):  # released after the block
        pass


def test_build_cache_refuses_a_remote_cache_location(tmp_path: Path) -> None:
    values = fields(["shard0"], tmp_path / "c")
    values["path_to_cache"] = "s3://bucket/cache"
    run = load_run_config(write_config(tmp_path / "run.json", values))
    with pytest.raises(ValueError, match="is remote; build-cache writes a local directory"):
        build_cache(run, SIZES, progress=False)


def test_fast_startup_flags_are_ignored_while_building(tmp_path: Path) -> None:
    """A run config that sets fast_cache_load and defer_npy_index_mmap (the trainer's flags)
    builds its caches anyway, as Megatron-LM's tools/prepare_cache.py does; the training run
    with those flags then loads what was built, without building."""
    prefixes = make_shards(tmp_path)
    values = fields(prefixes, tmp_path / "cache", fast_cache_load=True, defer_npy_index_mmap=True)
    values["blend_per_split"] = [[prefixes, [0.5, 0.3, 0.2]], [prefixes[:1], None], None]
    del values["blend"], values["split"]
    run = load_run_config(write_config(tmp_path / "run.json", values))
    report = build_cache(run, SIZES, progress=False)
    assert report.entries and all(event.built for event in report.entries)
    before = cache_files(tmp_path / "cache")
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, SIZES, lambda: True, run.config
    ).build()
    assert len(train) == SIZES[0] and len(valid) > 0
    assert train[5]["tokens"].shape == (31,)
    assert cache_files(tmp_path / "cache") == before


def test_a_cold_blend_computes_its_indices_while_its_members_are_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, greedy_threads: list[str]
) -> None:
    import tokenmill.datasets.builder as builder_module
    from tokenmill.index.cache_writes import current_context

    threads = greedy_threads
    prefixes = make_shards(tmp_path)
    values = {**fields(prefixes, tmp_path / "cache"), "blend": (prefixes, [0.5, 0.3, 0.2])}
    config = GPTDatasetConfig(**values | {"tokenizer": TinyTokenizer()})

    def samples() -> list[list[int]]:
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, SIZES, lambda: True, config).build()
        return [[int(t) for t in d[n]["tokens"][:4]] for d in datasets for n in range(len(d))]

    cold = samples()
    # one greedy blend per split with a size, each computed ahead, none left behind
    assert threads == ["tokenmill-blending-ahead"] * 3
    assert current_context() is None  # the build's context, and what it computed ahead, ended
    threads.clear()
    assert samples() == cold  # warm: loaded from the cache, nothing computed, ahead or not
    assert threads == []
    # the blends equal those computed in line (a cold build that computes nothing ahead)
    monkeypatch.setattr(builder_module, "compute_ahead", lambda weights, size: None)
    in_line = {"path_to_cache": str(tmp_path / "in-line"), "tokenizer": TinyTokenizer()}
    config = GPTDatasetConfig(**values | in_line)
    assert samples() == cold
    assert threads == ["MainThread"] * 3
