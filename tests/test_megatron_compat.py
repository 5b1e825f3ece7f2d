"""tokenmill.megatron against the installed megatron-core (0.19.2 in the main suite; every release
in .ci/megatron-matrix, 0.16.1 in .ci/run's version stage): names, signatures, helpers, subclass
hooks, accepted inputs, and each deliberate difference (the table in docs/megatron.md) shown to
be the only one.

Everything here runs in this process next to megatron-core, without `patch_megatron()` (which is
process-global; test_megatron_patch.py runs megatron's own code on tokenmill in subprocesses);
tokenmill follows the installed release as the patch would make it (`_follow_installed`), so a
subclass overriding a hook as that release defines it (`_query_document_sample_shuffle_indices`
returns 2 values before 0.19, 3 from 0.19) is compared with the same subclass on stock.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import inspect
import itertools
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from megatron_compare import assert_same_sample, compare_datasets
from oracles import import_oracle

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import_oracle("megatron.core.datasets.gpt_dataset")

import tokenmill
from tokenmill.common import megatron_version
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset, IndexedDatasetBuilder
from tokenmill.megatron import MODULES

THEIRS = {name: importlib.import_module(f"megatron.core.datasets.{name}") for name in MODULES}
OURS = {name: importlib.import_module(f"tokenmill.megatron.{name}") for name in MODULES}


@pytest.fixture(autouse=True)
def _follow_installed() -> Iterator[None]:
    """What `patch_megatron()` does at patch time: follow the installed megatron-core."""
    megatron_version.follow_installed()
    yield
    megatron_version._followed = None


# Names megatron's modules import from the rest of megatron-core (they stay megatron-core's and
# are not part of these modules' own interface) or from the standard library and typing.
FOREIGN = {
    "safe_numpy_load": "megatron.core.safe_globals, a megatron-core module",
    "MegatronTokenizerBase": "megatron.core.tokenizers: any object with megatron's attributes",
    "MultiStorageClientFeature": "megatron.core.msc_utils: msc:// is not supported",
    "maybe_msc": "megatron.core.msc_utils: msc:// is not supported",
}

# The documented differences of signature, each with its reason (docs/megatron.md, "Switch an existing
# Megatron-LM run"). "missing" means the attribute may be absent; "differs" that its signature
# may differ in the way the reason says.
ALLOWED: dict[str, tuple[str, str]] = {
    "indexed_dataset.IndexedDataset.__del__": (
        "missing",
        "tokenmill's reader keeps no descriptor that needs closing",
    ),
    "indexed_dataset._IndexReader.__del__": (
        "missing",
        "the index map is released with the reader; nothing to close by hand",
    ),
    "indexed_dataset.IndexedDatasetBuilder.add_documents": (
        "differs",
        "takes tokenmill's (tokens, sequence_lengths, sequences_per_document) and Megatron-LM "
        "main's (documents, modes=None, eod_token=None, chunk_size=...), told apart by keywords "
        "or the first argument",
    ),
    "object_storage_utils.ObjectStorageConfig.__init__": (
        "differs",
        "bin_chunk_nbytes defaults to 4 MiB in an LRU of 256 MiB (megatron: one 256 MiB chunk); "
        "cache, prefetch and retry fields follow",
    ),
}
if megatron_version._parse(importlib.metadata.version("megatron-core")) >= (0, 20):
    # Megatron-LM main names log_single_rank's level and msg; 0.16-0.19 pass them in *args.
    # tokenmill keeps the older form, which takes main's calls (positional level and msg) too.
    for _module in MODULES:
        ALLOWED[f"{_module}.log_single_rank"] = (
            "differs",
            "(logger, *args, rank=0, **kwargs) takes main's (logger, level, msg, ...) calls",
        )
for _module in ("object_storage_utils", "indexed_dataset", "gpt_dataset"):
    for _name in ("ObjectStorageConfig", "S3Config"):
        for _suffix in ("", ".__init__"):
            ALLOWED.setdefault(
                f"{_module}.{_name}{_suffix}", ("differs", "see ObjectStorageConfig")
            )


def _is_foreign(value: Any) -> bool:
    if isinstance(value, types.ModuleType):
        return True
    module = getattr(value, "__module__", None) or getattr(type(value), "__module__", "")
    if getattr(value, "__name__", None) == "log_single_rank":
        return False  # megatron-core's logging helper, re-exported by datasets.utils
    if module.startswith("megatron.") and not module.startswith("megatron.core.datasets"):
        return True
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in ("typing", "builtins", "numpy", "torch")


def _interface(module: types.ModuleType) -> dict[str, Any]:
    """The names of a megatron module a user can import from it: everything it defines (public
    or private functions and classes, constants, its logger), and the public names it imports
    from megatron.core.datasets / megatron.core.utils."""
    names = {}
    for name, value in vars(module).items():
        if name.startswith("__") or name in FOREIGN or isinstance(value, types.ModuleType):
            continue
        if getattr(value, "__module__", None) == module.__name__ or isinstance(
            value, (str, bytes, int, float, bool, tuple, dict, list, logging.Logger)
        ):
            names[name] = value  # defined here (constants cannot tell: taken as defined)
        elif not name.startswith("_") and (
            not _is_foreign(value) or getattr(value, "__args__", None) is not None
        ):
            names[name] = value  # imported public names, and type aliases built here
    return names


def _members(cls: type) -> dict[str, Any]:
    """The methods a class defines itself (not dataclass, enum or Protocol machinery)."""
    members = {}
    for name, value in vars(cls).items():
        if name in ("__dict__", "__weakref__", "__module__", "__doc__", "__annotations__"):
            continue
        if name.startswith("__dataclass") or name in ("__match_args__", "__hash__"):
            continue
        if issubclass(cls, enum.Enum) and hasattr(enum.Enum, name):
            continue
        if getattr(cls, "_is_protocol", False) and name in vars(type(cls)) | {"__init__": 0}:
            continue
        if name in ("_abc_impl", "__abstractmethods__", "__parameters__", "__orig_bases__"):
            continue
        if name.startswith("__protocol") or name in ("_is_protocol", "_is_runtime_protocol"):
            continue
        if name in ("__non_callable_proto_members__", "__subclasshook__"):
            continue
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if callable(function) or isinstance(value, property):
            members[name] = value
    return members


def _signature(value: Any) -> inspect.Signature | None:
    function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None  # pybind11 builtins of megatron's helpers_cpp carry no signature


def _default_equal(ours: Any, theirs: Any) -> bool:
    if ours is theirs:
        return True
    try:
        return bool(ours == theirs)
    except Exception:
        return False


def compatibility_problems(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """Why code written against `theirs` might not work against `ours` (empty: compatible).

    Compatible: every parameter of megatron's is there with its name, kind and default, its
    positional parameters come first in the same order, and anything tokenmill adds has a
    default (or is *args / **kwargs).
    """
    problems = []
    mine = list(ours.parameters.values())
    reference = list(theirs.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    their_positional = [p for p in reference if p.kind in positional]
    our_positional = [p for p in mine if p.kind in positional]
    if [p.name for p in our_positional[: len(their_positional)]] != [
        p.name for p in their_positional
    ]:
        problems.append(
            f"positional parameters {[p.name for p in our_positional]} do not start with "
            f"{[p.name for p in their_positional]}"
        )
    by_name = {p.name: p for p in mine}
    has_var = {p.kind for p in mine}
    for parameter in reference:
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if parameter.kind not in has_var:
                problems.append(f"missing {parameter}")
            continue
        found = by_name.get(parameter.name)
        if found is None:
            problems.append(f"missing parameter {parameter.name}")
            continue
        if found.kind != parameter.kind and not (
            parameter.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
            and found.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        ):
            problems.append(f"{parameter.name}: kind {found.kind} != {parameter.kind}")
        if parameter.default is not inspect.Parameter.empty:
            if found.default is inspect.Parameter.empty:
                problems.append(f"{parameter.name}: no default (megatron: {parameter.default!r})")
            elif not _default_equal(found.default, parameter.default):
                problems.append(
                    f"{parameter.name}: default {found.default!r} != {parameter.default!r}"
                )
    names = {p.name for p in reference}
    for parameter in mine:
        if parameter.name in names or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        if parameter.default is inspect.Parameter.empty:
            problems.append(f"added parameter {parameter.name} has no default")
    return problems


def interface_checks() -> list[tuple[str, Any, Any]]:
    """(qualified name, megatron's object, tokenmill's object or None) for every function,
    class and method of the nine modules."""
    checks = []
    for module_name in MODULES:
        ours_module = OURS[module_name]
        for name, value in _interface(THEIRS[module_name]).items():
            qualified = f"{module_name}.{name}"
            found = getattr(ours_module, name, None)
            checks.append((qualified, value, found))
            if isinstance(value, type) and found is not None:
                for member, member_value in _members(value).items():
                    checks.append(
                        (
                            f"{qualified}.{member}",
                            member_value,
                            inspect.getattr_static(found, member, None),
                        )
                    )
    return checks


def test_every_megatron_name_is_there_with_a_compatible_signature() -> None:
    checks = interface_checks()
    assert len(checks) > 150  # the walk itself found megatron's interface
    problems = []
    for qualified, theirs, ours in checks:
        allowed = ALLOWED.get(qualified)
        if ours is None:
            if allowed is None or allowed[0] != "missing":
                problems.append(f"{qualified}: missing")
            continue
        if isinstance(theirs, property):
            if not isinstance(ours, property):
                problems.append(f"{qualified}: not a property")
            continue
        if not callable(theirs) and not isinstance(theirs, (staticmethod, classmethod)):
            # constants: equal values (a dict of classes: the same keys; type aliases and
            # loggers are only required to exist)
            if isinstance(theirs, dict):
                if not isinstance(ours, dict) or list(ours) != list(theirs):
                    problems.append(f"{qualified}: keys {ours!r} != {theirs!r}")
            elif (
                not isinstance(theirs, (type, types.ModuleType, logging.Logger))
                and "typing" not in str(type(theirs))
                and not _default_equal(ours, theirs)
            ):
                problems.append(f"{qualified}: value {ours!r} != {theirs!r}")
            continue
        their_signature, our_signature = _signature(theirs), _signature(ours)
        if their_signature is None:
            if not callable(ours) and not isinstance(ours, (staticmethod, classmethod)):
                problems.append(f"{qualified}: not callable")
            continue
        if our_signature is None:
            problems.append(f"{qualified}: tokenmill's has no signature")
            continue
        found = compatibility_problems(our_signature, their_signature)
        if found and (allowed is None or allowed[0] != "differs"):
            problems.append(f"{qualified}{our_signature} vs {their_signature}: {found}")
    assert not problems, "\n".join(problems)


def test_staticmethods_stay_static() -> None:
    """`build_low_level_dataset`, `numel_low_level_dataset`, `_key_config_attributes` and
    megatron's other static methods are static methods of tokenmill's classes too."""
    for qualified, theirs, _ in interface_checks():
        if "." not in qualified.split(".", 1)[1]:
            continue
        module_name, class_name, member = qualified.split(".")
        ours_class = getattr(OURS[module_name], class_name)
        raw = inspect.getattr_static(ours_class, member, None)
        if isinstance(theirs, staticmethod):
            assert isinstance(raw, staticmethod), qualified
        if isinstance(theirs, classmethod):
            assert isinstance(raw, classmethod), qualified


def test_classes_are_tokenmills_own() -> None:
    assert OURS["gpt_dataset"].GPTDataset is tokenmill.GPTDataset
    assert OURS["indexed_dataset"].IndexedDataset is tokenmill.IndexedDataset
    assert OURS["blended_dataset"].BlendedDataset is tokenmill.BlendedDataset
    builder = OURS["blended_megatron_dataset_builder"]
    assert builder.BlendedMegatronDatasetBuilder is tokenmill.BlendedMegatronDatasetBuilder
    assert OURS["megatron_dataset"].MegatronDataset in tokenmill.GPTDataset.__mro__
    assert OURS["utils"].Split is tokenmill.Split
    assert inspect.isabstract(OURS["megatron_dataset"].MegatronDataset)


def test_compile_helpers_is_a_no_op() -> None:
    assert OURS["utils"].compile_helpers() is None


# -- helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", range(60))
def test_build_sample_idx_matches_megatrons_kernel(case: int) -> None:
    """Random document orders (zero-length documents, repeats, several epochs), sequence
    lengths, both extra-token settings and both drop-last settings."""
    rng = np.random.default_rng(case)
    sizes = rng.integers(0 if case % 3 == 0 else 1, 60, int(rng.integers(1, 40))).astype(np.int32)
    epochs = int(rng.integers(1, 4))
    documents = np.tile(np.arange(sizes.shape[0], dtype=np.int32), epochs)
    rng.shuffle(documents)
    tokens = int(sizes.sum())
    if tokens < 2:
        sizes[0] = 5
        tokens = int(sizes.sum())
    sequence_length = int(rng.integers(2, 50))
    drop_last = bool(rng.integers(2))
    extra = bool(rng.integers(2))
    args = (sizes, documents, sequence_length, epochs, tokens, drop_last, extra)
    for kernel in ("build_sample_idx_int32", "build_sample_idx_int64"):
        expected = getattr(THEIRS["helpers"], kernel)(*args[:6], int(extra))
        found = getattr(OURS["helpers"], kernel)(*args[:6], int(extra))
        assert found.dtype == expected.dtype
        np.testing.assert_array_equal(found, expected)
    try:
        expected = THEIRS["helpers"].build_sample_idx(*args)
    except AssertionError:
        # megatron's wrapper asserts on a negative offset (the end-of-data row of a final
        # empty document); its kernels, compared above, agree with tokenmill's
        return
    found = OURS["helpers"].build_sample_idx(*args)
    assert found.dtype == expected.dtype
    np.testing.assert_array_equal(found, expected)


@pytest.mark.parametrize("case", range(20))
def test_blending_helpers_fill_arrays_in_place_like_megatron(case: int) -> None:
    rng = np.random.default_rng(case)
    count = int(rng.integers(1, 12))
    weights = rng.uniform(0.01, 1.0, count)
    weights /= weights.sum()
    size = int(rng.integers(0, 500))
    arrays = []
    for helpers in (THEIRS["helpers"], OURS["helpers"]):
        index = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(index, sample, weights, count, size, False)
        arrays.append((index, sample))
    np.testing.assert_array_equal(arrays[0][0], arrays[1][0])
    np.testing.assert_array_equal(arrays[0][1], arrays[1][1])
    sizes = rng.integers(1, 40, count).astype(np.int64)
    exhaustive = []
    for helpers in (THEIRS["helpers"], OURS["helpers"]):
        index = np.zeros(int(sizes.sum()), dtype=np.int16)
        sample = np.zeros(int(sizes.sum()), dtype=np.int64)
        helpers.build_exhaustive_blending_indices(index, sample, sizes, count)
        exhaustive.append((index, sample))
    np.testing.assert_array_equal(exhaustive[0][0], exhaustive[1][0])
    np.testing.assert_array_equal(exhaustive[0][1], exhaustive[1][1])


def test_blending_helper_reports_like_megatron_when_verbose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    index = np.zeros(10, dtype=np.int16)
    sample = np.zeros(10, dtype=np.int64)
    OURS["helpers"].build_blending_indices(index, sample, [0.5, 0.5], 2, 10, True)
    assert "dataset 1: weight 0.500000, achieved 0.500000" in capsys.readouterr().out
    with pytest.raises(ValueError, match="num_datasets is 3 but 2"):
        OURS["helpers"].build_blending_indices(index, sample, [0.5, 0.5], 3, 10, False)
    with pytest.raises(ValueError, match="dataset_index has 10 entries, fewer than 11"):
        OURS["helpers"].build_blending_indices(index, sample, [0.5, 0.5], 2, 11, False)


def test_bert_mappings_call_megatrons_compiled_helper() -> None:
    assert OURS["helpers"].build_mapping.__doc__
    helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
    assert OURS["helpers"]._megatron_helper("build_mapping") is helpers_cpp.build_mapping


@pytest.mark.parametrize(("epochs", "separate"), [(1, False), (3, False), (3, True)])
def test_module_helpers_match_megatron(epochs: int, separate: bool) -> None:
    theirs, ours = THEIRS["gpt_dataset"], OURS["gpt_dataset"]
    documents = np.arange(5, 40, dtype=np.int32)
    rng_a, rng_b = np.random.RandomState(9), np.random.RandomState(9)
    expected = theirs._build_document_index(documents, epochs, rng_a, separate)
    found = ours._build_document_index(documents, epochs, rng_b, separate)
    assert found.dtype == expected.dtype
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(
        ours._build_shuffle_index(30, 45, rng_b), theirs._build_shuffle_index(30, 45, rng_a)
    )
    assert rng_a.randint(1 << 30) == rng_b.randint(1 << 30)  # the states advanced alike
    tokens = torch.tensor([5, 0, 3, 3, 0, 0, 8, 9, 0, 1])
    for flags in itertools.product((False, True), repeat=4):
        expected_masks = theirs._get_ltor_masks_and_position_ids(tokens, 0, *flags)
        found_masks = ours._get_ltor_masks_and_position_ids(tokens, 0, *flags)
        for mine, reference in zip(found_masks, expected_masks):
            if reference is None:
                assert mine is None
            else:
                assert mine.dtype == reference.dtype and torch.equal(mine, reference), flags


def test_object_storage_helpers_match_megatron(tmp_path: Path) -> None:
    theirs, ours = THEIRS["object_storage_utils"], OURS["object_storage_utils"]
    for path in ("s3://bucket/a/b.idx", "s3://bucket", "msc://profile/x", "/local/file"):
        assert ours.is_object_storage_path(path) == theirs.is_object_storage_path(path)
        assert ours.get_object_storage_access(path) == theirs.get_object_storage_access(path)
        assert ours._is_s3_path(path) == theirs._is_s3_path(path)
        assert ours._remove_s3_prefix(path) == theirs._remove_s3_prefix(path)
        assert ours._remove_msc_prefix(path) == theirs._remove_msc_prefix(path)
    for path in ("s3://bucket/a/b.idx", "s3://bucket"):
        assert ours.parse_s3_path(path) == theirs.parse_s3_path(path)
    config = ours.ObjectStorageConfig(path_to_idx_cache=str(tmp_path))
    their_config = theirs.ObjectStorageConfig(path_to_idx_cache=str(tmp_path))
    assert ours.get_index_cache_path("s3://b/k/x.idx", config) == theirs.get_index_cache_path(
        "s3://b/k/x.idx", their_config
    )
    with pytest.raises(ValueError, match="not an s3:// path"):
        ours.parse_s3_path("/local")  # megatron-core asserts


def test_s3_object_exists_says_false_for_a_missing_object() -> None:
    """megatron-core 0.19.2 passes `bucket=`/`key=` (a real boto3 client rejects them) and
    answers True for a 404; tokenmill asks with Bucket/Key and answers False (a difference)."""

    class NotFound(Exception):
        response: ClassVar[dict[str, Any]] = {"Error": {"Code": "404"}}

    class Client:
        def __init__(self) -> None:
            self.calls: list[dict[str, str]] = []

        def head_object(self, **kwargs: str) -> dict[str, Any]:
            self.calls.append(kwargs)
            if kwargs["Key"] == "missing":
                raise NotFound
            return {}

    client = Client()
    ours = OURS["object_storage_utils"]
    assert ours._s3_object_exists(client, "s3://bucket/present") is True
    assert ours._s3_object_exists(client, "s3://bucket/missing") is False
    assert client.calls[0] == {"Bucket": "bucket", "Key": "present"}


def test_index_writer_bytes_match_megatron(tmp_path: Path) -> None:
    for library, name in ((THEIRS, "megatron"), (OURS, "tokenmill")):
        with library["indexed_dataset"]._IndexWriter(str(tmp_path / f"{name}.idx"), np.uint16) as w:
            w.write([3, 0, 5], [1, 2, 3], [0, 1, 3])
    assert (tmp_path / "megatron.idx").read_bytes() == (tmp_path / "tokenmill.idx").read_bytes()


def test_bin_readers_match_megatron(tmp_path: Path) -> None:
    prefix = write_megatron_shard(tmp_path / "r", random_documents(np.random.default_rng(3), 9))
    for reader in ("_MMapBinReader", "_FileBinReader"):
        theirs = getattr(THEIRS["indexed_dataset"], reader)(prefix + ".bin")
        ours = getattr(OURS["indexed_dataset"], reader)(prefix + ".bin")
        for offset, count in ((0, 5), (6, 20), (100, 1)):
            np.testing.assert_array_equal(
                ours.read(np.uint16, count, offset), theirs.read(np.uint16, count, offset)
            )
    with pytest.raises(NotImplementedError, match="msc://"):
        OURS["indexed_dataset"]._MultiStorageClientBinReader("msc://p/x.bin", None)


def test_the_mmap_bin_reader_keeps_no_descriptor_and_refuses_an_empty_file(
    tmp_path: Path,
) -> None:
    """megatron-core's reader keeps the descriptor of its numpy.memmap (one per source of a
    blend); tokenmill's keeps none. An empty .bin is a ValueError (numpy.memmap's refusal of an
    empty file, in megatron-core; not run here: it leaks its file object)."""
    prefix = write_megatron_shard(tmp_path / "r", random_documents(np.random.default_rng(5), 9))
    before = len(os.listdir("/proc/self/fd"))
    theirs = THEIRS["indexed_dataset"]._MMapBinReader(prefix + ".bin")
    kept = len(os.listdir("/proc/self/fd"))
    assert kept > before
    ours = OURS["indexed_dataset"]._MMapBinReader(prefix + ".bin")
    assert len(os.listdir("/proc/self/fd")) == kept
    np.testing.assert_array_equal(ours.read(np.uint16, 9, 4), theirs.read(np.uint16, 9, 4))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot map 0 bytes of .*empty\.bin"):
        OURS["indexed_dataset"]._MMapBinReader(str(empty))


# -- subclass hooks -------------------------------------------------------------------------


def _shard(tmp_path: Path, count: int = 60, seed: int = 4) -> str:
    rng = np.random.default_rng(seed)
    return write_megatron_shard(tmp_path / f"hooks{seed}", random_documents(rng, count, 120))


def _pair(mixin: type, tmp_path: Path, num_samples: int | None = 150, **overrides: Any) -> Any:
    """The same subclass body over megatron-core's GPTDataset and over tokenmill's."""
    megatron_gpt = THEIRS["gpt_dataset"]
    prefix = _shard(tmp_path)
    fields = {
        "random_seed": 5,
        "sequence_length": 32,
        "tokenizer": TinyTokenizer(),
        "blend": ([prefix], None),
        "split": "1",
        "reset_position_ids": True,
        "reset_attention_mask": False,
        "eod_mask_loss": True,
        "create_attention_mask": False,
        **overrides,
    }
    indices = np.arange(60, dtype=np.int32)
    their_class = type("InHouseDataset", (mixin, megatron_gpt.GPTDataset), {})
    our_class = type("InHouseDataset", (mixin, GPTDataset), {})
    utils = THEIRS["utils"]
    theirs = their_class(
        THEIRS["indexed_dataset"].IndexedDataset(prefix),
        prefix,
        indices,
        num_samples,
        utils.Split.train,
        megatron_gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), **fields),
    )
    ours = our_class(
        IndexedDataset(prefix),
        prefix,
        indices,
        num_samples,
        Split.train,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **fields),
    )
    return ours, theirs


def _same_everywhere(ours: Any, theirs: Any, rng_seed: int = 0) -> None:
    """Samples one by one, and batches through `__getitems__` + default_collate (what a
    DataLoader does), equal megatron-core's."""
    from torch.utils.data import default_collate

    compare_datasets(ours, theirs, np.random.default_rng(rng_seed), "subclass", limit=200)
    batch = list(range(min(len(theirs), 16)))
    expected = default_collate([theirs[i] for i in batch])
    fetched = ours.__getitems__(batch)
    assert isinstance(fetched, list)  # per-sample when __getitem__ / the query is overridden
    assert_same_sample(default_collate(fetched), expected, "batch")


