"""Interop against the peers' own loader code: what tokenmill writes reads token-identically with
theirs, and what they write reads token-identically with tokenmill.

* Megatron-core 0.19.2: ``IndexedDataset`` over ``tokenmill tokenize`` output (EOD after each
  document by default, no EOD with ``--prepend-bos``), tokenmill over ``IndexedDatasetBuilder``.
* NeMo Automodel 0.7.0: its ``NanogptDataset`` over tokenmill's shards, every file count x reader
  count up to 4 x 4, BOS alignment on and off, against tokenmill's ``NanogptDataset``; its
  processor's ``.bos.idx`` (byte offsets) repaired by ``tokenmill convert --bos-token``.
* OLMo-core 3.0.0: ``NumpyFSLDataset`` over ``convert --to olmo`` output (and over a Megatron
  ``.bin``); tokenmill over files written by OLMo-core's ``memmap_to_write``.
* modded-nanogpt: its loader reads a shard's payload with one unbuffered ``readinto`` (reproduced
  here from the format, see :func:`modded_nanogpt_load`); shards at tokenmill's size cap read.

The peers are test dependencies installed by ``.ci/run`` (NeMo Automodel and OLMo-core with
``--no-deps`` plus what their loader modules import); a missing one fails these tests.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tokenmill.cli.main import main
from tokenmill.common.world import World
from tokenmill.datasets.memory_mapped import MemoryMappedDataset
from tokenmill.datasets.nanogpt import NanogptDataset
from tokenmill.formats.megatron import IndexedDataset, IndexedDatasetBuilder
from tokenmill.formats.nanogpt import (
    HEADER_BYTES,
    LEGACY_MAGIC,
    MAX_PAYLOAD_BYTES,
    NanogptShard,
    NanogptShardWriter,
    max_shard_tokens,
    write_nanogpt_shard,
)
from tokenmill.formats.token_dir import open_token_file

torch = pytest.importorskip("torch")  # tokenmill's datasets need it; CI installs it

BOS = 3
SEQ = 6

# NeMo's loader wraps a read-only memmap in a tensor, which torch warns about (its design, not a
# failure of the data)
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")


def require(distribution: str, version: str) -> None:
    """Fail (never skip) when a peer is missing or another version: CI installs it."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{distribution}=={version} is not installed; .ci/run installs it")
    assert found == version, f"{distribution} {found} installed, the interop tests pin {version}"


# --- Megatron-core ----------------------------------------------------------------------------


def megatron_indexed() -> Any:
    require("megatron-core", "0.19.2")
    with warnings.catch_warnings():  # torch.jit deprecations raised while megatron.core imports
        warnings.simplefilter("ignore", DeprecationWarning)
        from megatron.core.datasets import indexed_dataset

    return indexed_dataset


@pytest.mark.parametrize(
    ("flags", "documents"),
    [
        ([], [[97, 98, 257], [99, 257]]),  # EOD after each document; none for the empty one
        (["--prepend-bos"], [[256, 97, 98], [256, 99]]),  # BOS, and so no EOD
        (["--prepend-bos", "--append-eod"], [[256, 97, 98, 257], [256, 99, 257]]),
        (["--no-append-eod"], [[97, 98], [99]]),
    ],
)
def test_megatron_reads_tokenize_output(tmp_path: Path, flags: list[str], documents: list) -> None:
    indexed = megatron_indexed()
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "ab"}\n{"text": "c"}\n{"text": ""}\n')
    prefix = str(tmp_path / "out")
    assert main(["tokenize", str(corpus), "-o", prefix, "--workers", "0", "-q", *flags]) == 0
    theirs = indexed.IndexedDataset(prefix)
    assert [theirs[i].tolist() for i in range(len(theirs))] == documents
    ours = IndexedDataset(prefix)
    assert [ours[i].tolist() for i in range(len(ours))] == documents
    # the empty document is an empty entry of the document index, as preprocess_data.py makes it
    assert theirs.document_indices.tolist() == ours.document_indices.tolist() == [0, 1, 2, 2]


def test_tokenmill_reads_megatron_builder_output(tmp_path: Path) -> None:
    indexed = megatron_indexed()
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 60000, int(rng.integers(0, 50))) for _ in range(40)]
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.from_numpy(document), [len(document)])
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(str(tmp_path / "m"))
    assert [ours[i].tolist() for i in range(len(ours))] == [d.tolist() for d in documents]
    # and tokenmill's builder writes what megatron-core reads (byte identity is in
    # tests/test_indexed_dataset_megatron.py)
    mine = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.uint16)
    for document in documents:
        mine.add_document(document, [len(document)])
    mine.finalize(str(tmp_path / "t.idx"))
    theirs = indexed.IndexedDataset(str(tmp_path / "t"))
    assert [theirs[i].tolist() for i in range(len(theirs))] == [d.tolist() for d in documents]


