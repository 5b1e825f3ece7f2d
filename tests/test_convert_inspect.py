"""`tokenmill convert` round trips (lossless across the three layouts) and `tokenmill inspect`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli.main import main
from tokenmill.errors import DataFormatError
from tokenmill.formats.megatron import IndexedDataset

from conftest import random_documents, write_megatron_shard


def tokens_of(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trips_are_lossless(tmp_path: Path, dtype: type) -> None:
    documents = random_documents(np.random.default_rng(1), 60, vocab_size=70000 if dtype == np.int32 else 1000)  # fmt: skip
    source = write_megatron_shard(tmp_path / "m", documents, dtype)
    run = lambda *args: main(["convert", *map(str, args), "--quiet", "--chunk-tokens", "500"])  # noqa: E731
    assert run(source, tmp_path / "ng", "--to", "nanogpt") == 0
    assert run(tmp_path / "ng", tmp_path / "np", "--to", "npy") == 0
    assert run(tmp_path / "np", tmp_path / "ng2", "--to", "nanogpt") == 0
    assert run(tmp_path / "ng2", tmp_path / "back", "--to", "megatron", "--eos-token", 0) == 0
    assert tokens_of(str(tmp_path / "back")) == documents
    for suffix in (".bin", ".idx"):  # byte-identical to the independently written original
        assert (tmp_path / f"back{suffix}").read_bytes() == Path(source + suffix).read_bytes()
    assert run(source, tmp_path / "np2", "--to", "npy") == 0
    assert run(tmp_path / "np2", tmp_path / "back2", "--to", "megatron", "--eos-token", 0) == 0
    assert tokens_of(str(tmp_path / "back2")) == documents


def test_bos_index_survives_and_defines_documents(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    documents = [[5, *rng.integers(6, 100, int(rng.integers(1, 30))).tolist()] for _ in range(20)]
    source = write_megatron_shard(tmp_path / "m", documents)
    assert main(["convert", source, str(tmp_path / "ng"), "--to", "nanogpt", "--bos-token", "5", "--quiet"]) == 0  # fmt: skip
    positions = np.fromfile(tmp_path / "ng" / "m.bos.idx", dtype="<i4")
    assert positions.tolist() == np.cumsum([0] + [len(d) for d in documents[:-1]]).tolist()
    assert main(["convert", str(tmp_path / "ng"), str(tmp_path / "np"), "--to", "npy", "--quiet"]) == 0  # fmt: skip
    assert main(["convert", str(tmp_path / "np"), str(tmp_path / "back"), "--to", "megatron", "--quiet"]) == 0  # fmt: skip
    assert tokens_of(str(tmp_path / "back")) == documents  # documents from the .bos.idx


def test_convert_refuses_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    np.save(tmp_path / "neg.npy", np.array([1, -2, 3], dtype=np.int64))
    assert main(["convert", str(tmp_path / "neg.npy"), str(tmp_path / "out"), "--to", "nanogpt", "--quiet"]) == 1  # fmt: skip
    assert "-2 does not fit uint32" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.bin"))


def inspect_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["inspect", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_inspect_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    documents = [[1, 2, 0], [3, 0], [4, 5, 6, 7, 0]]
    source = write_megatron_shard(tmp_path / "m", documents)
    code, report = inspect_json(capsys, source, "--eos-token", "0")
    assert code == 0 and report["ok"]
    assert report["format"] == "megatron" and report["dtype"] == "uint16"
    assert (report["tokens"], report["documents"], report["eos_count"]) == (10, 3, 3)
    assert report["document_length_percentiles"] == {"p0": 2, "p50": 3, "p90": 3, "p99": 3, "p100": 5}  # fmt: skip
    assert report["first_tokens"] == [1, 2, 0, 3, 0, 4, 5, 6, 7, 0]
    code, report = inspect_json(capsys, source, "--eos-token", "7")  # documents do not end with 7
    assert code == 1 and not report["ok"]
    main(["convert", source, str(tmp_path / "ng"), "--to", "nanogpt", "--bos-token", "3", "--quiet"])  # fmt: skip
    code, report = inspect_json(capsys, str(tmp_path / "ng" / "m.bin"))
    assert code == 0 and report["bos_token_from_index"] == 3 and report["magic"] == 20240520
    assert report["documents"] == 2  # [1, 2, 0] before the first BOS, then [3, 0, 4, 5, 6, 7, 0]


@pytest.mark.parametrize(
    ("content", "message"),
    [(np.array([3, 1], "<i4"), "strictly ascending"), (np.array([0, 99], "<i4"), "out of range")],
)
def test_inspect_fails_on_bad_bos_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: np.ndarray, message: str
) -> None:
    from tokenmill.formats.nanogpt import write_nanogpt_shard

    write_nanogpt_shard(tmp_path / "s.bin", np.arange(10))
    (tmp_path / "s.bos.idx").write_bytes(content.tobytes())
    code, report = inspect_json(capsys, str(tmp_path / "s.bin"))
    assert code == 1 and message in report["checks"][0]["detail"]
    (tmp_path / "s.bos.idx").write_bytes(np.array([1, 4], "<i4").tobytes())  # tokens 1 and 4
    code, report = inspect_json(capsys, str(tmp_path / "s.bin"))
    assert code == 1 and "points at one token id" in report["checks"][1]["name"]


def test_inspect_truncated_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from tokenmill.formats.nanogpt import write_nanogpt_shard

    write_nanogpt_shard(tmp_path / "s.bin", np.arange(10))
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "s.bin").write_bytes(data[:-2])
    code, report = inspect_json(capsys, str(tmp_path / "s.bin"))
    assert code == 1 and "truncated" in report["checks"][0]["detail"]
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_inspect_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_megatron_shard(tmp_path / "m", [[1, 0], [2, 3, 0]])
    code = main(["inspect", source, "--plot", str(tmp_path / "h.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "needs matplotlib" in capsys.readouterr().err
    else:
        assert code == 0 and (tmp_path / "h.png").stat().st_size > 0


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_plot_without_matplotlib(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    target = write_megatron_shard(tmp_path / "m", [[1, 0], [2, 3, 0]])
    if command == "validate":
        target = str(tmp_path / "mix.toml")
    code = main([command, target, "--plot", str(tmp_path / "h.png")])
    assert code == 2
    assert f"tokenmill {command}: error: --plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "h.png").exists()


def nemo_processor_shard(path: Path, documents: list[list[int]], itemsize: int) -> None:
    """A shard as NeMo Automodel's tools/nanogpt_data_processor.py lays it out (new magic,
    header[3] = bytes per token), with its .bos.idx as that writer fills it: for each document
    written, the file offset in bytes before it (header included) plus the token index of each
    BOS within the document, as int32."""
    header = np.zeros(256, "<i4")
    header[:4] = [278895051, 1, sum(map(len, documents)), itemsize]
    body, index, offset = [], [], 1024
    for document in documents:
        array = np.asarray(document, dtype=f"<u{itemsize}")
        index += (offset + np.flatnonzero(array == document[0])).tolist()
        body.append(array.tobytes())
        offset += array.nbytes
    path.write_bytes(header.tobytes() + b"".join(body))
    path.with_suffix(".bos.idx").write_bytes(np.asarray(index, "<i4").tobytes())


def test_convert_rebuilds_a_foreign_bos_index_given_bos_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.formats.bos_index import read_bos_index
    from tokenmill.formats.nanogpt import NanogptShard

    bos = 7
    rng = np.random.default_rng(3)
    documents = [[bos, *rng.integers(10, 500, int(rng.integers(1, 40))).tolist()] for _ in range(30)]  # fmt: skip
    (tmp_path / "nemo").mkdir()
    nemo_processor_shard(tmp_path / "nemo" / "dataset.bin", documents, 2)
    assert main(["convert", str(tmp_path / "nemo"), str(tmp_path / "refused"), "--to", "nanogpt", "-q"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "dataset.bos.idx" in err and "pass --bos-token ID to rebuild" in err
    out = tmp_path / "fixed"
    assert main(["convert", str(tmp_path / "nemo"), str(out), "--to", "nanogpt", "--bos-token", str(bos), "-q"]) == 0  # fmt: skip
    shard = NanogptShard(out / "dataset.bin")
    assert shard.tokens.tolist() == [t for d in documents for t in d]
    starts = np.cumsum([0] + [len(d) for d in documents[:-1]])
    assert read_bos_index(out / "dataset.bos.idx", len(shard)).positions.tolist() == starts.tolist()


def test_convert_bos_token_must_fit_and_occur(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.arange(1, 100, dtype=np.uint16).tofile(tmp_path / "raw.bin")
    base = ["convert", str(tmp_path / "raw.bin"), str(tmp_path / "o"), "--to", "nanogpt", "--dtype", "uint16", "-q"]  # fmt: skip
    for value, message in [("70000", "cannot occur .* uint16 \\(ids 0..65535\\)"),
                           ("-1", "cannot occur"), ("500", "does not occur in .*99 tokens")]:  # fmt: skip
        assert main([*base, "--bos-token", value]) == 1
        assert re.search(message, capsys.readouterr().err), value
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_convert_dtype_means_input_and_output(tmp_path: Path) -> None:
    from tokenmill.formats.nanogpt import NanogptShard

    tokens = np.arange(1, 200, dtype=np.uint16)
    tokens.tofile(tmp_path / "raw.bin")
    prefix = str(tmp_path / "m")
    assert main(["convert", str(tmp_path / "raw.bin"), prefix, "--to", "megatron", "--dtype", "uint16", "-q"]) == 0  # fmt: skip
    assert IndexedDataset(prefix).dtype == np.uint16
    assert tokens_of(prefix) == [tokens.tolist()]
    wide = str(tmp_path / "w")
    assert main(["convert", str(tmp_path / "raw.bin"), wide, "--to", "megatron", "--input-dtype", "uint16", "--output-dtype", "int32", "-q"]) == 0  # fmt: skip
    assert IndexedDataset(wide).dtype == np.int32 and tokens_of(wide) == [tokens.tolist()]
    # --dtype names the source's dtype; an output that cannot hold it picks its own
    tokens.astype(np.int32).tofile(tmp_path / "wide.bin")
    wide_in = ["convert", str(tmp_path / "wide.bin")]
    assert main([*wide_in, str(tmp_path / "g"), "--to", "nanogpt", "--dtype", "int32", "-q"]) == 0
    assert NanogptShard(tmp_path / "g" / "wide.bin").tokens.tolist() == tokens.tolist()
    assert main([*wide_in, str(tmp_path / "o"), "--to", "olmo", "--dtype", "int32", "-q"]) == 0
    assert json.loads((tmp_path / "o" / "tokenmill.json").read_text())["dtype"] == "uint32"
    # a .npy source keeps its header's dtype; --dtype then names only the output
    np.save(tmp_path / "t.npy", tokens.astype(np.uint32))
    assert main(["convert", str(tmp_path / "t.npy"), str(tmp_path / "n"), "--to", "npy", "--dtype", "uint16", "-q"]) == 0  # fmt: skip
    assert np.load(tmp_path / "n" / "t.npy").dtype == np.uint16


def test_olmo_layout_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OLMo-core's token files: headerless tokens named .npy, dtype in a sidecar or given."""
    from tokenmill.datasets.memory_mapped import MemoryMappedDataset
    from tokenmill.formats.token_dir import open_token_file

    documents = random_documents(np.random.default_rng(1), 20, vocab_size=60000)
    prefix = write_megatron_shard(tmp_path / "src", documents, np.int32)
    out = tmp_path / "olmo"
    assert main(["convert", prefix, str(out), "--to", "olmo", "-q"]) == 0
    raw = (out / "src.npy").read_bytes()
    flat = [t for d in documents for t in d]
    assert np.frombuffer(raw, "<u4").tolist() == flat  # no header: OLMo-core's layout
    assert json.loads((out / "tokenmill.json").read_text())["dtype"] == "uint32"
    assert open_token_file(out / "src.npy").tolist() == flat  # the sidecar names the dtype
    (out / "tokenmill.json").unlink()
    with pytest.raises(DataFormatError, match=r"OLMo-core token file.*dtype is ambiguous"):
        open_token_file(out / "src.npy")
    assert open_token_file(out / "src.npy", np.uint32).tolist() == flat
    dataset = MemoryMappedDataset(out, 5, dtype=np.uint32)
    assert dataset[0]["input_ids"].tolist() == flat[:4]
    back = str(tmp_path / "back")
    assert main(["convert", str(out / "src.npy"), back, "--to", "megatron", "--dtype", "uint32", "--eos-token", "0", "-q"]) == 0  # fmt: skip
    assert [t for d in tokens_of(back) for t in d] == flat
    assert main(["inspect", str(out / "src.npy"), "--dtype", "uint32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "olmo" and report["tokens"] == len(flat)


def test_convert_to_nanogpt_respects_the_shard_cap(tmp_path: Path) -> None:
    from tokenmill.formats.nanogpt import NanogptShard

    tokens = np.arange(1, 1001, dtype=np.uint16)
    tokens.tofile(tmp_path / "raw.bin")
    out = tmp_path / "n"
    assert main(["convert", str(tmp_path / "raw.bin"), str(out), "--to", "nanogpt", "--dtype", "uint16", "--shard-tokens", "300", "-q"]) == 0  # fmt: skip
    shards = sorted(out.glob("raw_*.bin"))
    assert [len(NanogptShard(p)) for p in shards] == [300, 300, 300, 100]
    assert np.concatenate([NanogptShard(p).tokens for p in shards]).tolist() == tokens.tolist()
    assert main(["convert", str(tmp_path / "raw.bin"), str(tmp_path / "x"), "--to", "nanogpt", "--dtype", "uint16", "--shard-tokens", str(2**30), "-q"]) == 1  # fmt: skip