def _of_the_installed_release(queried: Any) -> tuple[Any, ...]:
    """What the parent's `_query_document_sample_shuffle_indices` returned, checked to have the
    installed release's arity: (text, document_ids) before 0.19, (text, document_ids,
    document_lengths) from 0.19 (on either library's class: the subclass body is the same)."""
    assert len(queried) == (3 if megatron_version.query_returns_lengths() else 2)
    return tuple(queried)


class ReversedTokens:
    """An in-house dataset that rewrites each sample's tokens (like Megatron-LM's FIM dataset):
    overrides `_query_document_sample_shuffle_indices` as the installed release defines it."""

    def _query_document_sample_shuffle_indices(self, idx: int) -> Any:
        queried = super()._query_document_sample_shuffle_indices(idx)  # type: ignore[misc]
        text, *rest = _of_the_installed_release(queried)
        return (text[::-1].copy(), *rest)


class ShortText:
    """Returns fewer tokens than S + 1 (megatron's masks follow the text's length)."""

    def _query_document_sample_shuffle_indices(self, idx: int) -> Any:
        queried = super()._query_document_sample_shuffle_indices(idx)  # type: ignore[misc]
        text, *rest = _of_the_installed_release(queried)
        return (text[: len(text) - 5].astype(np.int32), *rest)