# --- NeMo Automodel ---------------------------------------------------------------------------


def nemo_nanogpt() -> ModuleType:
    """NeMo Automodel's ``nanogpt_dataset`` module, loaded from the installed package's file.

    Loaded by path because the package's ``__init__`` chain imports NeMo's whole dependency set
    (transformers, datasets, ...), which this module does not use: it imports numpy and torch.
    """
    require("nemo-automodel", "0.7.0")
    spec = importlib.util.find_spec("nemo_automodel")  # finds without running __init__
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(
        spec.submodule_search_locations[0], "components", "datasets", "llm", "nanogpt_dataset.py"
    )
    module_spec = importlib.util.spec_from_file_location("nemo_nanogpt_dataset", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # its dataclasses look their module up there
    module_spec.loader.exec_module(module)
    return module


def nemo_epoch(
    module: ModuleType, files: list[str], align: bool, reader: int, total: int
) -> list[tuple[int, ...]]:
    """One epoch of NeMo's reader ``reader`` of ``total`` (DataLoader workers, no process group):
    its own file assignment and window loop, each file once."""
    module.get_worker_info = lambda: SimpleNamespace(id=reader, num_workers=total)  # type: ignore[attr-defined]
    dataset = module.NanogptDataset(files, SEQ, bos_token=BOS, align_to_bos=align)
    worker_files, _, split, start, end = dataset._setup_worker_context(dataset.files, False)
    windows = [
        (*sample["input_ids"], sample["labels"][-1])
        for path in worker_files
        for sample in dataset._process_file_tokens(path, split, start, end)
    ]
    if windows:  # the public, endless iterator agrees, and its epoch ends where this one does
        endless = itertools.islice(iter(dataset), len(windows) + 1)
        public = [(*s["input_ids"], s["labels"][-1]) for s in endless]
        assert public[:-1] == windows and public[-1] == windows[0]
    return windows


def tokenmill_epoch(files: list[str], align: bool, reader: int, total: int) -> list[tuple]:
    dataset = NanogptDataset(files, SEQ, bos_token=BOS, align_to_bos=align)
    dataset.world = World(0, 1, reader, total)
    return [(*s["input_ids"].tolist(), int(s["labels"][-1])) for s in dataset]


def write_shards(directory: Path, count: int, seed: int) -> list[str]:
    """Shards of varied sizes and both dtypes (uint16 with modded-nanogpt's magic, uint32 with
    NeMo's), BOS at random places; a .bos.idx beside some, so NeMo both looks positions up and
    scans."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        size = int(rng.integers(40, 260))
        tokens = rng.integers(10, 60000, size)
        tokens[rng.random(size) < 0.12] = BOS
        path = directory / f"shard_{i}.bin"
        dtype = np.uint16 if i % 2 == 0 else np.uint32
        write_nanogpt_shard(path, tokens, dtype, bos_token=BOS if i != 1 else None)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("files", [1, 2, 3, 4])
def test_nemo_reads_what_tokenmill_reads_for_every_split(
    tmp_path: Path, files: int, align: bool
) -> None:
    module = nemo_nanogpt()
    paths = write_shards(tmp_path, files, seed=files)
    for total in (1, 2, 3, 4):
        for reader in range(total):
            theirs = nemo_epoch(module, paths, align, reader, total)
            try:
                ours = tokenmill_epoch(paths, align, reader, total)
            except ValueError:  # tokenmill refuses a dataset with no window at all
                assert not any(nemo_epoch(module, paths, align, g, total) for g in range(total)), (
                    files,
                    total,
                )
                continue
            assert ours == theirs, (files, total, reader)


def test_nemo_single_file_with_more_readers_than_windows(tmp_path: Path) -> None:
    """A reader whose token range holds no window yields nothing in both."""
    module = nemo_nanogpt()
    path = tmp_path / "s.bin"
    write_nanogpt_shard(path, np.arange(10, 30), np.uint16)
    for reader in range(4):  # 20 tokens over 4 readers: 5 each, no window of 7
        assert nemo_epoch(module, [str(path)], False, reader, 4) == []
    with pytest.raises(ValueError, match="no window"):
        tokenmill_epoch([str(path)], False, 0, 4)


def nemo_processor_shard(path: Path, documents: list[list[int]], itemsize: int) -> None:
    """A shard laid out as NeMo's tools/nanogpt_data_processor.py writes it (that script is not
    in the wheel): magic 278895051, header[3] = bytes per token, one write per document, and the
    ``.bos.idx`` as that writer fills it, int32 (file offset in bytes before the document,
    header included) + (index of each BOS within the document)."""
    header = np.zeros(256, "<i4")
    header[:4] = [278895051, 1, sum(map(len, documents)), itemsize]
    body, index, offset = [], [], HEADER_BYTES
    for document in documents:
        array = np.asarray(document, dtype=f"<u{itemsize}")
        index += (offset + np.flatnonzero(array == BOS)).tolist()
        body.append(array.tobytes())
        offset += array.nbytes
    path.write_bytes(header.tobytes() + b"".join(body))
    path.with_suffix(".bos.idx").write_bytes(np.asarray(index, "<i4").tobytes())


@pytest.mark.parametrize("itemsize", [2, 4])
def test_nemo_processor_output_repaired_by_convert(tmp_path: Path, itemsize: int) -> None:
    module = nemo_nanogpt()
    rng = np.random.default_rng(itemsize)
    documents = [[BOS, *rng.integers(10, 60000, int(rng.integers(3, 30))).tolist()] for _ in range(40)]  # fmt: skip
    source = tmp_path / "nemo"
    source.mkdir()
    nemo_processor_shard(source / "dataset.bin", documents, itemsize)
    flat = [t for d in documents for t in d]
    assert NanogptShard(source / "dataset.bin").tokens.tolist() == flat  # tokenmill reads theirs
    (truth := tmp_path / "truth").mkdir()
    write_nanogpt_shard(truth / "dataset.bin", flat, f"uint{8 * itemsize}", bos_token=BOS)
    expected = nemo_epoch(module, [str(truth / "dataset.bin")], True, 0, 1)
    assert all(window[0] == BOS for window in expected) and len(expected) > 5
    # NeMo's own reader takes its writer's byte offsets for token positions: windows off BOS
    broken = nemo_epoch(module, [str(source / "dataset.bin")], True, 0, 1)
    assert broken != expected
    # tokenmill refuses that index, and convert --bos-token rebuilds it from the tokens
    with pytest.raises(Exception, match=r"dataset\.bos\.idx"):
        list(NanogptDataset(str(source / "dataset.bin"), SEQ, bos_token=BOS, align_to_bos=True))
    repaired = tmp_path / "repaired"
    assert main(["convert", str(source), str(repaired), "--to", "nanogpt", "--bos-token", str(BOS), "-q"]) == 0  # fmt: skip
    fixed = str(repaired / "dataset.bin")
    assert nemo_epoch(module, [fixed], True, 0, 1) == expected
    assert tokenmill_epoch([fixed], True, 0, 1) == expected


# --- OLMo-core --------------------------------------------------------------------------------


def olmo_fsl(paths: list[str], length: int, dtype: Any, work_dir: Path) -> list[list[int]]:
    require("ai2-olmo-core", "3.0.0")
    from olmo_core.data import NumpyFSLDataset

    dataset = NumpyFSLDataset(
        *paths, sequence_length=length, pad_token_id=0, eos_token_id=BOS, vocab_size=2**17,
        dtype=dtype,
    )  # fmt: skip
    dataset.work_dir = work_dir
    dataset.prepare()
    return [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_olmo_reads_convert_to_olmo_output(tmp_path: Path, dtype: Any) -> None:
    rng = np.random.default_rng(5)
    documents = [rng.integers(0, 60000, int(rng.integers(1, 90))) for _ in range(30)]
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=dtype)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "corpus.idx"))
    out = tmp_path / "olmo"
    assert main(["convert", str(tmp_path / "corpus"), str(out), "--to", "olmo", "-q"]) == 0
    olmo_dtype = np.uint16 if dtype == np.uint16 else np.uint32  # int32 becomes uint32
    length = 16
    theirs = olmo_fsl([str(out / "corpus.npy")], length, olmo_dtype, tmp_path / "work")
    flat = np.concatenate(documents)
    expected = [flat[i * length : (i + 1) * length].tolist() for i in range(len(flat) // length)]
    assert theirs == expected
    ours = MemoryMappedDataset(out, length + 0)  # seq_len counts the label token
    assert [
        [*ours[i]["input_ids"].tolist(), int(ours[i]["labels"][-1])] for i in range(len(ours))
    ] == expected
    # OLMo-core also reads tokenmill's Megatron .bin as raw tokens when told the dtype
    if dtype == np.uint16:
        megatron_bin = olmo_fsl([str(tmp_path / "corpus.bin")], length, np.uint16, tmp_path / "w2")
        assert megatron_bin == expected


def test_tokenmill_reads_olmo_memmap_output(tmp_path: Path) -> None:
    require("ai2-olmo-core", "3.0.0")
    from olmo_core.data.utils import memmap_to_write

    rng = np.random.default_rng(9)
    arrays = {"part-0-00000.npy": rng.integers(0, 2**17, 1000).astype(np.uint32),
              "part-0-00001.npy": rng.integers(0, 2**17, 333).astype(np.uint32)}  # fmt: skip
    for name, array in arrays.items():
        with memmap_to_write(tmp_path / "olmo" / name, shape=array.shape, dtype=np.uint32) as m:
            m[:] = array
    files = sorted((tmp_path / "olmo").glob("*.npy"))
    assert [f.name for f in files] == sorted(arrays)
    for path in files:
        assert not path.read_bytes().startswith(b"\x93NUMPY")  # OLMo-core's headerless layout
        assert open_token_file(path, np.uint32).tolist() == arrays[path.name].tolist()
    ours = MemoryMappedDataset(tmp_path / "olmo", 10, dtype=np.uint32)
    theirs = olmo_fsl([str(p) for p in files], 10, np.uint32, tmp_path / "work")
    assert len(ours) == len(theirs) == 100 + 33
    assert all(
        [*ours[i]["input_ids"].tolist(), int(ours[i]["labels"][-1])] == theirs[i]
        for i in range(len(ours))
    )
    prefix = str(tmp_path / "meg")
    assert main(["convert", str(tmp_path / "olmo"), prefix, "--to", "megatron", "--dtype", "uint32", "-q"]) == 0  # fmt: skip
    megatron = IndexedDataset(prefix)
    assert [megatron[i].tolist() for i in range(len(megatron))] == [
        arrays[name].tolist() for name in sorted(arrays)
    ]


# --- modded-nanogpt ---------------------------------------------------------------------------


def modded_nanogpt_load(path: str | os.PathLike[str], buffer: np.ndarray | None = None) -> Any:
    """modded-nanogpt's shard loader, from the format: check the 256 x int32 header (magic
    20240520, version 1), then read the N uint16 tokens with ONE unbuffered ``readinto`` of the
    whole payload, and insist it returned every byte ("number of tokens read does not match
    header")."""
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[0] == LEGACY_MAGIC, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    count = int(header[2])
    tokens = np.empty(count, dtype=np.uint16) if buffer is None else buffer[:count]
    with open(path, "rb", buffering=0) as stream:
        stream.seek(HEADER_BYTES)
        read = stream.readinto(memoryview(tokens).cast("B"))
    assert read == 2 * count, "number of tokens read does not match header?"
    return tokens


def test_modded_nanogpt_reads_converted_shards(tmp_path: Path) -> None:
    tokens = np.random.default_rng(2).integers(0, 50257, 5000).astype(np.uint16)
    tokens.tofile(tmp_path / "raw.bin")
    out = tmp_path / "n"
    assert main(["convert", str(tmp_path / "raw.bin"), str(out), "--to", "nanogpt", "--dtype", "uint16", "--shard-tokens", "1200", "-q"]) == 0  # fmt: skip
    shards = sorted(out.glob("raw_*.bin"))
    assert len(shards) == 5
    assert np.concatenate([modded_nanogpt_load(p) for p in shards]).tolist() == tokens.tolist()
    # and tokenmill reads what modded-nanogpt's fineweb.py writes: the same header and payload
    assert NanogptShard(shards[0]).tokens.tolist() == tokens[:1200].tolist()


def test_a_shard_at_the_cap_reads_with_one_readinto(tmp_path: Path) -> None:
    """The cap is exactly what one read returns on Linux: a shard of max_shard_tokens(uint16)
    tokens reads whole, one token more does not. Sparse files (no disk) and one 2 GiB buffer."""
    count = max_shard_tokens(np.uint16)
    assert count * 2 == MAX_PAYLOAD_BYTES and HEADER_BYTES + MAX_PAYLOAD_BYTES < 2**31 - 1
    buffer = np.empty(count + 1, dtype=np.uint16)
    for tokens, reads in ((count, True), (count + 1, False)):
        path = tmp_path / f"shard_{tokens}.bin"
        header = np.zeros(256, "<i4")
        header[:4] = [LEGACY_MAGIC, 1, tokens, 2]
        with open(path, "wb") as stream:
            stream.write(header.tobytes())
            stream.truncate(HEADER_BYTES + 2 * tokens)  # a hole: zero tokens, no disk
        if reads:
            assert modded_nanogpt_load(path, buffer).shape[0] == count
        else:
            with pytest.raises(AssertionError, match="does not match header"):
                modded_nanogpt_load(path, buffer)
        path.unlink()
    del buffer
    # tokenmill's writer refuses a token past the cap (a zero-stride array: no memory)
    writer = NanogptShardWriter(tmp_path / "full.bin", np.uint16)
    with pytest.raises(OverflowError, match=f"at most {count} uint16 tokens"):
        writer.write(np.broadcast_to(np.uint16(1), (count + 1,)))
    writer.abort()
    assert not list(tmp_path.iterdir())
