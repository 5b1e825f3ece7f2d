"""A ``ray.data.Dataset`` of text records to one tokenmill dataset: encode stage plus commit.

``tokenize_dataset(dataset, "out/web", tokenizer="tokenizer.json")`` appends one
``map_batches`` stage to the user's pipeline: an actor pool (one tokenizer per actor, loaded
once, gigatoken first) turns each batch of records into the flat arrays
``IndexedDatasetBuilder.add_documents`` takes (tokens with BOS/EOD and windows, sequence lengths,
sequences per document; :mod:`tokenmill.tokenize.encode`), and the driver (the commit) streams
them into ``<prefix>.bin/.idx`` in the dataset's order, which the stage keeps
(``preserve_order``). Documents are encoded one by one, so the output does not depend on the
batch or block sizes or on which actor ran what: a dataset read from files gives the bytes
``tokenmill tokenize`` gives for those files. A killed actor's batches are redone by Ray (its
actor pools restart actors and retry their tasks); the driver consumes each output once, so
nothing is lost or doubled.

Use it when the records come out of a Ray Data pipeline (filters, dedup, NeMo Curator); for
files on disk, :func:`tokenmill.ray.tokenize_on_ray` writes the parts on the workers and keeps
the driver out of the data path.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy

from tokenmill.common.ownership import own_output
from tokenmill.errors import DataFormatError
from tokenmill.formats.dataset_sidecar import sidecar_path, write_sidecar
from tokenmill.formats.megatron import IndexedDatasetBuilder, get_bin_path, get_idx_path
from tokenmill.ray.engine import RunIdentity, connect
from tokenmill.tokenize.encode import Encoded, EncodeOptions, Encoder, encode_documents
from tokenmill.tokenize.pipeline import TokenizeConfig, TokenizeResult, _load_tokenizer
from tokenmill.tokenize.readers import ReadOptions
from tokenmill.tokenize.tokenizers import TokenizerSpec

__all__ = ["BatchEncoder", "encode_texts", "tokenize_dataset"]

DATASET_INPUT = "<ray.data.Dataset>"
"""What the sidecar's ``inputs`` and the config name as the input of a dataset run."""


def encode_texts(encoder: Encoder, texts: list[str], where: str = "batch") -> Encoded:
    """Encode documents given as strings, as the pipeline encodes a chunk of them (gigatoken's
    packed route when the tokenizer has one)."""
    encode_packed = getattr(encoder.tokenizer, "encode_packed", None)
    if encode_packed is None:
        return encode_documents(texts, encoder.tokenizer, encoder.options, where)
    from tokenmill.tokenize.encode import shape_documents
    from tokenmill.tokenize.packed_text import pack_texts

    packed = pack_texts(texts)
    content, offsets, unicode17 = encode_packed(packed)
    tokens, lengths, per_document = shape_documents(
        content, offsets, encoder.options, where, encoder.tokenizer.describe()
    )
    return Encoded(
        tokens=tokens,
        sequence_lengths=lengths,
        sequences_per_document=per_document,
        text_bytes=packed.text_bytes,
        unicode17_documents=unicode17,
    )


@dataclass(frozen=True)
class _StageOptions:
    spec: TokenizerSpec
    options: EncodeOptions
    text_column: str


class BatchEncoder:
    """The ``map_batches`` actor: one tokenizer, loaded once; each batch of records in, one row
    of encoded arrays (as bytes) out."""

    def __init__(self, stage: _StageOptions) -> None:
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.stage = stage
        self.encoder = Encoder(stage.spec, stage.options)

    def __call__(self, batch: Any) -> dict[str, Any]:
        column = self.stage.text_column
        if column not in batch.column_names:
            raise DataFormatError(
                f"dataset has no column {column!r}; columns are {batch.column_names} "
                "(choose one with text_column)"
            )
        texts = batch.column(column).to_pylist()
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise DataFormatError(
                    f"dataset column {column!r}: row {row} of a batch is "
                    f"{type(text).__name__} {str(text)[:40]!r}, not a string"
                )
        encoded = encode_texts(self.encoder, texts, f"dataset column {column!r}")

        def blob(array: Any) -> Any:
            return numpy.array([numpy.ascontiguousarray(array).tobytes()], dtype=object)

        return {
            "tokens": blob(encoded.tokens),
            "sequence_lengths": blob(encoded.sequence_lengths),
            "sequences_per_document": blob(encoded.sequences_per_document),
            "text_bytes": numpy.array([encoded.text_bytes], dtype=numpy.int64),
            "unicode17_documents": numpy.array([encoded.unicode17_documents], dtype=numpy.int64),
        }