class ExtraKey:
    """Overrides `__getitem__` and adds a key (like megatron's multimodal mock dataset)."""

    def __getitem__(self, idx: int | None) -> Any:
        sample = super().__getitem__(idx)  # type: ignore[misc]
        sample["doubled"] = sample["tokens"] * 2
        return sample


class FixedOrder:
    """Overrides `_build_document_sample_shuffle_indices`: the parent's arrays, served unshuffled
    (the C++ build and cache stay out of the way, the gather still serves the samples)."""

    def _build_document_sample_shuffle_indices(self) -> Any:
        document_index, sample_index, shuffle_index = (
            super()._build_document_sample_shuffle_indices()  # type: ignore[misc]
        )
        return document_index, sample_index, np.arange(len(shuffle_index), dtype=np.uint32)


class FewerTokens:
    """Overrides `_get_num_tokens_per_epoch` (the sample count and epochs follow from it) and
    `_get_num_epochs` (recording that it is asked, with which token count)."""

    def _get_num_tokens_per_epoch(self) -> int:
        return int(super()._get_num_tokens_per_epoch()) - 7  # type: ignore[misc]

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        type(self).asked.append(num_tokens_per_epoch)  # type: ignore[attr-defined]
        return int(super()._get_num_epochs(num_tokens_per_epoch))  # type: ignore[misc]


