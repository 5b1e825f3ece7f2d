"""Fuzz harnesses: one per on-disk parser, each a function of the raw bytes of one file.

Every harness writes its input to a fresh file (a new name each time: replacing a file that an
earlier input still maps would be a SIGBUS, not a parser bug), runs the parser, and then uses
whatever the parser accepted (reads every sequence, token or sample), because a parser that
accepts a file is promising that using it is safe. A harness returns True when the input was
accepted and False when the parser rejected it with one of its *documented* exception types
(listed in ``ALLOWED``). Any other exception escapes: that is a finding. So do crashes and hangs,
which atheris reports (``tests/fuzz/run_fuzz.py``).

The same functions are replayed by ``tests/test_fuzz_smoke.py`` (seed corpus plus random
mutations, a few thousand inputs, no atheris needed) and run for >= 10^6 executions each under
atheris; commands and results are in ``docs/reliability.md``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import CacheError, DataFormatError
from tokenmill.formats import bos_index, nanogpt, token_dir
from tokenmill.formats import dataset_sidecar as tokenizer_sidecar
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.formats.megatron_index import _IndexReader
from tokenmill.index import fingerprint as data_fingerprint
from tokenmill.index.cache import EntrySpec, IndexCache

__all__ = ["ALLOWED", "HARNESSES", "seeds", "set_workdir"]

_state: dict[str, Any] = {"dir": None, "counter": itertools.count()}
_MAX_ITEMS = 64  # sequences / samples read from an accepted input (keeps one execution short)
_MAX_BIN_BYTES = 1 << 20
# Samples (rows) a cache-entry harness serves from an accepted entry, per path: every one it has.
# One file is fuzzed per input and the load's checks tie its length to the untouched files, so an
# accepted entry has exactly its fixture's count (58 GPT samples, 31 packed rows; a blend's 16 are
# fixed by its specs); the cap never cuts a campaign input short. It bounds one execution (about
# 0.1 ms per sample and path) should a fixture grow or a check loosen.
_MAX_SAMPLES = 4096


def set_workdir(directory: str | os.PathLike[str]) -> None:
    """Where harnesses write their inputs (default: a temporary directory under $TMPDIR)."""
    _state["dir"] = Path(directory)
    for fixture in ("gpt", "packing", "blended"):  # built again in the new directory
        _state.pop(fixture, None)
    Path(directory).mkdir(parents=True, exist_ok=True)


def _workdir() -> Path:
    if _state["dir"] is None:
        set_workdir(tempfile.mkdtemp(prefix="tokenmill-fuzz-"))
    directory: Path = _state["dir"]
    return directory


def _fresh(suffix: str, data: bytes, stem: str = "input") -> Path:
    """Write `data` to a new file `<stem>-<n><suffix>` and remove the previous input's file."""
    directory = _workdir()
    number = next(_state["counter"])
    previous = directory / f"{stem}-{number - 1}{suffix}"
    with contextlib.suppress(FileNotFoundError):
        previous.unlink()
    path = directory / f"{stem}-{number}{suffix}"
    path.write_bytes(data)
    return path


def _split(data: bytes) -> tuple[int, bytes]:
    """A selector byte (0 for empty input) and the rest."""
    return (data[0], data[1:]) if data else (0, b"")


# -- Megatron .idx (+ .bin) ----------------------------------------------------------------------


