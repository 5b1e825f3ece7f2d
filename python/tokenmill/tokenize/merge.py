"""Concatenate datasets into one, with megatron's ``add_index`` semantics and fingerprint checks.

``merge_datasets([a, b, c], out)`` writes ``out.bin/.idx`` whose sequences and documents are
those of ``a``, then ``b``, then ``c`` (megatron's ``tools/merge_datasets.py``: the builder takes
the first dataset's dtype and ``add_index`` appends each one). Before anything is written, every
input's ``.tokenmill.json`` fingerprint must match the first (else
:class:`~tokenmill.errors.TokenizerMismatchError` names both datasets and the field); datasets
without a fingerprint are refused unless ``allow_missing_fingerprint``. The output's ``.idx``
and sidecar are removed first and written last, each through a temporary name, so a reader
never pairs an old index with a new ``.bin``.

``find_prefixes`` turns a directory into its dataset prefixes, sorted, as megatron's tool does;
for a ``<prefix>.parts`` directory it also checks that every part of the run is present.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy

from tokenmill.common.atomic import durable_replace
from tokenmill.common.ownership import own_output
from tokenmill.common.progress import Progress
from tokenmill.errors import DataFormatError
from tokenmill.formats.dataset_sidecar import (
    IDENTITY_FIELDS,
    SIDECAR_SUFFIX,
    check_compatible,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from tokenmill.formats.megatron import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

__all__ = ["dataset_counts", "find_prefixes", "merge_datasets", "write_merged_sidecar"]

_PART = re.compile(r"^part-(\d{6})-of-(\d{6})$")


def find_prefixes(directory: str) -> list[str]:
    """The dataset prefixes in a directory (``X.idx`` with ``X.bin``), sorted.

    Raises:
        FileNotFoundError: the directory holds no dataset.
        DataFormatError: an ``.idx`` has no ``.bin``, or the directory holds parts of different
            runs or misses parts of one.
    """
    names = sorted(os.listdir(directory))
    prefixes = []
    for name in names:
        if name.startswith(".") or not name.endswith(".idx"):
            continue
        prefix = os.path.join(directory, name[: -len(".idx")])
        if not os.path.isfile(get_bin_path(prefix)):
            raise DataFormatError(f"{get_idx_path(prefix)}: has no {get_bin_path(prefix)}")
        prefixes.append(prefix)
    if not prefixes:
        raise FileNotFoundError(f"{directory}: no .bin/.idx datasets found")
    parts = [_PART.match(os.path.basename(prefix)) for prefix in prefixes]
    if any(parts):
        totals = {int(match.group(2)) for match in parts if match}
        if len(totals) != 1 or not all(parts):
            raise DataFormatError(
                f"{directory}: holds parts of different runs (part counts {sorted(totals)}) or "
                "other datasets; merge them explicitly"
            )
        total = totals.pop()
        present = {int(match.group(1)) for match in parts if match}
        missing = sorted(set(range(total)) - present)
        if missing:
            shown = ", ".join(str(index) for index in missing[:10])
            raise DataFormatError(
                f"{directory}: {len(missing)} of {total} parts are missing (inputs {shown}"
                f"{', ...' if len(missing) > 10 else ''}); run tokenize on the rank(s) that "
                "own them first"
            )
    return prefixes


def _merged_fingerprint(
    fingerprint: dict[str, Any], sidecars: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The merged tokenizer fingerprint: the inputs' (equal on the compared fields); when they
    were encoded by different backends (ranks with and without gigatoken, whose ids are the
    same), ``backend`` is "mixed" and ``backends`` lists each one."""
    identity = {key: fingerprint[key] for key in IDENTITY_FIELDS if key in fingerprint}
    extras = []
    for sidecar in sidecars:
        tokenizer = sidecar["tokenizer"]
        extra = {key: value for key, value in tokenizer.items() if key not in IDENTITY_FIELDS}
        if extra not in extras:
            extras.append(extra)
    if len(extras) <= 1:
        return fingerprint
    return {**identity, "backend": "mixed", "backends": extras}


def _summed(sidecars: Sequence[dict[str, Any]], field: str) -> dict[str, int]:
    """``{field: sum}`` over the sidecars that record ``field`` (none: nothing)."""
    values = [int(sidecar[field]) for sidecar in sidecars if field in sidecar]
    return {field: sum(values)} if values else {}


def dataset_counts(prefixes: Sequence[str]) -> tuple[int, int, int]:
    """Documents, sequences and tokens of datasets together (read from their indices)."""
    documents = sequences = tokens = 0
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        documents += int(dataset.document_indices.shape[0]) - 1
        sequences += len(dataset)
        tokens += int(dataset.sequence_lengths.sum(dtype="int64"))
        del dataset
    return documents, sequences, tokens


def write_merged_sidecar(
    output_prefix: str,
    fingerprint: dict[str, Any],
    sidecars: Sequence[dict[str, Any]],
    dtype: Any,
    documents: int,
    sequences: int,
    tokens: int,
) -> dict[str, Any]:
    """The sidecar of datasets concatenated into ``output_prefix`` (what ``merge_datasets``
    writes; the nanogpt output of the pipeline writes the same)."""
    options = [sidecar.get("options") for sidecar in sidecars]
    inputs: list[Any] = []
    for sidecar in sidecars:
        inputs.extend(sidecar.get("inputs") or [])
    return write_sidecar(
        output_prefix,
        _merged_fingerprint(fingerprint, sidecars),
        options=options[0] if all(option == options[0] for option in options) else "mixed",
        dtype=numpy.dtype(dtype).name,
        documents=documents,
        sequences=sequences,
        tokens=tokens,
        inputs=inputs,
        merged_from=len(sidecars),
        **_summed(sidecars, "unicode17_documents"),
    )