class MoreKey:
    """Adds a config attribute to the cache description and hash (`_key_config_attributes`)."""

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return [
            "random_seed",
            "sequence_length",
            "split",
            "split_matrix",
            "tokenizer",
            "eod_mask_loss",
        ]


@pytest.mark.parametrize(
    "mixin", [ReversedTokens, ShortText, ExtraKey], ids=lambda cls: cls.__name__
)
def test_sample_hooks_are_honoured(tmp_path: Path, mixin: type) -> None:
    ours, theirs = _pair(mixin, tmp_path)
    assert ours.batch_layout() is None  # a blend then asks this member for samples one by one
    _same_everywhere(ours, theirs)


def test_sample_hook_override_is_said_once_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours, _ = _pair(ReversedTokens, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="tokenmill.datasets.gpt"):
        ours.__getitems__([0, 1])
        ours.__getitems__([2, 3])
    messages = [r.message for r in caplog.records if "sample by sample" in r.message]
    assert len(messages) == 1 and "_query_document_sample_shuffle_indices" in messages[0]


@pytest.mark.parametrize(
    "mixin",
    [FixedOrder, FewerTokens, MoreKey],
    ids=lambda cls: cls.__name__,
)
def test_index_hooks_are_honoured(tmp_path: Path, mixin: type) -> None:
    mixin.asked = []  # type: ignore[attr-defined]
    ours, theirs = _pair(mixin, tmp_path)
    if mixin is FewerTokens:
        calls = FewerTokens.asked  # type: ignore[attr-defined]
        assert len(calls) == 2 and calls[0] == calls[1]  # once per library, same tokens
    from torch.utils.data import default_collate

    compare_datasets(ours, theirs, np.random.default_rng(1), mixin.__name__, limit=200)
    batch = list(range(16))
    assert_same_sample(
        default_collate(ours.__getitems__(batch)),
        default_collate([theirs[i] for i in batch]),
        "batch",
    )
    assert ours.batch_layout() is not None  # the sample path was not overridden: C++ gather


