"""GPTDataset behaviour beyond megatron-core: safe caches, pickling, config errors, no torch."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill._core import _testing
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.errors import CacheError
from tokenmill.formats.megatron import IndexedDataset

from conftest import TinyTokenizer, random_documents, write_megatron_shard

torch = pytest.importorskip("torch")

# Most tests here use megatron's default create_attention_mask=True on purpose.


def make_config(shard: str, cache: Path | None, **fields: Any) -> GPTDatasetConfig:
    values: dict[str, Any] = {
        "random_seed": 5,
        "sequence_length": 40,
        "tokenizer": TinyTokenizer(),
        "blend": ([shard], None),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "path_to_cache": None if cache is None else str(cache),
    }
    values.update(fields)
    return GPTDatasetConfig(**values)


def build(shard: str, config: GPTDatasetConfig, num_samples: int | None = 300) -> GPTDataset:
    low_level = IndexedDataset(shard)
    indices = np.arange(len(low_level), dtype=np.int32)
    return GPTDataset(low_level, shard, indices, num_samples, Split.train, config)


def assert_same_samples(first: GPTDataset, second: GPTDataset) -> None:
    assert len(first) == len(second)
    for idx in range(0, len(first), 23):
        a, b = first[idx], second[idx]
        assert list(a) == list(b)
        for key in a:
            assert torch.equal(a[key], b[key]), (idx, key)


def cache_files(directory: Path) -> dict[str, bytes]:
    """Every visible file's bytes; a data fingerprint's record of the array files it vouches
    for (their inodes and mtimes, new at every write) left out."""
    files = {}
    for path in directory.iterdir():
        if path.name.startswith("."):
            continue
        content = path.read_bytes()
        if path.name.endswith("-data.tokenmill.json"):
            payload = json.loads(content)
            payload.pop("arrays", None)
            content = json.dumps(payload, sort_keys=True).encode()
        files[path.name] = content
    return files


def forbid_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the index was rebuilt although a valid cache exists")

    monkeypatch.setattr("tokenmill.datasets.gpt.build_gpt_indices", no_build)


def test_second_construction_is_a_cache_hit(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(shard, tmp_path / "cache")
    first = build(shard, config)
    files = cache_files(tmp_path / "cache")
    assert sorted(name.split("-", 1)[1] for name in files) == [
        "GPTDataset-train-data.tokenmill.json",  # tokenmill's data fingerprint
        "GPTDataset-train-description.txt",
        "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy",
        "GPTDataset-train-shuffle_index.npy",
    ]
    forbid_builds(monkeypatch)
    second = build(shard, config)
    assert not second.sample_index.flags.writeable  # loaded from the cache, read-only
    assert_same_samples(first, second)
    assert cache_files(tmp_path / "cache") == files


def test_default_cache_directory_is_beside_the_data(shard: str) -> None:
    build(shard, make_config(shard, None))
    assert any(Path(shard, "cache", "GPTDataset_indices").iterdir())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "description", "delete", "shape"])
def test_damaged_cache_is_rebuilt_by_the_builder(shard: str, tmp_path: Path, damage: str) -> None:
    config = make_config(shard, tmp_path / "cache")
    reference = build(shard, config)
    files = cache_files(tmp_path / "cache")
    (sample_path,) = (tmp_path / "cache").glob("*-sample_index.npy")
    (description_path,) = (tmp_path / "cache").glob("*-description.txt")
    if damage == "truncate":
        sample_path.write_bytes(sample_path.read_bytes()[:200])
    elif damage == "garbage":
        sample_path.write_bytes(b"not a numpy file at all")
    elif damage == "description":
        description_path.write_text("{}")
    elif damage == "delete":
        sample_path.unlink()
    else:
        np.save(sample_path, np.zeros((3, 2), dtype=np.int32))
    rebuilt = build(shard, config)
    assert_same_samples(reference, rebuilt)
    assert cache_files(tmp_path / "cache") == files


def test_damaged_cache_is_an_error_on_ranks_that_do_not_build(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(shard, tmp_path / "cache")
    build(shard, config)
    (sample_path,) = (tmp_path / "cache").glob("*-sample_index.npy")
    sample_path.write_bytes(sample_path.read_bytes()[:100])
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
    with pytest.raises(CacheError, match=r"sample_index\.npy: unreadable or truncated"):
        build(shard, config)


def test_missing_cache_is_an_error_on_ranks_that_do_not_build(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokenmill.datasets.gpt.is_cache_builder", lambda scope: False)
    with pytest.raises(CacheError, match=r"description\.txt: missing"):
        build(shard, make_config(shard, tmp_path / "cache"))


def test_interrupted_write_leaves_no_description(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The description is the commit point: a crash before it means a miss, never a bad hit."""
    config = make_config(shard, tmp_path / "cache")
    # the third write(2): the second array's header, after the first array
    _testing.inject_file_fault("write", 3, errno.ENOSPC)
    # named as what it is (a ResourceLimitError, an OSError), never taken for a bad cache
    try:
        with pytest.raises(OSError, match="filesystem is full"):
            build(shard, config)
    finally:
        _testing.inject_file_fault("write", 0)
    leftovers = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert not any(name.endswith("description.txt") for name in leftovers)
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "cache"))
    build(shard, config)  # the next run completes


