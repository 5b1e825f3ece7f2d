"""Outputs on s3://: `tokenize` and `convert` write locally (atomically), then upload; `convert`
also reads s3:// sources. The uploaded objects equal what a local run writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from oracles import import_oracle

import_oracle("boto3")

from tokenmill.cli.main import main
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.storage.object_storage import ObjectStorageConfig
from tokenmill.storage.staging import fetch_source, staged_path, upload_directory, upload_prefix
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize

from conftest import S3Bucket, random_documents, write_megatron_shard

DOCUMENTS = ["Hello world.", "Object storage, tested.", "x" * 300, "é ü ß"]


@pytest.fixture(autouse=True)
def _staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "staging"
    monkeypatch.setenv("TOKENMILL_STAGING_DIR", str(root))
    return root


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS), encoding="utf-8")
    return path


def test_tokenize_to_s3_equals_local(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "corpus.jsonl")
    tokenize(
        TokenizeConfig(inputs=(str(corpus),), output_prefix=str(tmp_path / "web"), progress=False)
    )
    url = s3_bucket.url("out/web")
    result = tokenize(TokenizeConfig(inputs=(str(corpus),), output_prefix=url, progress=False))
    assert result.output_prefix == url and result.documents == len(DOCUMENTS)
    for suffix in (".bin", ".idx"):
        assert s3_bucket.get("out/web" + suffix) == (tmp_path / ("web" + suffix)).read_bytes()
    sidecar = json.loads(s3_bucket.get("out/web.tokenmill.json"))
    assert (
        sidecar["tokenizer"]
        == json.loads((tmp_path / "web.tokenmill.json").read_text())["tokenizer"]
    )
    staged = Path(staged_path(url))
    assert not any(p.name.startswith("web") for p in staged.parent.iterdir())  # cleaned up
    # and the uploaded dataset reads back through s3://
    remote = IndexedDataset(url, object_storage_config=ObjectStorageConfig(str(tmp_path / "c")))
    local = IndexedDataset(str(tmp_path / "web"))
    for i in range(len(local)):
        np.testing.assert_array_equal(remote[i], local[i])


def test_tokenize_cli_to_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "corpus.jsonl")
    url = s3_bucket.url("cli/web")
    assert main(["tokenize", str(corpus), "--output", url, "--workers", "0", "--quiet"]) == 0
    assert IndexedDataset.exists(url)
    assert main(["tokenize", str(corpus), "--output", url, "--world-size", "2", "--rank", "0",
                 "--workers", "0", "--quiet"]) == 1  # fmt: skip
    with pytest.raises(ValueError, match="needs world_size 1"):
        tokenize(
            TokenizeConfig(inputs=(str(corpus),), output_prefix=url, world_size=2, progress=False)
        )


def test_convert_reads_and_writes_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    documents = [[5, *doc] for doc in random_documents(np.random.default_rng(2), 40)]
    source = write_megatron_shard(tmp_path / "local" / "corpus", documents)
    remote_source = s3_bucket.upload_prefix(source, "src/corpus")

    def run(src: str, dst: str, *options: str) -> int:
        return main(["convert", src, dst, *options, "--quiet"])

    assert run(source, str(tmp_path / "ng"), "--to", "nanogpt", "--bos-token", "5") == 0
    dst = s3_bucket.url("dst/ng")
    assert run(remote_source, dst, "--to", "nanogpt", "--bos-token", "5") == 0
    local_files = sorted(os.listdir(tmp_path / "ng"))
    assert any(name.endswith(".bos.idx") for name in local_files)
    for name in local_files:
        assert s3_bucket.get(f"dst/ng/{name}") == (tmp_path / "ng" / name).read_bytes()
    # and back: s3:// nanogpt directory -> s3:// Megatron prefix
    assert run(dst, s3_bucket.url("dst/back"), "--to", "megatron") == 0
    assert run(str(tmp_path / "ng"), str(tmp_path / "back"), "--to", "megatron") == 0
    for suffix in (".bin", ".idx"):
        assert s3_bucket.get("dst/back" + suffix) == (tmp_path / ("back" + suffix)).read_bytes()
    assert run(s3_bucket.url("nothing/here"), str(tmp_path / "x"), "--to", "npy") == 1
    assert main(["inspect", dst, "--bos-token", "5", "--json"]) == 0
    assert main(["inspect", s3_bucket.url("nothing/here")]) == 2


def test_upload_order_and_fetch_source(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    for name in ("d.tokenmill.json", "d.idx", "d.bin", "d.bos.idx", "other.bin"):
        (tmp_path / name).write_bytes(name.encode())
    uploaded = upload_prefix(str(tmp_path / "d"), s3_bucket.url("p/d"))
    assert [info.url.rsplit("/", 1)[1] for info in uploaded] == [
        "d.bin",
        "d.bos.idx",
        "d.idx",
        "d.tokenmill.json",
    ]
    with pytest.raises(FileNotFoundError, match="nothing to upload"):
        upload_prefix(str(tmp_path / "zzz"), s3_bucket.url("p/zzz"))
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "a.bos.idx").write_bytes(b"i")
    (tmp_path / "tree" / "a.bin").write_bytes(b"b")
    uploaded = upload_directory(str(tmp_path / "tree"), s3_bucket.url("t"))
    assert [info.url for info in uploaded] == [
        s3_bucket.url("t/a.bin"),
        s3_bucket.url("t/sub/a.bos.idx"),
    ]
    local = fetch_source(s3_bucket.url("p/d"), root=str(tmp_path / "fetched"))
    visible = sorted(n for n in os.listdir(os.path.dirname(local)) if not n.startswith("."))
    assert visible == ["d.bin", "d.bos.idx", "d.idx", "d.tokenmill.json"]  # not other.bin
    assert Path(local + ".idx").read_bytes() == b"d.idx"
    with pytest.raises(FileNotFoundError, match="no object matches"):
        fetch_source(s3_bucket.url("p/none"))