def test_low_level_hooks_are_used_by_the_builder(tmp_path: Path) -> None:
    """`build_low_level_dataset` / `numel_low_level_dataset` are static methods the builder
    calls: a subclass that splits by document instead of by sequence gets the same datasets."""
    megatron_builder = THEIRS["blended_megatron_dataset_builder"]
    megatron_gpt = THEIRS["gpt_dataset"]
    prefix = _shard(tmp_path)

    class HalfCorpus:
        @staticmethod
        def numel_low_level_dataset(low_level_dataset: Any) -> int:
            return int(low_level_dataset.sequence_lengths.shape[0]) // 2

    fields = {
        "random_seed": 3,
        "sequence_length": 16,
        "tokenizer": TinyTokenizer(),
        "blend": ([prefix], None),
        "split": "8,1,1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = megatron_builder.BlendedMegatronDatasetBuilder(
            type("HalfCorpusDataset", (HalfCorpus, megatron_gpt.GPTDataset), {}),
            [40, 10, None],
            lambda: True,
            megatron_gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), **fields),
        ).build()
    ours = tokenmill.BlendedMegatronDatasetBuilder(
        type("HalfCorpusDataset", (HalfCorpus, GPTDataset), {}),
        [40, 10, None],
        lambda: True,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **fields),
    ).build()
    for mine, reference in zip(ours, theirs):
        compare_datasets(mine, reference, np.random.default_rng(0), "half corpus")


def test_megatron_indexed_dataset_gets_the_fast_path(tmp_path: Path) -> None:
    """A megatron-core IndexedDataset (mmap=True) given to tokenmill's GPTDataset is served by
    the C++ gather, from a view of megatron's own map; with mmap=False it takes the Python path
    (megatron's file reader has no mapped buffer), with the same samples."""
    prefix = _shard(tmp_path)
    fields = {
        "random_seed": 5,
        "sequence_length": 32,
        "tokenizer": TinyTokenizer(),
        "blend": ([prefix], None),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    indices = np.arange(60, dtype=np.int32)
    native = GPTDataset(
        IndexedDataset(prefix), prefix, indices, 300, Split.train,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "c"), **fields),
    )  # fmt: skip
    for mmap, fast in ((True, True), (False, False)):
        foreign = GPTDataset(
            THEIRS["indexed_dataset"].IndexedDataset(prefix, mmap=mmap), prefix, indices, 300,
            Split.train, GPTDatasetConfig(path_to_cache=str(tmp_path / "c"), **fields),
        )  # fmt: skip
        assert (foreign.batch_layout() is not None) is fast
        for idx in range(0, len(native), 7):
            assert_same_sample(foreign[idx], native[idx], f"mmap={mmap} {idx}")
        batch = list(range(20))
        assert_same_sample(foreign.get_batch(batch), native.get_batch(batch), f"mmap={mmap}")


# -- inputs megatron accepts ----------------------------------------------------------------

INPUTS: list[tuple[str, Callable[[], Any]]] = [
    ("list of ints", lambda: [1, 2, 3, 65535]),
    ("tuple", lambda: (4, 5)),
    ("int8 array", lambda: np.array([1, -0, 7], dtype=np.int8)),
    ("uint64 array", lambda: np.array([1, 2, 9], dtype=np.uint64)),
    ("int64 array", lambda: np.arange(10, dtype=np.int64)),
    ("bool array", lambda: np.array([True, False])),
    ("torch int64", lambda: torch.tensor([3, 4, 5])),
    ("torch int32 2-D", lambda: torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)),
    ("digit strings", lambda: ["1", "22", " 7"]),
    ("integral floats", lambda: [1.0, 2.0, 65535.0]),
    ("float array", lambda: np.array([6.0, 7.0], dtype=np.float32)),
    ("mixed ints and floats", lambda: [1, 2.0]),
    ("empty list", lambda: []),
]