def merge_datasets(
    prefixes: Sequence[str],
    output_prefix: str,
    allow_missing_fingerprint: bool = False,
    progress: bool = False,
    move_single: bool = False,
) -> dict[str, Any]:
    """Concatenate datasets into ``output_prefix`` (see the module docstring).

    Args:
        prefixes: the datasets, in output order.
        output_prefix: where the merged ``.bin/.idx/.tokenmill.json`` go.
        allow_missing_fingerprint: also merge datasets that have no sidecar (those that have one
            must still agree); the output then gets a sidecar only if every input had one.
        progress: report progress (`tokenmill.common.progress`) and one summary line on stderr.
        move_single: with one input, rename its ``.bin/.idx`` into place instead of copying
            them (the same bytes: ``add_index`` of one dataset rewrites its index unchanged);
            the input is gone afterwards. The tokenize pipeline does this with its own part.

    Returns:
        The output's sidecar payload (empty if no input had a fingerprint).

    Raises:
        FileNotFoundError: a dataset is missing.
        DataFormatError: a dataset is corrupt, has another dtype, or lacks a fingerprint.
        TokenizerMismatchError: two datasets come from different tokenizers.
        ValueError: no datasets, or the output is one of the inputs.
    """
    prefixes = [os.path.abspath(os.fspath(prefix)) for prefix in prefixes]
    output_prefix = os.path.abspath(os.fspath(output_prefix))
    if not prefixes:
        raise ValueError("merge needs at least one dataset")
    if output_prefix in prefixes:
        raise ValueError(f"the output {output_prefix!r} is also an input")
    with_fingerprint = [p for p in prefixes if os.path.exists(sidecar_path(p))]
    if allow_missing_fingerprint:
        # the ones that have a fingerprint must still agree
        fingerprint = check_compatible(with_fingerprint) if with_fingerprint else {}
        if len(with_fingerprint) != len(prefixes):
            fingerprint = {}  # the output cannot vouch for tokens of unknown origin
    else:
        fingerprint = check_compatible(prefixes)
    sidecars = [read_sidecar(p) for p in with_fingerprint]
    with own_output(output_prefix):
        return _merge_owned(prefixes, output_prefix, fingerprint, sidecars, progress, move_single)


def _merge_owned(
    prefixes: list[str],
    output_prefix: str,
    fingerprint: dict[str, Any],
    sidecars: list[dict[str, Any]],
    progress: bool,
    move_single: bool,
) -> dict[str, Any]:
    """`merge_datasets` once the output is owned: every input is opened and checked (the
    structural check of `tokenmill.formats.validate`) before any output file is touched, so a
    corrupt input leaves the old output as it was and no new final-named file."""
    dtype = None
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        if dtype is None:
            dtype = dataset.index.dtype
        elif numpy.dtype(dataset.index.dtype) != numpy.dtype(dtype):
            raise DataFormatError(
                f"{get_idx_path(prefix)}: dtype {numpy.dtype(dataset.index.dtype)} differs from "
                f"{numpy.dtype(dtype)} of {get_idx_path(prefixes[0])}; cannot merge"
            )
        del dataset
    assert dtype is not None  # prefixes is not empty
    directory, name = os.path.split(output_prefix)
    leftovers = []  # temporary files of an earlier, killed merge into the same output
    for suffix in (".bin", ".idx", SIDECAR_SUFFIX):
        pattern = f".{glob.escape(name + suffix)}.*.tmp"
        leftovers.extend(glob.glob(os.path.join(glob.escape(directory), pattern)))
    for path in [get_idx_path(output_prefix), sidecar_path(output_prefix), *leftovers]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    os.makedirs(os.path.dirname(output_prefix) or ".", exist_ok=True)
    if move_single and len(prefixes) == 1:
        # .bin first: until the .idx follows, the output has no index a reader could pair
        durable_replace(get_bin_path(prefixes[0]), get_bin_path(output_prefix))
        durable_replace(get_idx_path(prefixes[0]), get_idx_path(output_prefix))
    else:
        builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype)
        sizes = [os.path.getsize(get_bin_path(prefix)) for prefix in prefixes]
        with Progress(
            "merge", total=sum(sizes), unit="B", unit_scale=True, enabled=progress
        ) as display:
            for prefix, size in zip(prefixes, sizes):
                builder.add_index(prefix)
                display.update(size)
            builder.finalize(get_idx_path(output_prefix))
            display.close(final_line=False)  # the summary line below says it all

    documents, sequences, tokens = dataset_counts([output_prefix])
    payload: dict[str, Any] = {}
    if fingerprint:
        payload = write_merged_sidecar(
            output_prefix, fingerprint, sidecars, dtype, documents, sequences, tokens
        )
    if progress:
        sys.stderr.write(
            f"[merge] {len(prefixes)} dataset(s) -> {output_prefix}.bin/.idx: {documents:,} "
            f"documents, {tokens:,} tokens\n"
        )
    return payload
