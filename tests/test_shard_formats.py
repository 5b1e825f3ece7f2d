"""modded-nanogpt shards, .bos.idx sidecars and .npy/raw token directories.

Files are written here straight from the documented layouts (numpy/struct), independently of
tokenmill's writers, and read back token for token; bad files raise DataFormatError naming them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from tokenmill.errors import DataFormatError
from tokenmill.formats.bos_index import (
    bos_index_path,
    check_bos_positions,
    read_bos_index,
    write_bos_index,
)
from tokenmill.formats.nanogpt import (
    LEGACY_MAGIC,
    MAGIC,
    NanogptShard,
    NanogptShardWriter,
    read_nanogpt_header,
    write_nanogpt_shard,
)
from tokenmill.formats.token_dir import (
    NpyShardWriter,
    guess_raw_dtype,
    list_token_files,
    open_token_file,
    write_raw_metadata,
)


def raw_nanogpt(path: Path, tokens: np.ndarray, magic: int, itemsize: int | None = None,
                version: int = 1, count: int | None = None) -> Path:  # fmt: skip
    """A shard written from the spec: 256 little-endian int32, then the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:4] = [magic, version, len(tokens) if count is None else count, itemsize or 0]
    dtype = "<u2" if magic == LEGACY_MAGIC or itemsize == 2 else "<u4"
    path.write_bytes(header.tobytes() + np.asarray(tokens).astype(dtype).tobytes())
    return path


@pytest.mark.parametrize(
    ("magic", "itemsize", "dtype"),
    [(LEGACY_MAGIC, None, np.uint16), (MAGIC, 2, np.uint16), (MAGIC, 4, np.uint32)],
)
def test_reads_independently_written_shards(tmp_path: Path, magic: int, itemsize: int | None,
                                            dtype: type) -> None:  # fmt: skip
    high = 2**16 if dtype == np.uint16 else 2**32
    tokens = np.random.default_rng(0).integers(0, high, 1000, dtype=np.int64)
    path = raw_nanogpt(tmp_path / "a.bin", tokens, magic, itemsize)
    shard = NanogptShard(path)
    assert shard.dtype == np.dtype(dtype) and len(shard) == 1000
    np.testing.assert_array_equal(shard.tokens, tokens)
    assert not shard.tokens.flags.writeable
    assert shard.header.legacy == (magic == LEGACY_MAGIC)


def test_writer_layout_is_the_spec(tmp_path: Path) -> None:
    write_nanogpt_shard(tmp_path / "a.bin", [1, 2, 3])
    data = (tmp_path / "a.bin").read_bytes()
    assert struct.unpack("<4i", data[:16]) == (LEGACY_MAGIC, 1, 3, 2)  # legacy: uint16
    assert data[16:1024] == bytes(1008) and data[1024:] == b"\x01\x00\x02\x00\x03\x00"
    write_nanogpt_shard(tmp_path / "b.bin", [70000])
    data = (tmp_path / "b.bin").read_bytes()
    assert struct.unpack("<4i", data[:16]) == (MAGIC, 1, 1, 4)
    assert data[1024:] == struct.pack("<I", 70000)
    write_nanogpt_shard(tmp_path / "c.bin", [5], np.uint16, legacy=False)
    assert struct.unpack("<4i", (tmp_path / "c.bin").read_bytes()[:16]) == (MAGIC, 1, 1, 2)


def test_writer_refuses_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(OverflowError, match="65536 does not fit uint16"):
        write_nanogpt_shard(tmp_path / "a.bin", [1, 65536], np.uint16)
    with pytest.raises(OverflowError, match="-1 does not fit"):
        write_nanogpt_shard(tmp_path / "a.bin", [-1], np.uint32)
    with pytest.raises(ValueError, match="uint16 or uint32"):
        NanogptShardWriter(tmp_path / "a.bin", np.int32)
    with pytest.raises(ValueError, match="legacy magic"):
        NanogptShardWriter(tmp_path / "a.bin", np.uint32, legacy=True)
    assert list(tmp_path.iterdir()) == []