def megatron_idx(data: bytes) -> bool:
    """`.idx` parser, then the `.bin` reads it permits (mmap and pread paths, multimodal)."""
    selector, body = _split(data)
    multimodal, mmap = bool(selector & 1), bool(selector & 2)
    idx_path = _fresh(".idx", body, "megatron")
    prefix = str(idx_path)[: -len(".idx")]
    try:
        reader = _IndexReader(str(idx_path), multimodal)
        reader.validate()
        bin_size = reader.expected_bin_size()
    except DataFormatError:
        return False
    if not 0 <= bin_size <= _MAX_BIN_BYTES:
        return True  # a valid index whose .bin would be too big to write per execution
    bin_path = prefix + ".bin"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(bin_path)
    with open(bin_path, "wb") as stream:
        stream.truncate(bin_size)
    try:
        dataset = IndexedDataset(prefix, multimodal=multimodal, mmap=mmap)
    except DataFormatError:
        return False
    reads: tuple[Callable[[int], Any], ...] = (
        lambda sequence: dataset[sequence],
        lambda sequence: dataset.get(sequence, 0, None),
        lambda sequence: dataset[sequence : sequence + 2],
    )
    for sequence in range(min(len(dataset), _MAX_ITEMS)):
        for read in reads:
            with contextlib.suppress(DataFormatError, IndexError):
                read(sequence)
    os.unlink(bin_path)
    return True


# -- modded-nanogpt shard header -----------------------------------------------------------------


def nanogpt_header(data: bytes) -> bool:
    """`read_nanogpt_header` and `NanogptShard` (maps the tokens and sums them)."""
    path = _fresh(".bin", data, "nanogpt")
    nanogpt.is_nanogpt_shard(path)
    try:
        nanogpt.read_nanogpt_header(path)
        shard = nanogpt.NanogptShard(path)
    except DataFormatError:
        return False
    int(shard.tokens.sum(dtype=np.uint64))
    return True


# -- .bos.idx ------------------------------------------------------------------------------------


def bos_idx(data: bytes) -> bool:
    """`read_bos_index`, with and without a token count (the first 4 bytes), then
    `check_bos_positions` against a synthetic token array."""
    selector, body = _split(data)
    token_count: int | None = None
    if selector & 1 and len(body) >= 4:
        token_count = struct.unpack_from("<I", body)[0] % 4096
        body = body[4:]
    path = _fresh(".bos.idx", body, "bos")
    try:
        index = bos_index.read_bos_index(path, token_count)
    except DataFormatError:
        return False
    if token_count is not None:
        tokens = np.arange(token_count, dtype=np.uint16) % 7
        with contextlib.suppress(DataFormatError):
            bos_index.check_bos_positions(str(path), tokens, index.positions, 0)
    return True


# -- .npy token files and raw token directories --------------------------------------------------


def npy_tokens(data: bytes) -> bool:
    """`open_token_file` on a `.npy`, or on a raw file described by a fuzzed `tokenmill.json`."""
    selector, body = _split(data)
    try:
        if selector & 1:
            # raw file + sidecar: the first byte (after the selector) is the sidecar length
            length = body[0] if body else 0
            sidecar, raw = body[1 : 1 + length], body[1 + length :]
            directory = _workdir() / f"raw-{next(_state['counter'])}"
            directory.mkdir()
            (directory / token_dir.RAW_METADATA_NAME).write_bytes(sidecar)
            (directory / "tokens.bin").write_bytes(raw)
            try:
                tokens = token_dir.open_token_file(directory / "tokens.bin")
                int(tokens.sum(dtype=np.uint64)) if tokens.size else 0
            finally:
                for path in directory.iterdir():
                    path.unlink()
                directory.rmdir()
        else:
            path = _fresh(".npy", body, "tokens")
            tokens = token_dir.open_token_file(path, np.uint16 if selector & 2 else None)
            if tokens.size:
                int(tokens[: 1 << 16].astype(np.int64).sum())
    except DataFormatError:
        return False
    return True


# -- index cache: .npy arrays, description, and the samples they select ---------------------------


class _FuzzTokenizer:
    def __init__(self) -> None:
        self.vocab_size, self.eod = 64, 0
        self.unique_identifiers = {"class": "FuzzTokenizer"}