@pytest.mark.parametrize(("name", "make"), INPUTS, ids=[name for name, _ in INPUTS])
def test_add_document_accepts_what_megatron_accepts(
    tmp_path: Path, name: str, make: Callable[[], Any]
) -> None:
    """The same `add_document` calls give byte-identical files (megatron-core converts with
    `numpy.array(x, dtype)`; so does tokenmill, refusing only values numpy would change)."""
    for library, builder_type in (
        ("megatron", THEIRS["indexed_dataset"].IndexedDatasetBuilder),
        ("tokenmill", IndexedDatasetBuilder),
    ):
        builder = builder_type(str(tmp_path / f"{library}.bin"), dtype=np.uint16)
        tokens = make()
        length = int(np.asarray(tokens).size)
        builder.add_document(tokens, [length])
        builder.add_document(make(), [length])
        builder.finalize(str(tmp_path / f"{library}.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"megatron{suffix}").read_bytes() == (
            tmp_path / f"tokenmill{suffix}"
        ).read_bytes(), (name, suffix)


@pytest.mark.parametrize(("name", "make"), INPUTS[:9], ids=[name for name, _ in INPUTS[:9]])
def test_add_item_takes_tensors_like_megatron_and_more(
    tmp_path: Path, name: str, make: Callable[[], Any]
) -> None:
    """megatron-core's `add_item` calls `tensor.numpy()` (torch tensors only); tokenmill takes
    the same tensors, and lists/arrays as well, with the bytes megatron would write for them."""
    ours = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.int32)
    theirs = THEIRS["indexed_dataset"].IndexedDatasetBuilder(
        str(tmp_path / "m.bin"), dtype=np.int32
    )
    value = make()
    ours.add_item(value)
    theirs.add_item(torch.as_tensor(np.asarray(value).astype(np.int64)))
    for builder, stem in ((ours, "t"), (theirs, "m")):
        builder.end_document()
        builder.finalize(str(tmp_path / f"{stem}.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"t{suffix}").read_bytes()


def test_values_numpy_would_change_are_refused(tmp_path: Path) -> None:
    """The documented difference: megatron-core wraps out-of-range numpy values and truncates
    fractions; tokenmill raises (OverflowError / ValueError) and writes nothing."""
    theirs = THEIRS["indexed_dataset"].IndexedDatasetBuilder(
        str(tmp_path / "m.bin"), dtype=np.uint16
    )
    theirs.add_document(np.array([70000, 65536 + 5]), [2])  # wraps to [4464, 5]
    theirs.add_document(np.array([1.5]), [1])  # truncates to 1
    theirs.finalize(str(tmp_path / "m.idx"))
    wrapped = THEIRS["indexed_dataset"].IndexedDataset(str(tmp_path / "m"))  # keep it: its
    assert wrapped[0].tolist() == [4464, 5]  # items are views of a map its __del__ closes
    ours = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.uint16)
    with pytest.raises(OverflowError, match="token 70000 does not fit uint16"):
        ours.add_document(np.array([70000, 65536 + 5]), [2])
    with pytest.raises(ValueError, match=r"whole numbers .* got 1\.5"):
        ours.add_document(np.array([1.5]), [1])
    assert len(ours.sequence_lengths) == 0


def test_multimodal_add_document_without_modes(tmp_path: Path) -> None:
    """Megatron-LM main (#5726) fixed `modes=None` for multimodal builders (0.16 to 0.19
    raise TypeError): tokenmill gives every sequence mode 0, as main does (and main's file is
    the same)."""
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint16, multimodal=True)
    builder.add_document([1, 2, 3, 4], [1, 3])
    assert builder.sequence_modes == [0, 0]  # main's test_builder compares the builder's list
    builder.finalize(str(tmp_path / "mm.idx"))
    assert IndexedDataset(str(tmp_path / "mm"), multimodal=True).sequence_modes.tolist() == [0, 0]
    theirs = THEIRS["indexed_dataset"].IndexedDatasetBuilder(
        str(tmp_path / "m.bin"), dtype=np.uint16, multimodal=True
    )
    if megatron_version.followed() < (0, 20):
        with pytest.raises(TypeError):
            theirs.add_document([1, 2, 3, 4], [1, 3])
        theirs.data_file.close()
        return
    theirs.add_document([1, 2, 3, 4], [1, 3])
    theirs.finalize(str(tmp_path / "m.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"mm{suffix}").read_bytes()


def test_builder_attributes_read_as_megatrons_lists(tmp_path: Path) -> None:
    """megatron-core's builder keeps `sequence_lengths`, `document_indices` and `sequence_modes`
    as lists, which Megatron-LM's tests (main's test_builder.py) compare with lists: tokenmill's
    compare, index, slice and grow as those lists do."""
    names = ("sequence_lengths", "document_indices", "sequence_modes")
    theirs = THEIRS["indexed_dataset"].IndexedDatasetBuilder(
        str(tmp_path / "m.bin"), dtype=np.int32, multimodal=True
    )
    ours = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.int32, multimodal=True)
    held = {name: getattr(ours, name) for name in names}
    for builder in (theirs, ours):
        builder.add_item(torch.tensor([1, 2, 3]), mode=1)
        builder.end_document()
        builder.add_document(np.array([4, 5, 6, 7, 8]), [3, 2], modes=[0, 2])
    for name in names:
        megatron_list, ours_values = getattr(theirs, name), getattr(ours, name)
        assert type(megatron_list) is list
        assert ours_values == megatron_list and megatron_list == ours_values
        assert held[name] == megatron_list  # read before the additions: live, as the list is
        assert list(ours_values) == megatron_list and len(ours_values) == len(megatron_list)
        assert ours_values[-1] == megatron_list[-1] and ours_values[1:] == megatron_list[1:]
        assert ours_values != megatron_list[:-1] and ours_values != tuple(megatron_list)
        assert np.asarray(ours_values).tolist() == megatron_list
    assert ours.sequence_lengths == [3, 3, 2] and ours.sequence_modes == [1, 0, 2]
    theirs.finalize(str(tmp_path / "m.idx"))
    ours.finalize(str(tmp_path / "t.idx"))


# -- deliberate differences -----------------------------------------------------------------


def test_loss_mask_leak_is_not_reproduced(tmp_path: Path) -> None:
    """megatron-core 0.19 hands the first sample its cached loss mask and then zeroes that
    sample's pad positions in place, so every later sample of the dataset object inherits zeros
    there (Megatron-LM #1269, #1711). tokenmill gives each sample its own mask. With megatron's
    mask cache turned off the two agree on every sample: the leak is the only difference."""
    megatron_gpt = THEIRS["gpt_dataset"]
    rng = np.random.default_rng(2)
    documents = random_documents(rng, 40, 50)
    for document in documents[::4]:
        document[len(document) // 2] = 7  # real pad tokens inside documents
    prefix = write_megatron_shard(tmp_path / "pads", documents)
    fields = {
        "random_seed": 1,
        "sequence_length": 24,
        "tokenizer": TinyTokenizer(pad=7),
        "blend": ([prefix], None),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    indices = np.arange(40, dtype=np.int32)

    def theirs(cache: bool) -> Any:
        dataset = megatron_gpt.GPTDataset(
            THEIRS["indexed_dataset"].IndexedDataset(prefix), prefix, indices, None,
            THEIRS["utils"].Split.train,
            megatron_gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), **fields),
        )  # fmt: skip
        dataset.masks_and_position_ids_are_cacheable = cache
        return dataset

    ours = GPTDataset(
        IndexedDataset(prefix), prefix, indices, None, Split.train,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **fields),
    )  # fmt: skip
    first = next(i for i in range(len(ours)) if float(ours[i]["loss_mask"].min()) == 0.0)
    leaky = theirs(cache=True)
    leaky[first]  # the first sample read writes its pad positions into the cached mask
    leaked = [
        i for i in range(len(ours)) if not torch.equal(leaky[i]["loss_mask"], ours[i]["loss_mask"])
    ]
    assert leaked, "megatron-core 0.19's cached loss mask no longer leaks: update docs/megatron.md"
    clean = theirs(cache=False)
    clean[first]
    for idx in range(len(ours)):
        assert_same_sample(ours[idx], clean[idx], f"sample {idx}")