def test_streaming_writer_with_bos_index(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    with NanogptShardWriter(path, np.uint32, bos_token=7) as writer:
        writer.write([7, 1, 2])
        writer.write(np.array([7, 7, 3], dtype=np.int64))
    np.testing.assert_array_equal(NanogptShard(path).tokens, [7, 1, 2, 7, 7, 3])
    sidecar = Path(bos_index_path(path))
    assert sidecar.name == "s.bos.idx"
    assert sidecar.read_bytes() == np.array([0, 3, 4], "<i4").tobytes()  # NeMo's layout


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h, t: (h.__setitem__(0, 1234), t), "magic"),
        (lambda h, t: (h.__setitem__(1, 2), t), "version"),
        (lambda h, t: (h.__setitem__(2, 11), t), "truncated"),
        (lambda h, t: (h.__setitem__(2, 9), t), "longer than its header"),
        (lambda h, t: (h.__setitem__(2, -1), t), "token count"),
        (lambda h, t: (h.__setitem__(3, 3), t), "bytes per token"),
    ],
)
def test_bad_shards_name_the_file(tmp_path: Path, mutate: object, message: str) -> None:
    header = np.zeros(256, dtype="<i4")
    header[:4] = [MAGIC, 1, 10, 2]
    tokens = np.arange(10, dtype="<u2")
    mutate(header, tokens)  # type: ignore[operator]
    path = tmp_path / "bad.bin"
    path.write_bytes(header.tobytes() + tokens.tobytes())
    with pytest.raises(DataFormatError, match=message) as error:
        NanogptShard(path)
    assert str(path) in str(error.value)


def test_short_file(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(struct.pack("<3i", LEGACY_MAGIC, 1, 0))
    with pytest.raises(DataFormatError, match=r"short\.bin.*shorter than the 1024-byte"):
        read_nanogpt_header(path)


# --- .bos.idx ------------------------------------------------------------------------------------


def test_bos_index_int32_is_nemo_layout(tmp_path: Path) -> None:
    path = tmp_path / "a.bos.idx"
    path.write_bytes(np.array([0, 5, 9], dtype="<i4").tobytes())  # what NeMo's reader reads
    index = read_bos_index(path, token_count=10)
    assert index.positions.tolist() == [0, 5, 9] and not index.wide and index.bos_token is None
    write_bos_index(tmp_path / "b.bos.idx", [0, 5, 9])
    assert (tmp_path / "b.bos.idx").read_bytes() == path.read_bytes()


def test_bos_index_int64_variant(tmp_path: Path) -> None:
    big = [3, 2**31 + 5, 2**33]
    write_bos_index(tmp_path / "w.bos.idx", big, token_count=2**34, bos_token=42)
    data = (tmp_path / "w.bos.idx").read_bytes()
    assert data[:4] == b"\xff\xff\xff\xff" and data[4:12] == b"TMBOSIDX"
    assert struct.unpack("<Iqq", data[12:32]) == (1, 3, 42)
    assert data[32:] == np.array(big, "<i8").tobytes()
    index = read_bos_index(tmp_path / "w.bos.idx", token_count=2**34)
    assert index.wide and index.bos_token == 42 and index.positions.tolist() == big
    write_bos_index(tmp_path / "f.bos.idx", [1, 2], wide=True)  # forced
    assert read_bos_index(tmp_path / "f.bos.idx").wide
    with pytest.raises(OverflowError, match="int32"):
        write_bos_index(tmp_path / "g.bos.idx", big, wide=False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (np.array([0, 5, 3], "<i4").tobytes(), r"strictly ascending.*position\[1\] = 5"),
        (np.array([0, 4, 4], "<i4").tobytes(), "strictly ascending"),
        (np.array([-3, 4], "<i4").tobytes(), "negative"),
        (np.array([0, 10], "<i4").tobytes(), r"position\[1\] = 10 is out of range.*10 tokens"),
        (b"\x00\x00\x00", "whole number"),
        (b"\xff\xff\xff\xff" + b"NOTMAGIC" + bytes(20), "magic"),
        (b"\xff\xff\xff\xff" + b"TMBOS", "header"),
        (struct.pack("<i8sIqq", -1, b"TMBOSIDX", 1, 5, -1) + bytes(8), "5 int64 positions"),
        (struct.pack("<i8sIqq", -1, b"TMBOSIDX", 9, 0, -1), "version 9"),
    ],
)
def test_bad_bos_index(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.bos.idx"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match=message) as error:
        read_bos_index(path, token_count=10)
    assert str(path) in str(error.value)


def test_positions_must_hold_bos(tmp_path: Path) -> None:
    tokens = np.array([50256, 1, 2, 50256, 4], dtype=np.uint16)
    check_bos_positions("x", tokens, np.array([0, 3]), 50256)
    # NeMo's processor: file.tell() (1024-byte header + 2 bytes per token) + index
    with pytest.raises(DataFormatError, match=r"holds token .* not the BOS token 50256"):
        check_bos_positions("x", tokens, np.array([1, 4]), 50256)


# --- .npy / raw directories ----------------------------------------------------------------------


def test_npy_and_raw_files(tmp_path: Path) -> None:
    tokens = np.arange(12, dtype=np.uint16)
    np.save(tmp_path / "a.npy", tokens)
    np.testing.assert_array_equal(open_token_file(tmp_path / "a.npy"), tokens)
    with pytest.raises(DataFormatError, match="header says dtype uint16"):
        open_token_file(tmp_path / "a.npy", np.uint32)
    (tmp_path / "r.bin").write_bytes(tokens.astype("<u2").tobytes())  # 24 bytes: % 4 == 0
    with pytest.raises(DataFormatError, match=r"r\.bin.*ambiguous"):
        open_token_file(tmp_path / "r.bin")
    np.testing.assert_array_equal(open_token_file(tmp_path / "r.bin", np.uint16), tokens)
    assert guess_raw_dtype(tmp_path / "r.bin") == np.uint32  # KempnerForge's guess is wrong here
    assert open_token_file(tmp_path / "r.bin", guess_dtype=True).dtype == np.uint32
    write_raw_metadata(tmp_path, np.uint16)
    np.testing.assert_array_equal(open_token_file(tmp_path / "r.bin", guess_dtype=True), tokens)
    (tmp_path / "odd.bin").write_bytes(bytes(6))
    with pytest.raises(DataFormatError, match="whole number of uint32"):
        open_token_file(tmp_path / "odd.bin", np.uint32)
    assert [p.name for p in list_token_files(tmp_path, "*.npy")] == ["a.npy"]
    with pytest.raises(FileNotFoundError, match=r"\*\.zz"):
        list_token_files(tmp_path, "*.zz")


def test_raw_reader_refuses_nanogpt_headers(tmp_path: Path) -> None:
    path = raw_nanogpt(tmp_path / "n.bin", np.arange(10), LEGACY_MAGIC)
    for kwargs in ({"guess_dtype": True}, {"dtype": np.uint16}):
        with pytest.raises(DataFormatError, match=r"n\.bin: starts with a modded-nanogpt header"):
            open_token_file(path, **kwargs)  # type: ignore[arg-type]


def test_bad_npy(tmp_path: Path) -> None:
    np.save(tmp_path / "two.npy", np.zeros((2, 2), np.int32))
    np.save(tmp_path / "float.npy", np.zeros(3, np.float32))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    junk = r"junk\.npy: not a valid \.npy file .*OLMo-core token file.*dtype is ambiguous"
    for name, message in [("two", "1-D"), ("float", "integers"), ("junk", junk)]:
        with pytest.raises(DataFormatError, match=message):
            open_token_file(tmp_path / f"{name}.npy")


def test_npy_writer_streams_exact_files(tmp_path: Path) -> None:
    with NpyShardWriter(tmp_path / "a.npy", np.uint32, 5) as writer:
        writer.write([1, 2])
        writer.write(np.array([3, 4, 5], np.int64))
    assert np.load(tmp_path / "a.npy").tolist() == [1, 2, 3, 4, 5]
    with (
        pytest.raises(ValueError, match="2 tokens written, 3 announced"),
        NpyShardWriter(tmp_path / "b.npy", np.uint16, 3) as writer,
    ):
        writer.write([1, 2])
    with (
        pytest.raises(OverflowError, match="does not fit"),
        NpyShardWriter(tmp_path / "c.npy", np.uint16, 1) as writer,
    ):
        writer.write([70000])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]


