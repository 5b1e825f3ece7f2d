"""Megatron-LM main's ``IndexedDatasetBuilder.add_documents(documents, modes=None, eod_token=None,
chunk_size=...)`` (its tools/preprocess_data_fast.py calls it) beside tokenmill's own
``add_documents(tokens, sequence_lengths, sequences_per_document)``: each form writes what main's
semantics define (one sequence and one document per document, EOD appended), byte for byte the
same as the per-document path."""

from pathlib import Path

import awkward
import numpy
import pytest

from tokenmill.megatron.indexed_dataset import IndexedDatasetBuilder

DOCUMENTS = [[5, 6, 7], [], [8], [9, 10, 11, 12]]


def _files(prefix):
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def _per_document(prefix, eod=None, multimodal=False, modes=None):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16, multimodal=multimodal)
    for index, document in enumerate(DOCUMENTS):
        tokens = document + ([eod] if eod is not None else [])
        builder.add_item(tokens, mode=0 if modes is None else modes[index])
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return _files(prefix)


@pytest.mark.parametrize("kind", ["awkward", "lists", "tuple"])
@pytest.mark.parametrize("eod", [None, 2])
@pytest.mark.parametrize("chunk_size", [1, 3, 1_000_000])
def test_main_form_matches_per_document_writes(tmp_path, kind, eod, chunk_size):
    documents = {
        "awkward": awkward.Array(DOCUMENTS),
        "lists": DOCUMENTS,
        "tuple": tuple(numpy.array(d, dtype=numpy.int64) for d in DOCUMENTS),
    }[kind]
    builder = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=numpy.uint16)
    builder.add_documents(documents, eod_token=eod, chunk_size=chunk_size)
    builder.finalize(str(tmp_path / "bulk.idx"))
    assert _files(tmp_path / "bulk") == _per_document(tmp_path / "one", eod)


def test_main_form_positional_and_modes(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=numpy.uint16, multimodal=True)
    builder.add_documents(awkward.Array(DOCUMENTS), [1, 2, 3, 4])
    builder.finalize(str(tmp_path / "bulk.idx"))
    expected = _per_document(tmp_path / "one", multimodal=True, modes=[1, 2, 3, 4])
    assert _files(tmp_path / "bulk") == expected


def test_main_form_refusals(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.uint16)
    with pytest.raises(OverflowError, match="token 70000 does not fit uint16"):
        builder.add_documents(DOCUMENTS, eod_token=70_000)
    with pytest.raises(ValueError, match="chunk_size"):
        builder.add_documents(DOCUMENTS, chunk_size=0)
    builder.finalize(str(tmp_path / "x.idx"))


def test_tokenmill_form_still_works(tmp_path):
    flat = [token for document in DOCUMENTS for token in document]
    lengths = [len(document) for document in DOCUMENTS]
    builder = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=numpy.uint16)
    builder.add_documents(flat, lengths)
    builder.finalize(str(tmp_path / "bulk.idx"))
    keyword = IndexedDatasetBuilder(str(tmp_path / "kw.bin"), dtype=numpy.uint16)
    keyword.add_documents(
        tokens=numpy.array(flat), sequence_lengths=lengths, sequences_per_document=[1, 1, 1, 1]
    )
    keyword.finalize(str(tmp_path / "kw.idx"))
    assert _files(tmp_path / "bulk") == _per_document(tmp_path / "one") == _files(tmp_path / "kw")