def test_samples_share_only_an_unwritten_causal_mask(tmp_path: Path) -> None:
    """megatron-core hands every sample one cached attention_mask (and position_ids) object;
    tokenmill hands out one cached causal mask the same way (no per-sample [1, S, S] build) and
    no other shared tensor; a caller's in-place write to a mask never reaches a later sample
    (megatron's later samples see it). No PerformanceWarning on megatron's defaults."""
    from tokenmill.datasets.gpt import MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=1, sequence_length=64, tokenizer=TinyTokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True,
    )  # fmt: skip
    low = MockGPTDataset.build_low_level_dataset(None, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset = MockGPTDataset(low, None, np.arange(100, dtype=np.int32), 20, Split.train, config)
    first, second = dataset[0], dataset[1]
    assert first["attention_mask"] is second["attention_mask"]
    assert first["attention_mask"].shape == (1, 64, 64)
    first["position_ids"][:] = -1
    first["attention_mask"][:] = True
    third = dataset[2]
    assert int(second["position_ids"][5]) == 5 and not bool(third["attention_mask"][0, 5, 0])
    assert bool(third["attention_mask"][0, 0, 1])
    defaults = {"reset_position_ids": False, "eod_mask_loss": False, "create_attention_mask": True}
    for mixin in (_NoHooks, ExtraKey):  # the C++ gather and the per-sample Python path
        (tmp_path / mixin.__name__).mkdir()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours, theirs = _pair(mixin, tmp_path / mixin.__name__, num_samples=20, **defaults)
        assert not [w for w in caught if "megatron" not in w.filename], mixin
        for idx in range(len(ours)):
            assert_same_sample(ours[idx], theirs[idx], f"{mixin.__name__} sample {idx}")
        assert ours[0]["attention_mask"] is ours[1]["attention_mask"]


class _NoHooks:
    """A subclass body that overrides nothing."""


def _storage_layout(sample: dict[str, Any]) -> tuple[Any, ...]:
    """Bytes of the tokens' and labels' storages, and, when they share one, the labels' offset
    from the tokens in it."""
    tokens, labels = sample["tokens"], sample["labels"]
    shared = tokens.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr()
    return (
        tokens.untyped_storage().nbytes(),
        labels.untyped_storage().nbytes(),
        labels.data_ptr() - tokens.data_ptr() if shared else None,
    )


@pytest.mark.parametrize("extra_token", [True, False])
def test_a_samples_tokens_and_labels_are_laid_out_as_megatrons(
    tmp_path: Path, extra_token: bool
) -> None:
    """With the extra token (megatron's default) megatron-core's tokens and labels are the views
    `text[:-1]` and `text[1:]` of one S + 1 tensor: a kept sample holds one buffer, not two.
    tokenmill's samples are laid out the same way (what a kept sample costs:
    benchmarks/bench_attention_mask.py); without the extra token both return two tensors."""
    ours, theirs = _pair(
        _NoHooks, tmp_path, num_samples=20, add_extra_token_to_sequence=extra_token
    )
    for idx in (0, 7, None):
        mine, reference = ours[idx], theirs[idx]
        assert_same_sample(mine, reference, f"sample {idx}")
        assert _storage_layout(mine) == _storage_layout(reference), idx
    assert (_storage_layout(ours[3])[2] is not None) == extra_token


def test_samples_from_a_split_without_tokens_raise(tmp_path: Path) -> None:
    """megatron-core loops forever when samples are requested from a split with no tokens
    (its epoch loop adds 0 tokens per epoch); tokenmill raises ValueError. With num_samples=None
    both give the empty dataset (test_megatron_configs.py compares it)."""
    prefix = _shard(tmp_path)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=8, tokenizer=TinyTokenizer(), blend=([prefix], None),
        split="1", reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=str(tmp_path / "c"),
    )  # fmt: skip
    empty = np.arange(0, dtype=np.int32)
    with pytest.raises(ValueError, match="cannot draw 10 samples from a split with 0 tokens"):
        GPTDataset(IndexedDataset(prefix), prefix, empty, 10, Split.valid, config)
    dataset = GPTDataset(IndexedDataset(prefix), prefix, empty, None, Split.valid, config)
    assert len(dataset) == 0