def test_opened_shards_hold_no_descriptor(tmp_path: Path) -> None:
    """Shards of every format are mapped without keeping their descriptor (map, then close):
    a run over thousands of shards must not need a descriptor per shard (ulimit -n)."""
    import os

    from tokenmill.formats.sources import open_source

    tokens = np.arange(1, 4097, dtype=np.uint16)
    for number in range(8):
        write_nanogpt_shard(tmp_path / f"s{number}.bin", tokens)
        (tmp_path / f"raw{number}.tok").write_bytes(tokens.astype("<u2").tobytes())
    before = len(os.listdir("/proc/self/fd"))
    opened = [NanogptShard(tmp_path / f"s{number}.bin") for number in range(8)]
    opened += [open_token_file(tmp_path / f"raw{number}.tok", np.uint16) for number in range(8)]
    assert len(os.listdir("/proc/self/fd")) == before
    for shard in opened[:8]:
        np.testing.assert_array_equal(shard.tokens, tokens)  # type: ignore[union-attr]
    for array in opened[8:]:
        np.testing.assert_array_equal(array, tokens)
    # the sources `tokenmill convert` and `inspect` read: a Megatron prefix, a shard directory
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    (tmp_path / "megatron").mkdir()
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron" / "m.bin"), dtype=np.uint16)
    builder.add_document(tokens, [len(tokens)])
    builder.finalize(str(tmp_path / "megatron" / "m.idx"))
    sources = [open_source(str(tmp_path / "megatron" / "m")), open_source(str(tmp_path))]
    assert len(os.listdir("/proc/self/fd")) == before
    np.testing.assert_array_equal(sources[0].shards[0].tokens, tokens)
    assert sources[1].format == "nanogpt" and len(sources[1].shards) == 8