def _gpt_config(directory: Path, seed: int, **fields: Any) -> Any:
    """The GPTDatasetConfig of the fixtures: 8-token samples, a cache in `directory`."""
    from tokenmill.datasets.gpt import GPTDatasetConfig

    values: dict[str, Any] = {
        "random_seed": seed,
        "sequence_length": 8,
        "tokenizer": _FuzzTokenizer(),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
        "path_to_cache": str(directory / "cache"),
    }
    return GPTDatasetConfig(**{**values, **fields})


def _gpt_fixture() -> dict[str, Any]:
    """A tiny shard and a GPTDataset with a valid cache entry, built once per work directory."""
    if "gpt" in _state:
        fixture: dict[str, Any] = _state["gpt"]
        return fixture
    import warnings

    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.datasets.utils import Split
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    # a directory of its own per process: a rewritten shard would make the cache entry stale
    directory = Path(tempfile.mkdtemp(prefix="gpt-", dir=_workdir()))
    prefix = str(directory / "corpus")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(12):
        length = int(rng.integers(1, 30))
        builder.add_document(np.append(rng.integers(1, 50, length), 0), [length + 1])
    builder.finalize(prefix + ".idx")

    config = _gpt_config(directory, 1, reset_position_ids=True, eod_mask_loss=True)
    low_level = IndexedDataset(prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = GPTDataset(
            low_level, prefix, np.arange(len(low_level), dtype=np.int32), 40, Split.train, config
        )
    cache = dataset._cache
    assert cache is not None
    fixture = {
        "dataset": dataset,
        "cache": cache,
        "specs": dataset._array_specs(dataset._plan()),
        "files": {name: cache.array_path(name).read_bytes() for name in cache.array_names},
        "description": cache.description_path.read_bytes(),
    }
    _state["gpt"] = fixture
    return fixture


def cache_entry(data: bytes) -> bool:
    """A cache entry with one fuzzed file (the description or one of the three `.npy` arrays):
    `IndexCache.load` must report problems instead of raising, `load_or_build` on a non-building
    rank raises only CacheError, and an accepted entry must serve every sample, or raise
    IndexError / CacheError / DataFormatError (never read out of bounds), on both sample paths
    (the C++ gather, one by one and batched, and the Python path)."""
    from tokenmill.datasets import gpt as gpt_module

    fixture = _gpt_fixture()
    cache: IndexCache = fixture["cache"]
    selector, body = _split(data)
    names = ("description", *cache.array_names)
    target = names[selector % len(names)]
    # restore every file, then replace one (through a new inode: old mappings stay valid)
    for name in cache.array_names:
        content = body if name == target else fixture["files"][name]
        path = cache.array_path(name)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.write_bytes(content)
    description = body if target == "description" else fixture["description"]
    with contextlib.suppress(FileNotFoundError):
        cache.description_path.unlink()
    cache.description_path.write_bytes(description)

    loose = {name: spec.__class__(spec.dtypes, ndim=spec.ndim or None) for name, spec in
             fixture["specs"].items()}  # fmt: skip
    cache.load(loose)  # never raises: problems are returned
    try:
        arrays, _ = cache.load_or_build(
            EntrySpec(fixture["specs"], data_check="off"), _never_build, may_build=False
        )
    except CacheError:
        return False
    dataset = fixture["dataset"]
    try:
        dataset._check_consistency(arrays)
    except CacheError:
        return False
    dataset.document_index = arrays["document_index"]
    dataset.sample_index = arrays["sample_index"]
    dataset.shuffle_index = arrays["shuffle_index"]
    dataset._server = gpt_module._UNSET
    count = min(len(dataset), _MAX_SAMPLES)  # every sample: a corrupt row may be the last
    for sample in range(count):
        with contextlib.suppress(IndexError, CacheError, DataFormatError):
            dataset[sample]
        with contextlib.suppress(IndexError, CacheError, DataFormatError):
            dataset._getitem_python(sample)
    if count:
        with contextlib.suppress(IndexError, CacheError, DataFormatError):
            dataset.get_batch(list(range(count)))
    return True


# -- packing plan: the cached rows of a PackedDataset and the C++ packed gather --------------------


def _packing_fixture() -> dict[str, Any]:
    """A tiny shard and a PackedDataset whose plan is cached, built once per work directory."""
    if "packing" in _state:
        fixture: dict[str, Any] = _state["packing"]
        return fixture
    from tokenmill.datasets.packed import PackedDataset, PackingConfig
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    directory = Path(tempfile.mkdtemp(prefix="packing-", dir=_workdir()))
    prefix = str(directory / "corpus")
    rng = np.random.default_rng(1)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(20):
        length = int(rng.integers(1, 40))
        builder.add_document(rng.integers(1, 50, length), [length])
    builder.finalize(prefix + ".idx")
    config = PackingConfig(
        sequence_length=16, max_documents_per_row=4, window_overlap=2,
        path_to_cache=str(directory / "cache"),
    )  # fmt: skip
    dataset = PackedDataset(IndexedDataset(prefix), config)
    # the same plan over the unmapped source: PackedDataset's Python row path (_row_arrays)
    unmapped = PackedDataset(IndexedDataset(prefix, mmap=False), config)
    cache = IndexCache.create(
        config.path_to_cache, dataset.unique_description_hash, "PackedDataset", "plan",
        dataset.unique_description, ("entries", "row_offsets", "row_order"),
    )  # fmt: skip
    fixture = {
        "dataset": dataset,
        "unmapped": unmapped,
        "cache": cache,
        "files": {name: cache.array_path(name).read_bytes() for name in cache.array_names},
    }
    _state["packing"] = fixture
    return fixture


def packing_plan(data: bytes) -> bool:
    """A cached packing plan with one fuzzed array (`entries`, `row_offsets`, `row_order`): a
    non-building rank's load (the specs and value checks PackedDataset uses) refuses it with
    CacheError or DataFormatError, or the plan it accepts serves every row, one by one and
    batched, or raises IndexError / DataFormatError (never reads out of bounds). Each row is
    served by the C++ packed gather (the fixture's mapped source) and by PackedDataset's Python
    row path (`_row_arrays`, the same plan over an unmapped source): both raise, or both give
    the same row."""
    from tokenmill.index.cache import ArraySpec
    from tokenmill.index.cache_checks import packing_checks

    fixture = _packing_fixture()
    cache: IndexCache = fixture["cache"]
    selector, body = _split(data)
    names = cache.array_names
    target = names[selector % len(names)]
    for name in names:
        path = cache.array_path(name)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.write_bytes(body if name == target else fixture["files"][name])
    int64 = (np.dtype(np.int64),)
    checks = packing_checks()
    specs = {
        "entries": ArraySpec(int64, ndim=2),
        "row_offsets": ArraySpec(int64, ndim=1, values=checks["row_offsets"]),
        "row_order": ArraySpec(int64, ndim=1, values=checks["row_order"]),
    }
    try:
        arrays, _ = cache.load_or_build(
            EntrySpec(specs, data_check="off"), _never_build, may_build=False
        )
    except (CacheError, DataFormatError):
        return False
    dataset, unmapped = fixture["dataset"], fixture["unmapped"]
    for served in (dataset, unmapped):
        served.entries = arrays["entries"]
        served.row_offsets = arrays["row_offsets"]
        served.row_order = arrays["row_order"]
    count = min(len(dataset), _MAX_SAMPLES)  # every row: a corrupt entry may be in the last
    for row in range(count):
        rows = []
        for served in (dataset, unmapped):
            try:
                rows.append(served[row])
            except (IndexError, CacheError, DataFormatError) as error:
                rows.append(type(error))
        gathered, python = rows
        if isinstance(gathered, dict) and isinstance(python, dict):
            differ = [key for key in gathered if not np.array_equal(gathered[key], python[key])]
            if differ:
                raise AssertionError(f"row {row}: the C++ and Python paths differ in {differ}")
        elif isinstance(gathered, dict) or isinstance(python, dict):
            raise AssertionError(
                f"row {row}: C++ path {gathered!r:.60}, Python path {python!r:.60}"
            )
    if count:
        with contextlib.suppress(IndexError, CacheError, DataFormatError):
            dataset.__getitems__(list(range(count)))
    return True


# -- blend cache: a BlendedDataset's dataset_index / dataset_sample_index and the samples served ---


def _blended_fixture() -> dict[str, Any]:
    """Two tiny shards, a GPTDataset over each and a BlendedDataset of them whose blend indices
    are cached (written by BlendedDataset itself), built once per work directory."""
    if "blended" in _state:
        fixture: dict[str, Any] = _state["blended"]
        return fixture
    import warnings

    from tokenmill.datasets.blended import BlendedDataset
    from tokenmill.datasets.gpt import GPTDataset
    from tokenmill.datasets.utils import Split
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    directory = Path(tempfile.mkdtemp(prefix="blended-", dir=_workdir()))

    config = _gpt_config(directory, 2)
    rng = np.random.default_rng(2)
    members = []
    for number, (documents, samples) in enumerate([(10, 12), (6, 5)]):
        prefix = str(directory / f"member{number}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(documents):
            length = int(rng.integers(1, 20))
            builder.add_document(np.append(rng.integers(1, 50, length), 0), [length + 1])
        builder.finalize(prefix + ".idx")
        low_level = IndexedDataset(prefix)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            members.append(
                GPTDataset(
                    low_level, prefix, np.arange(len(low_level), dtype=np.int32), samples,
                    Split.train, config,
                )
            )  # fmt: skip
    from tokenmill.index.cache import vouching

    with vouching() as vouched:  # what the builder checked, for trusting_builder
        blend = BlendedDataset(members, [0.6, 0.4], 16, config)
    cache = blend._cache
    assert cache is not None
    # the writer's files, hard-linked: restoring one keeps its size, mtime and inode, so the
    # data fingerprint beside the entry still vouches for it (and for no fuzzed file)
    pristine = directory / "pristine"
    pristine.mkdir()
    paths = {name: cache.array_path(name) for name in cache.array_names}
    paths["description"] = cache.description_path
    for name, path in paths.items():
        os.link(path, pristine / name)
    fixture = {
        "blend": blend,
        "evidence": dict(vouched),
        "cache": cache,
        "specs": blend._specs(),
        "servers": [member._serving() for member in members],
        "paths": paths,
        "pristine": {name: pristine / name for name in paths},
        "files": {name: cache.array_path(name).read_bytes() for name in cache.array_names},
        "description": cache.description_path.read_bytes(),
    }
    _state["blended"] = fixture
    return fixture


def load_blended_entry(data: bytes) -> dict[str, Any]:
    """Replace one file of the blend's cache entry by `data[1:]` and load the entry as a rank
    that does not build it does: with the blend's data check, then, unless it trusts the builders,
    as a deferred (`defer_npy_index_mmap`) load too. `data[0] & 0x7F` (mod 3) picks the
    description, `dataset_index` or `dataset_sample_index`; bit 0x80 makes the rank trust the
    builders' verdict (`trusting_builder`: structure checked, values not).

    Raises:
        CacheError: the entry is missing, unreadable, or its arrays do not fit the blend (wrong
            dtype or length, a dataset id outside the members, a sample id past its member).
    """
    from tokenmill.index.cache import trusting_builder

    fixture = _blended_fixture()
    cache: IndexCache = fixture["cache"]
    selector, body = _split(data)
    names = ("description", *cache.array_names)
    target = names[(selector & 0x7F) % len(names)]
    trusting = selector >= 0x80
    # restore every file (a hard link to the writer's), then replace one through a new inode
    # (old mappings stay valid; the data fingerprint no longer vouches for the entry)
    for name, path in fixture["paths"].items():
        original = fixture["pristine"][name]
        if name != target and os.stat(path).st_ino == os.stat(original).st_ino:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if name == target:
            path.write_bytes(body)
        else:
            os.link(original, path)
    blend = fixture["blend"]
    with trusting_builder(fixture["evidence"]) if trusting else contextlib.nullcontext():
        spec = EntrySpec(
            fixture["specs"], data_prefixes=blend.data_prefixes(), data_check=blend._data_check()
        )
        arrays, _ = cache.load_or_build(spec, _never_build, may_build=False)
    if not trusting:
        blend._data_verified = True  # checked by the load above
        deferred = blend._load_cached("defer_npy_index_mmap")
        for name in cache.array_names:
            if not np.array_equal(arrays[name], deferred[name]):
                raise AssertionError(f"the two loads of {name} differ")
    return arrays


def blended_cache(data: bytes) -> bool:
    """A BlendedDataset's cache entry with one fuzzed file (the description, `dataset_index` or
    `dataset_sample_index`): the loads of a rank that does not build refuse it with CacheError,
    or every sample of the blend they accept (a trusting rank's: unchecked values) is served through the C++ paths (the members' one-sample gather, the
    blend's batched gather) and through the Python path (the members' per-document path), or
    raises IndexError / DataFormatError (never reads out of bounds)."""
    fixture = _blended_fixture()
    try:
        arrays = load_blended_entry(data)
    except CacheError:
        return False
    blend = fixture["blend"]
    blend.dataset_index = arrays["dataset_index"]
    blend.dataset_sample_index = arrays["dataset_sample_index"]
    count = len(blend)
    members = blend.datasets
    try:
        for servers in (fixture["servers"], [None] * len(members)):  # C++, then Python
            for member, server in zip(members, servers):
                member._server = server
            for sample in range(count):
                with contextlib.suppress(IndexError, DataFormatError):
                    blend[sample]
            if count:
                with contextlib.suppress(IndexError, DataFormatError):
                    blend.get_batch(list(range(count)))
                with contextlib.suppress(IndexError, DataFormatError):
                    blend.__getitems__([count - 1, 0])
    finally:
        for member, server in zip(members, fixture["servers"]):
            member._server = server
    return True


def _never_build() -> dict[str, Any]:
    raise AssertionError("a non-building rank must not build")


# -- tokenizer fingerprint sidecar (formats/dataset_sidecar.py) ---------------------------------------


_TOKENIZER = {"kind": "bytes", "sha256": "0" * 64, "vocab_size": 258, "bos_id": 256, "eod_id": 257}


def tokenizer_fingerprint(data: bytes) -> bool:
    """`read_sidecar`, `check_tokenizer` and `check_compatible` on a fuzzed sidecar."""
    path = _fresh(tokenizer_sidecar.SIDECAR_SUFFIX, data, "dataset")
    prefix = str(path)[: -len(tokenizer_sidecar.SIDECAR_SUFFIX)]
    try:
        tokenizer_sidecar.read_sidecar(prefix)
    except DataFormatError:
        return False
    for check in (
        lambda: tokenizer_sidecar.check_tokenizer(prefix, _TOKENIZER),
        lambda: tokenizer_sidecar.check_compatible([prefix, prefix]),
    ):
        with contextlib.suppress(DataFormatError):
            check()
    return True


# -- data fingerprint sidecar of a cache entry (index/fingerprint.py) ------------------------------


def data_fingerprint_sidecar(data: bytes) -> bool:
    """`read_fingerprint`, then `differences` against a real fingerprint and `stale_reasons`."""
    fixture = _gpt_fixture()
    prefix = fixture["dataset"].dataset.path_prefix
    path = _fresh(".json", data, "fingerprint")
    try:
        recorded = data_fingerprint.read_fingerprint(path)
    except DataFormatError:
        return False
    current = data_fingerprint.fingerprint_prefixes([prefix])
    if recorded is not None:
        data_fingerprint.differences(recorded, current)
        data_fingerprint.differences(current, recorded)
    data_fingerprint.stale_reasons([prefix], path, fixture["cache"].description_path)
    return True


# -- mixture configs (datasets/mixture_config.py, when present) ----------------------------------


def mixture_config(data: bytes) -> bool:
    """`MixtureConfig.from_file` on a fuzzed `.toml` or `.yaml`, then a dict round trip."""
    from tokenmill.datasets import mixture_config as module  # type: ignore[attr-defined]

    selector, body = _split(data)
    path = _fresh((".toml", ".yaml")[selector & 1], body, "mixture")
    try:
        config = module.MixtureConfig.from_file(path)
    except module.MixtureConfigError:
        return False
    module.MixtureConfig.from_dict(config.to_dict())
    return True


def _has_mixture_configs() -> bool:
    try:
        return importlib.util.find_spec("tokenmill.datasets.mixture_config") is not None
    except ImportError:
        return False


# -- registry ------------------------------------------------------------------------------------


HARNESSES: dict[str, Callable[[bytes], bool]] = {
    "megatron_idx": megatron_idx,
    "nanogpt_header": nanogpt_header,
    "bos_idx": bos_idx,
    "npy_tokens": npy_tokens,
    "cache_entry": cache_entry,
    "packing_plan": packing_plan,
    "blended_cache": blended_cache,
    "tokenizer_fingerprint": tokenizer_fingerprint,
    "data_fingerprint": data_fingerprint_sidecar,
}
if _has_mixture_configs():  # the mixture config parser lands with the mixtures branch
    HARNESSES["mixture_config"] = mixture_config

ALLOWED: dict[str, tuple[type[BaseException], ...]] = {
    "megatron_idx": (DataFormatError, IndexError),
    "nanogpt_header": (DataFormatError,),
    "bos_idx": (DataFormatError,),
    "npy_tokens": (DataFormatError,),
    "cache_entry": (CacheError, IndexError, DataFormatError),
    "packing_plan": (CacheError, IndexError, DataFormatError),
    "blended_cache": (CacheError, IndexError, DataFormatError),
    "tokenizer_fingerprint": (DataFormatError,),
    "data_fingerprint": (DataFormatError,),
    "mixture_config": (ValueError,),  # MixtureConfigError (a TokenmillError and ValueError)
}
"""The exception types each parser documents (what a harness swallows)."""


# -- seed corpus ---------------------------------------------------------------------------------


def _megatron_seeds() -> list[bytes]:
    directory = _workdir() / "seeds"
    directory.mkdir(exist_ok=True)
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    found = []
    for number, (dtype, lengths) in enumerate(
        [(np.uint16, [3, 1, 4]), (np.int32, [5]), (np.uint8, []), (np.int64, [2, 2, 0, 7])]
    ):
        for multimodal in (False, True):
            prefix = str(directory / f"m{number}-{int(multimodal)}")
            builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
            for length in lengths:
                builder.add_item(np.arange(length) % 100, mode=length % 3)
                builder.end_document()
            builder.finalize(prefix + ".idx")
            raw = Path(prefix + ".idx").read_bytes()
            found += [bytes([selector | int(multimodal)]) + raw for selector in (0, 2)]
    return found


def _nanogpt_seeds() -> list[bytes]:
    found = []
    for number, (dtype, count) in enumerate([(np.uint16, 5), (np.uint32, 3), (np.uint16, 0)]):
        path = _workdir() / "seeds" / f"n{number}.bin"
        path.parent.mkdir(exist_ok=True)
        nanogpt.write_nanogpt_shard(path, np.arange(count, dtype=dtype))
        found.append(path.read_bytes())
    return found


def _bos_seeds() -> list[bytes]:
    narrow = np.array([0, 7, 14], dtype="<i4").tobytes()
    wide = struct.pack("<i8sIqq", -1, b"TMBOSIDX", 1, 2, 0) + np.array([0, 9], "<i8").tobytes()
    count = struct.pack("<I", 21)
    return [b"\x00" + narrow, b"\x01" + count + narrow, b"\x00" + wide, b"\x01" + count + wide]


def _npy_seeds() -> list[bytes]:
    found = []
    for array in (np.arange(5, dtype=np.uint16), np.arange(3, dtype=">i4"), np.zeros(0, np.int64)):
        stream = io.BytesIO()
        np.save(stream, array)
        found.append(b"\x00" + stream.getvalue())
        if array.dtype == np.uint16:
            found.append(b"\x02" + stream.getvalue())  # dtype=uint16 requested
    sidecar = json.dumps({"dtype": "uint16"}).encode()
    found.append(b"\x01" + bytes([len(sidecar)]) + sidecar + np.arange(4, dtype="<u2").tobytes())
    return found


def _cache_seeds() -> list[bytes]:
    fixture = _gpt_fixture()
    cache: IndexCache = fixture["cache"]
    names = ("description", *cache.array_names)
    found = [bytes([0]) + fixture["description"]]
    found += [bytes([names.index(n)]) + fixture["files"][n] for n in cache.array_names]
    return found


def _tokenizer_seeds() -> list[bytes]:
    payload = {
        "format": "tokenmill.dataset",
        "version": 1,
        "tokenizer": _TOKENIZER,
        "dtype": "uint16",
        "documents": 3,
    }
    other = dict(payload, tokenizer=dict(_TOKENIZER, vocab_size=300))
    return [json.dumps(payload).encode(), json.dumps(other, indent=1).encode()]


def _fingerprint_seeds() -> list[bytes]:
    fixture = _gpt_fixture()
    payload = data_fingerprint.fingerprint_prefixes([fixture["dataset"].dataset.path_prefix])
    return [json.dumps(payload).encode(), json.dumps(data_fingerprint.fingerprint_prefixes([]))]


def _mixture_seeds() -> list[bytes]:
    toml = (
        b"seed = 3\nchunk_tokens = 8\n[sources.s0]\npaths = ['s0']\n[sources]\ns1 = 's1'\n"
        b"[[phases]]\nname = 'a'\ntokens = 1_000\nweights = { s0 = 1, s1 = 0.5 }\n"
    )
    yaml = (
        b"seed: 3\nchunk_tokens: 8\nsources:\n  s0: {paths: [s0]}\n  s1: s1\nphases:\n"
        b"- {name: a, tokens: 1000, weights: {s0: 1, s1: 0.5}}\n"
    )
    return [b"\x00" + toml, b"\x01" + yaml]


def _packing_seeds() -> list[bytes]:
    fixture = _packing_fixture()
    names = fixture["cache"].array_names
    return [bytes([number]) + fixture["files"][name] for number, name in enumerate(names)]


def _blended_seeds() -> list[bytes]:
    fixture = _blended_fixture()
    names = ("description", *fixture["cache"].array_names)
    found = [bytes([0]) + fixture["description"]]
    found += [bytes([names.index(n)]) + fixture["files"][n] for n in names[1:]]
    return found


def seeds(name: str) -> list[bytes]:
    """Valid inputs of harness `name` (its seed corpus), written by tokenmill's own writers."""
    makers: dict[str, Callable[[], list[Any]]] = {
        "megatron_idx": _megatron_seeds,
        "nanogpt_header": _nanogpt_seeds,
        "bos_idx": _bos_seeds,
        "npy_tokens": _npy_seeds,
        "cache_entry": _cache_seeds,
        "packing_plan": _packing_seeds,
        "blended_cache": _blended_seeds,
        "tokenizer_fingerprint": _tokenizer_seeds,
        "data_fingerprint": _fingerprint_seeds,
        "mixture_config": _mixture_seeds,
    }
    return [item if isinstance(item, bytes) else item.encode() for item in makers[name]()]