def tokenize_dataset(
    dataset: Any,
    output_prefix: str,
    tokenizer: TokenizerSpec | str = "bytes",
    text_column: str = "text",
    prepend_bos: bool = False,
    append_eod: bool = True,
    window: int | None = None,
    overlap: int = 0,
    output_format: str = "megatron",
    actors: int | None = None,
    batch_size: int = 1024,
    progress: bool = True,
) -> TokenizeResult:
    """Tokenize the text column of a ``ray.data.Dataset`` into a tokenmill dataset.

    Args:
        dataset: the records, in the order their documents should have.
        output_prefix: where ``.bin/.idx/.tokenmill.json`` go (a local or shared path).
        tokenizer: a :class:`TokenizerSpec` or what ``--tokenizer`` takes ("bytes", a
            tokenizer.json, a .tiktoken file, with an optional "gigatoken:"/"reference:").
        text_column: the column holding each document's text (non-null strings).
        prepend_bos, append_eod, window, overlap, output_format: as ``tokenmill tokenize``.
        actors: actors in the encode pool, one CPU each; None: the cluster's CPUs.
        batch_size: records per encode call.
        progress: Ray Data's progress bars.

    Returns:
        Totals; ``parts`` is empty (the driver writes the output).

    Raises:
        DataFormatError: a record's text is missing or not a string.
        ValueError: as :func:`tokenmill.tokenize.tokenize` for the options.
    """
    spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec.parse(tokenizer)
    config = TokenizeConfig(
        inputs=(DATASET_INPUT,),
        output_prefix=output_prefix,
        tokenizer=spec,
        read=ReadOptions(column=text_column),
        prepend_bos=prepend_bos,
        append_eod=append_eod,
        window=window,
        overlap=overlap,
        output_format=output_format,
        progress=progress,
    )
    if output_format == "nanogpt" and not prepend_bos:
        raise ValueError("output_format 'nanogpt' needs prepend_bos")
    started = time.perf_counter()
    loaded = _load_tokenizer(config)
    connected = connect(None)
    try:
        with own_output(output_prefix):
            run = RunIdentity.plan(config, loaded, make_parts=output_format != "megatron")
            totals = _commit(dataset, run, config, actors, batch_size, loaded.bos_id)
    finally:
        if connected:
            import ray

            ray.shutdown()
    return TokenizeResult(
        output_prefix=run.output_prefix,
        parts=[],
        skipped=[],
        documents=totals["documents"],
        tokens=totals["tokens"],
        text_bytes=totals["text_bytes"],
        seconds=time.perf_counter() - started,
        fingerprint=run.fingerprint,
        backend=loaded.describe_backend(),
        unicode17_documents=totals["unicode17_documents"],
    )


def _commit(
    dataset: Any,
    run: RunIdentity,
    config: TokenizeConfig,
    actors: int | None,
    batch_size: int,
    bos_id: int | None,
) -> dict[str, int]:
    """Run the encode stage and write its outputs in order (module docstring)."""
    import ray
    import ray.data

    context = dataset.context
    context.execution_options.preserve_order = True
    context.enable_progress_bars = config.progress
    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
    size = actors or max(1, int(resources.get("CPU", 1)))
    encoded = dataset.map_batches(
        BatchEncoder,
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=1,
        fn_constructor_kwargs={"stage": _StageOptions(run.spec, run.options, config.read.column)},
    )
    megatron_prefix = (
        run.output_prefix
        if config.output_format == "megatron"
        else os.path.join(run.parts_directory, "dataset")
    )
    for stale in (get_idx_path(run.output_prefix), sidecar_path(run.output_prefix)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    dtype = numpy.dtype(run.options.dtype)
    builder = IndexedDatasetBuilder(get_bin_path(megatron_prefix), dtype=dtype)
    totals = {"documents": 0, "sequences": 0, "tokens": 0, "text_bytes": 0}
    totals["unicode17_documents"] = 0
    for row in encoded.iter_rows():
        tokens = numpy.frombuffer(row["tokens"], dtype=dtype)
        lengths = numpy.frombuffer(row["sequence_lengths"], dtype=numpy.int64)
        per_document = numpy.frombuffer(row["sequences_per_document"], dtype=numpy.int64)
        builder.add_documents(tokens, lengths, per_document)
        totals["documents"] += int(per_document.shape[0])
        totals["sequences"] += int(lengths.shape[0])
        totals["tokens"] += int(tokens.shape[0])
        totals["text_bytes"] += int(row["text_bytes"])
        totals["unicode17_documents"] += int(row["unicode17_documents"])
    builder.finalize(get_idx_path(megatron_prefix))
    if config.output_format == "nanogpt":
        import shutil

        from tokenmill.tokenize.nanogpt_output import write_nanogpt_output

        assert bos_id is not None  # checked by _load_tokenizer
        write_nanogpt_output([megatron_prefix], run.output_prefix, bos_id)
        shutil.rmtree(run.parts_directory, ignore_errors=True)
    write_sidecar(
        run.output_prefix,
        run.fingerprint,
        options=run.option_fields,
        dtype=run.options.dtype,
        inputs=[{"path": DATASET_INPUT}],
        merged_from=1,
        **{key: value for key, value in totals.items() if key != "text_bytes"},
    )
    return totals