def test_concurrent_builders_produce_one_valid_cache(shard: str, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_gpt_dataset import build, make_config
        ds = build({shard!r}, make_config({shard!r}, __import__("pathlib").Path(
            {str(tmp_path / "cache")!r})), num_samples=20000)
        print(int(np.asarray(ds.shuffle_index).astype(np.int64).sum()))
        """
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert all(process.returncode == 0 for process in processes)
    assert len(set(outputs)) == 1
    reference = build(shard, make_config(shard, tmp_path / "reference"), num_samples=20000)
    rebuilt = build(shard, make_config(shard, tmp_path / "cache"), num_samples=20000)
    assert_same_samples(reference, rebuilt)


def test_returned_tensors_are_never_shared(shard: str, tmp_path: Path) -> None:
    """Samples share only what megatron shares (its cached causal mask, and loss mask and
    position ids where no flag changes them), never written by tokenmill; a caller's write to
    one does not reach later samples."""
    dataset = build(shard, make_config(shard, tmp_path / "cache"))
    first, second = dataset[0], dataset[1]
    for key in ("tokens", "labels"):
        assert first[key].data_ptr() != second[key].data_ptr(), key
    assert first["attention_mask"] is second["attention_mask"]
    first["loss_mask"][:] = 0.0
    first["position_ids"][:] = -5
    first["attention_mask"][:] = False
    third = dataset[2]
    assert int(third["position_ids"][0]) == 0 and int(third["position_ids"][39]) == 39
    assert bool(third["attention_mask"][0, 0, 1])
    assert float(third["loss_mask"].sum()) == 40.0


def test_none_index_is_a_padding_sample(shard: str, tmp_path: Path) -> None:
    dataset = build(shard, make_config(shard, tmp_path / "cache"))
    padding = dataset[None]
    assert float(padding["loss_mask"].sum()) == 0.0
    assert torch.equal(padding["tokens"], dataset[0]["tokens"])


def test_pickle_carries_file_names_not_arrays(shard: str, tmp_path: Path) -> None:
    dataset = build(shard, make_config(shard, tmp_path / "cache"), num_samples=5000)
    data = pickle.dumps(dataset)
    assert len(data) < int(np.asarray(dataset.shuffle_index).nbytes)
    restored = pickle.loads(data)
    assert_same_samples(dataset, restored)
    in_memory = build(shard, make_config(shard, tmp_path / "gone"), num_samples=50)
    for path in (tmp_path / "gone").iterdir():
        path.unlink()  # without the cache files the arrays themselves travel
    assert_same_samples(in_memory, pickle.loads(pickle.dumps(in_memory)))


def test_deferred_mapping_and_fast_cache_load(shard: str, tmp_path: Path) -> None:
    eager = build(shard, make_config(shard, tmp_path / "cache"))
    deferred = build(shard, make_config(shard, tmp_path / "cache", defer_npy_index_mmap=True))
    assert deferred.sample_index is None
    assert len(deferred) == len(eager)
    assert_same_samples(eager, deferred)
    per_split: dict[str, Any] = {
        "blend": None,
        "split": None,
        "blend_per_split": [([shard], None), None, None],
    }
    warm = build(shard, make_config(shard, tmp_path / "per-split", **per_split))
    fast = GPTDataset(
        IndexedDataset(shard),
        shard,
        None,  # megatron-core's fast_cache_load passes no indices
        300,
        Split.train,
        make_config(shard, tmp_path / "per-split", fast_cache_load=True, **per_split),
    )
    assert_same_samples(warm, fast)
    with pytest.raises(CacheError, match="no valid cache"):
        GPTDataset(
            IndexedDataset(shard), shard, None, 301, Split.train,
            make_config(shard, tmp_path / "per-split", fast_cache_load=True, **per_split),
        )  # fmt: skip


def test_exact_sample_count_gets_its_own_cache_entry(shard: str, tmp_path: Path) -> None:
    low_level = IndexedDataset(shard)
    indices = np.arange(len(low_level), dtype=np.int32)
    default = GPTDataset(
        low_level, shard, indices, None, Split.valid,
        make_config(shard, tmp_path / "c", drop_last_partial_validation_sequence=False),
    )  # fmt: skip
    exact = GPTDataset(
        low_level, shard, indices, None, Split.valid,
        make_config(
            shard, tmp_path / "c", drop_last_partial_validation_sequence=False,
            exact_sample_count=True,
        ),
    )  # fmt: skip
    assert default.unique_description_hash != exact.unique_description_hash
    assert len(default) == len(exact)  # the float32 ceil is exact at this size


def test_empty_split_with_samples_is_a_clear_error(tmp_path: Path) -> None:
    shard = write_megatron_shard(tmp_path / "tiny", [[1, 2, 0], [3, 0]])
    low_level = IndexedDataset(shard)
    with pytest.raises(ValueError, match="cannot draw 5 samples from a split with 0 tokens"):
        GPTDataset(
            low_level, shard, np.array([], dtype=np.int32), 5, Split.test,
            make_config(shard, tmp_path / "cache"),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"reset_position_ids": None}, "reset_position_ids must be set"),
        ({"tokenizer": None}, "needs a tokenizer"),
        ({"sequence_length": 0}, "sequence_length must be >= 1, got 0"),
        ({"random_seed": 2**32}, "random_seed must be in"),
        ({"split": None}, "split must be provided"),
        ({"split": "1,2,3,4"}, "at most 3 parts"),
        ({"split": "0,0,0"}, "positive number"),
        ({"blend": (["a", "b"], [1.0])}, "equal in number"),
        ({"blend_per_split": [(["a"], None), None, None]}, "blend and blend_per_split"),
        ({"fast_cache_load": True, "path_to_cache": None}, "fast_cache_load requires"),
        ({"defer_npy_index_mmap": True, "path_to_cache": None}, "defer_npy_index_mmap requires"),
        ({"cache_build_scope": "cluster"}, "cache_build_scope must be"),
        ({"mid_level_dataset_surplus": -1.0}, "mid_level_dataset_surplus"),
    ],
)
def test_config_errors_name_the_field(
    shard: str, tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(shard, tmp_path, **fields)


def test_mock_config_and_pad_collision_warning(shard: str, tmp_path: Path) -> None:
    config = make_config(shard, None, blend=None, split=None)
    assert config.mock
    assert config.split == "1,1,1"
    colliding = TinyTokenizer(pad=0)  # the EOD id
    with pytest.warns(UserWarning, match="collides with another special token"):
        dataset = build(shard, make_config(shard, tmp_path / "c", tokenizer=colliding))
    assert dataset._pad_token_id == -1


def test_index_building_does_not_import_torch(shard: str, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import tokenmill
        assert "torch" not in sys.modules and "tokenmill._core" not in sys.modules
        from test_gpt_dataset import build, make_config
        """
    ).replace("from test_gpt_dataset import build, make_config", "")
    script += textwrap.dedent(
        f"""
        from conftest import TinyTokenizer
        from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
        from tokenmill.datasets.utils import Split
        from tokenmill.formats.megatron import IndexedDataset
        low = IndexedDataset({shard!r})
        config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=TinyTokenizer(),
            blend=([{shard!r}], None), split="1", reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, path_to_cache={str(tmp_path)!r})
        GPTDataset(low, {shard!r}, np.arange(len(low), dtype=np.int32), 100, Split.train, config)
        assert "torch" not in sys.modules, "building indices imported torch"
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_rng_documents_cover_every_epoch(tmp_path: Path) -> None:
    """Each epoch of the document index is a permutation of the split's documents."""
    rng = np.random.default_rng(3)
    shard = write_megatron_shard(tmp_path / "s", random_documents(rng, 50, 60))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset = build(shard, make_config(shard, tmp_path / "c"), num_samples=400)
    document_index = np.asarray(dataset.document_index)
    epochs = len(document_index) // 50
    assert epochs >= 2
    for epoch in range(epochs - 1):
        chunk = document_index[epoch * 50 : (epoch + 1) * 50]
        if epoch < epochs - 1 and not np.array_equal(np.sort(chunk), np.arange(50)):
            # the first E-1 epochs are shuffled together unless the final epoch is separate
            break
    assert np.array_equal(np.bincount(document_index, minlength=50), np.full(50, epochs))


def test_kernel_output_of_the_wrong_shape_is_never_saved(
    shard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index kernels' values are not re-checked before saving (the suite holds them to the
    references), but their dtypes and shapes are: a wrong array is an error, and no entry."""
    import tokenmill.datasets.gpt as gpt_module

    real = gpt_module.build_gpt_indices

    def short(*args: Any, **kwargs: Any) -> Any:
        document_index, sample_index, shuffle_index = real(*args, **kwargs)
        return document_index, sample_index, shuffle_index[:-1]

    monkeypatch.setattr(gpt_module, "build_gpt_indices", short)
    config = make_config(shard, tmp_path / "cache")
    with pytest.raises(CacheError, match=r"built index arrays are invalid: .*shuffle_index.*shape"):
        build(shard, config)
    assert not list((tmp_path / "cache").rglob("*description.txt"))


_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
)
_JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6) | st.integers(-3, 3), _JSON_VALUES), max_size=8))
def test_description_is_megatrons_json_text(entries: list[tuple[str, Any]]) -> None:
    """describe() memoises the indented text of the config's part; the result must stay
    exactly json.dumps(indent=4) (the cache key megatron-core computes), twice over."""
    from collections import OrderedDict

    from tokenmill.datasets.megatron_dataset import describe, describe_compact

    identifiers = OrderedDict(entries)
    expected = json.dumps(identifiers, indent=4)
    assert describe(identifiers)[0] == expected
    assert describe(identifiers)[0] == expected
    # the compact text a dataset keeps (described_text) is json.dumps's, though made from parts
    description, digest, compact = describe_compact(identifiers)
    assert (description, digest) == describe(identifiers)
    assert compact == json.dumps(identifiers, separators=(",", ":"))


def test_blend_description_reuses_its_members_texts_only_while_they_hold(
    shard: str, tmp_path: Path
) -> None:
    """A blend's description nests its members' descriptions (megatron-core's JSON); tokenmill
    re-indents the texts the members computed, unless a member's identifiers changed since."""
    from collections import OrderedDict

    from tokenmill.datasets.megatron_dataset import _identifiers_of, describe, described_text

    config = make_config(shard, tmp_path / "cache")
    members = [build(shard, config, num_samples=n) for n in (50, 80)]

    def blend_identifiers() -> OrderedDict[str, Any]:
        return OrderedDict(
            [
                ("class", "BlendedDataset"),
                ("datasets", [member.unique_identifiers for member in members]),
                ("split", "train"),
                ("weights", [0.25, 0.75]),
                ("size", 100),
            ]
        )

    texts = [described_text(member) for member in members]
    assert texts == [member.unique_description for member in members]
    identifiers = blend_identifiers()
    expected = json.dumps(identifiers, indent=4, default=_identifiers_of)
    assert describe(identifiers, known={"datasets": texts})[0] == expected
    members[1].unique_identifiers["extra"] = [1, {"a": None}]  # a subclass adds a field
    assert described_text(members[1]) is None
    identifiers = blend_identifiers()
    expected = json.dumps(identifiers, indent=4, default=_identifiers_of)
    known = {"datasets": [described_text(member) for member in members]}
    assert describe(identifiers, known=known)[0] == expected