def test_sequences_per_dataset_with_the_wrong_dtype_is_refused(tmp_path: Path) -> None:
    """`sequences_per_dataset` makes the reader take the token dtype from the tokenizer's
    vocabulary size instead of the `.idx` header. For an int32 shard read with a vocabulary of
    at most 65536 megatron-core reads every token as two uint16 halves; tokenmill sees that
    the `.bin` size disagrees and raises DataFormatError naming the file."""
    rng = np.random.default_rng(1)
    prefix = write_megatron_shard(tmp_path / "wide", random_documents(rng, 10, 30), np.int32)
    theirs = THEIRS["indexed_dataset"].IndexedDataset(
        prefix, fast_cache_load=True, sequences_per_dataset=(10, 11), dtype_code=8
    )
    assert len(theirs.get(0)) == int(theirs.sequence_lengths[0])  # silently the wrong tokens
    with pytest.raises(tokenmill.DataFormatError, match=r"wide\.bin"):
        IndexedDataset(prefix, fast_cache_load=True, sequences_per_dataset=(10, 11), dtype_code=8)


def _refusals(module: dict[str, Any], prefix: str) -> dict[str, Callable[[], object]]:
    """Bad configs and inputs megatron-core refuses with a failed assert, built through
    `module` (THEIRS or OURS)."""
    gpt, builder = module["gpt_dataset"], module["blended_megatron_dataset_builder"]
    config_module, utils = module["blended_megatron_dataset_config"], module["utils"]
    fields: dict[str, Any] = {
        "random_seed": 1, "sequence_length": 4, "tokenizer": TinyTokenizer(),
        "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
    }  # fmt: skip

    def config(**changes: Any) -> Callable[[], object]:
        return lambda: gpt.GPTDatasetConfig(**{**fields, **changes})

    weighted_per_split = [([prefix, prefix], [0.5, 0.5]), None, None]
    return {
        "split parts": lambda: config_module.parse_and_normalize_split("1,2,3,4"),
        "reset_position_ids": config(reset_position_ids=None),
        "tokenizer": config(tokenizer=None),
        "split with blend": config(blend=([prefix], None)),
        "blend weights": config(blend=([prefix, prefix], [1.0]), split="1"),
        "blend and blend_per_split": config(
            blend=([prefix], None), blend_per_split=[([prefix], None), None, None]
        ),
        "fast_cache_load": config(blend_per_split=[([prefix], None)] * 3, fast_cache_load=True),
        "defer_npy_index_mmap": config(
            blend=([prefix], None), split="1", defer_npy_index_mmap=True
        ),
        "blend_per_split length": config(blend_per_split=[([prefix], None)] * 2),
        "weighted blend_per_split without a size": lambda: builder.BlendedMegatronDatasetBuilder(
            gpt.GPTDataset,
            [None, None, None],
            lambda: True,
            gpt.GPTDatasetConfig(**fields, blend_per_split=weighted_per_split),
        ),
        "weights not normalised": lambda: builder._get_size_per_split_per_dataset(
            [0.5, 0.6], [10, 10, 10]
        ),
        "blend from list": lambda: utils.get_blend_from_list(["a", "b", "0.7", "c"]),
    }


def test_megatron_assertions_are_assertion_and_value_errors(tmp_path: Path) -> None:
    """Where megatron-core fails an assert on bad input, tokenmill raises
    MegatronAssertionError: an AssertionError (what megatron's callers and Megatron-LM's own
    tests catch, e.g. test_builder.py's weighted per-split blend without a size) and a
    ValueError whose message names the field."""
    prefix = _shard(tmp_path)
    theirs, ours = _refusals(THEIRS, prefix), _refusals(OURS, prefix)
    for case, make in theirs.items():
        with pytest.raises(AssertionError):
            make()
        with pytest.raises(tokenmill.MegatronAssertionError) as raised:
            ours[case]()
        assert isinstance(raised.value, AssertionError) and isinstance(raised.value, ValueError)
        assert str(raised.value), case
    with pytest.raises(AssertionError, match="at most 3 parts"):
        ours["split parts"]()
    with pytest.raises(ValueError, match="reset_position_ids must be set"):
        ours["reset_position_ids"]()
    with pytest.raises(AssertionError, match="the train split has weights but no size"):
        ours["weighted blend_per_split without a size"]()


def test_fast_cache_load_of_a_missing_cache_is_a_file_not_found_error(tmp_path: Path) -> None:
    """megatron-core assumes a hit and fails mapping the missing file; so does tokenmill (its
    CacheMissingError is a FileNotFoundError naming the entry), and it never builds one."""
    prefix = _shard(tmp_path)
    fields = {
        "random_seed": 5, "sequence_length": 32, "tokenizer": TinyTokenizer(),
        "blend_per_split": [([prefix], None), None, None], "reset_position_ids": False,
        "reset_attention_mask": False, "eod_mask_loss": False, "create_attention_mask": False,
        "path_to_cache": str(tmp_path / "empty"), "fast_cache_load": True,
    }  # fmt: skip
    megatron_gpt = THEIRS["gpt_dataset"]
    with pytest.raises(FileNotFoundError):
        megatron_gpt.GPTDataset(
            THEIRS["indexed_dataset"].IndexedDataset(prefix), prefix, None, 10,
            THEIRS["utils"].Split.train, megatron_gpt.GPTDatasetConfig(**fields),
        )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no valid cache"):
        GPTDataset(
            IndexedDataset(prefix), prefix, None, 10, Split.train, GPTDatasetConfig(**fields)
        )
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


def test_megatron_main_config_fields_are_accepted() -> None:
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=4, tokenizer=TinyTokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, sft_mock_dataset_config_json="{}",
        varlen_mock_dataset_config_json="{}", varlen_sbhd_validation=True,
        dynamic_context_parallel=True,
    )  # fmt: skip
    assert config.varlen_sbhd_validation and config.sft_mock_dataset_config_json == "{}"


def test_datasets_are_map_style_without_deriving_from_torch(tmp_path: Path) -> None:
    """megatron-core's dataset classes derive from torch.utils.data.Dataset; tokenmill's do not
    (importing them never imports torch). What torch offers through that base still works: the
    DataLoader and samplers need only `__len__`/`__getitem__`, and `a + b` is a ConcatDataset."""
    from torch.utils.data import ConcatDataset

    ours, _ = _pair(ExtraKey, tmp_path, num_samples=20)
    assert not isinstance(ours, torch.utils.data.Dataset)
    joined = ours + ours
    assert isinstance(joined, ConcatDataset) and len(joined) == 2 * len(ours)
    assert_same_sample(joined[len(ours) + 3], ours[3], "concat")
