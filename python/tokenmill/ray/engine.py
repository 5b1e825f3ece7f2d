"""``tokenmill tokenize --engine ray``: the tokenize pipeline's parts, written by a Ray actor pool.

Algorithm (the single-machine pipeline's, with Ray scheduling the parts):

1. The driver expands the inputs (sorted, as ``tokenmill tokenize`` does; ``s3://`` patterns
   are listed) and cuts each into *ranges* (:func:`plan_ranges`): plain ``.jsonl`` and
   ``.txt`` in line mode into byte ranges of about ``range_bytes`` (a range owns the lines that
   *start* inside it, so neighbouring ranges never share or drop a line); parquet into runs of
   whole row groups of about ``range_bytes`` uncompressed; compressed files (``.gz``,
   ``.zst``), ``.txt`` in file mode and ``s3://`` objects whole.
2. Every range becomes one part, ``<prefix>.parts/range-IIIIII-of-NNNNNN-at-OOOOOOOOOOOOOOO``
   (input ``I`` of ``N``, first byte or row group ``O``): a Megatron ``.bin/.idx`` plus a
   ``.tokenmill.json`` record written last (the job key, the input's identity and the range),
   exactly the pipeline's part protocol. A ``ray.data`` ``map_batches`` stage on an actor pool
   (one tokenizer per actor, loaded once, gigatoken first) writes the parts; each actor uses one
   CPU and encodes on its own thread.
3. Idempotence: a part whose record matches is not rewritten (a retried task, or a rerun after a
   killed driver, finds it done); anything else is removed with its temporaries and redone, and
   files reach their final names only by rename. So when Ray restarts a killed actor and retries
   its task (Ray Data's actor pools retry without limit), the range is written exactly once.
4. The commit (driver): every planned part must be done; they are merged in (input, range)
   order into ``<prefix>.bin/.idx`` (``IndexedDatasetBuilder.add_index``: the bytes of one
   build over all documents), or streamed into a nanogpt shard, and the sidecar is the one
   single-machine ``tokenize`` writes (one entry per input file). The output is therefore
   byte-identical to ``tokenmill tokenize`` of the same inputs, whatever the cluster size, the
   range size, the chunk size or the order in which ranges finish. With ``keep_parts`` the parts
   stay; ``tokenmill merge <prefix>.parts`` merges them again (their names sort in input order).

The parts directory must be visible to every node and the driver (a shared file system, as for
Slurm arrays); local inputs likewise. ``s3://`` inputs are downloaded by the actor that reads
them, into its node's temporary directory, and deleted after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy

from tokenmill.common.ownership import own_output
from tokenmill.errors import DataFormatError
from tokenmill.formats.dataset_sidecar import read_sidecar, sidecar_path, write_sidecar
from tokenmill.formats.megatron import IndexedDatasetBuilder, get_bin_path, get_idx_path
from tokenmill.tokenize.encode import Encoded, EncodeOptions, Encoder
from tokenmill.tokenize.pipeline import (
    TokenizeConfig,
    TokenizeResult,
    _check_output_format,
    _job_key,
    _load_tokenizer,
    _remove_leftovers,
    encode_options,
    part_files_complete,
)
from tokenmill.tokenize.readers import (
    DEFAULT_CHUNK_BYTES,
    GIGATOKEN_CHUNK_BYTES,
    Chunk,
    ReadOptions,
    detect_format,
    expand_inputs,
    file_identity,
    iter_chunks,
)
from tokenmill.tokenize.tokenizers import Tokenizer, TokenizerSpec

__all__ = ["DEFAULT_RANGE_BYTES", "InputRange", "plan_ranges", "tokenize_on_ray"]

DEFAULT_RANGE_BYTES = 256 << 20
"""Text per range (one Ray task, one part): large enough that a task lasts seconds to minutes
(Ray's per-task cost is milliseconds), small enough that a retry redoes little."""

_SCAN_BYTES = 1 << 16

# Test hook: a path; the first actor to write a part creates it (holding its pid) and kills
# itself with SIGKILL after its first chunk, so a test sees Ray retry a range whose temporary
# .bin is half written.
_KILL_VARIABLE = "TOKENMILL_TEST_RAY_KILL_ONCE"


@dataclass(frozen=True)
class InputRange:
    """One part's share of one input file.

    Attributes:
        input_index: the file's position in the sorted input list.
        input_count: the number of input files.
        path: the file (a local path or an ``s3://`` URL).
        unit: "bytes" (lines starting in ``[start, stop)``), "row_groups" (parquet row groups
            ``[start, stop)``) or "file" (all of it).
        start: the first byte or row group.
        stop: the end (exclusive); for "file", 0.
    """

    input_index: int
    input_count: int
    path: str
    unit: str
    start: int
    stop: int

    @property
    def name(self) -> str:
        """The part's file name (without suffix): sorts in input order."""
        return f"range-{self.input_index:06d}-of-{self.input_count:06d}-at-{self.start:015d}"

    def record(self) -> dict[str, Any]:
        """What the part's record says about its range."""
        return {"unit": self.unit, "start": self.start, "stop": self.stop}


def _is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _expand(patterns: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """The sorted inputs and their identities (size and mtime, or size and ETag for s3://).

    Raises:
        FileNotFoundError: a pattern matches nothing.
    """
    local = [pattern for pattern in patterns if not _is_s3(os.fspath(pattern))]
    remote = [os.fspath(pattern) for pattern in patterns if _is_s3(os.fspath(pattern))]
    files = expand_inputs(local) if local else []
    identities = {path: file_identity(path) for path in files}
    if remote:
        from tokenmill.storage.s3 import get_client

        client = get_client()
        for pattern in remote:
            if pattern.endswith("/"):
                infos = [info for info in client.list_objects(pattern) if _known(info.url)]
            else:
                infos = [client.stat(url) for url in client.glob(pattern)]
            if not infos:
                raise FileNotFoundError(f"{pattern}: matches no input objects")
            for info in infos:
                detect_format(info.url)
                identities[info.url] = {"path": info.url, "size": info.size, "etag": info.etag}
    ordered = sorted(identities)
    return ordered, [identities[path] for path in ordered]


def _known(url: str) -> bool:
    try:
        detect_format(url)
    except ValueError:
        return False
    return not url.endswith(".tokenmill.json")


def plan_ranges(
    files: Sequence[str],
    read: ReadOptions,
    range_bytes: int = DEFAULT_RANGE_BYTES,
    sizes: Sequence[int] | None = None,
) -> list[InputRange]:
    """The ranges of the inputs, in output order (see the module docstring).

    Args:
        files: the sorted inputs.
        read: the read options (``txt_mode`` decides whether ``.txt`` files split).
        range_bytes: the text per range.
        sizes: the files' sizes (else read from the file system; needed for ``s3://``).

    Raises:
        ValueError: ``range_bytes < 1``, or an input's format is unknown.
    """
    if range_bytes < 1:
        raise ValueError(f"range_bytes must be >= 1, got {range_bytes}")
    ranges: list[InputRange] = []
    count = len(files)
    for index, path in enumerate(files):
        fmt = detect_format(path)
        if _is_s3(path):
            ranges.append(InputRange(index, count, path, "file", 0, 0))
        elif fmt == "jsonl" or (fmt == "txt" and read.txt_mode == "line"):
            size = sizes[index] if sizes is not None else os.path.getsize(path)
            starts = range(0, max(size, 1), range_bytes)
            for start in starts:
                ranges.append(
                    InputRange(index, count, path, "bytes", start, min(size, start + range_bytes))
                )
        elif fmt == "parquet":
            from tokenmill.tokenize.readers import _open_parquet

            metadata = _open_parquet(path).metadata
            groups = metadata.num_row_groups
            start = 0
            held = 0
            for group in range(groups):
                held += int(metadata.row_group(group).total_byte_size)
                if held >= range_bytes or group == groups - 1:
                    ranges.append(InputRange(index, count, path, "row_groups", start, group + 1))
                    start, held = group + 1, 0
            if groups == 0:
                ranges.append(InputRange(index, count, path, "row_groups", 0, 0))
        else:
            ranges.append(InputRange(index, count, path, "file", 0, 0))
    return ranges


def _line_start(stream: Any, offset: int, size: int) -> int:
    """The first line start at or after ``offset`` (0, or just after a newline; else ``size``)."""
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    stream.seek(offset - 1)
    position = offset - 1
    while True:
        block = stream.read(_SCAN_BYTES)
        if not block:
            return size
        found = block.find(b"\n")
        if found >= 0:
            return int(position + found + 1)
        position += len(block)


def _byte_range_chunks(
    path: str, kind: str, start: int, stop: int, chunk_bytes: int
) -> Iterator[tuple[Chunk, int]]:
    """Chunks of whole lines starting in ``[start, stop)``, with the byte offset of each.

    Line numbers (``first_line``) count from 1 at the range's first line; the caller fixes them
    up only when it reports an error (counting the lines before the range reads the file)."""
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        begin = _line_start(stream, start, size)
        end = _line_start(stream, stop, size) if stop < size else size
        stream.seek(begin)
        position = begin  # bytes read up to here
        offset = begin  # the file offset of pending[0]
        pending = b""
        line = 1
        while True:
            if position < end:
                block = stream.read(min(max(chunk_bytes, _SCAN_BYTES), end - position))
                if not block:
                    raise DataFormatError(f"{path}: the file shrank while it was read")
                position += len(block)
                pending += block
            finished = position >= end
            cut_from = 0
            while len(pending) - cut_from >= chunk_bytes or (finished and cut_from < len(pending)):
                cut = pending.rfind(b"\n", cut_from, cut_from + chunk_bytes) + 1
                if cut == 0:  # no line end within a chunk: take the whole (long) line
                    cut = pending.find(b"\n", cut_from + chunk_bytes) + 1
                if cut == 0:
                    if not finished:
                        break  # the line continues in the next block
                    cut = len(pending)  # the file's last line has no newline
                data = pending[cut_from:cut]
                yield Chunk(path, kind, data, first_line=line), offset + cut_from
                line += data.count(b"\n")
                cut_from = cut
            offset += cut_from
            pending = pending[cut_from:]
            if finished:
                return


def _count_lines_before(path: str, offset: int) -> int:
    """Newlines in the first ``offset`` bytes of a file."""
    count = 0
    with open(path, "rb") as stream:
        while offset > 0:
            block = stream.read(min(offset, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


@dataclass(frozen=True)
class RunIdentity:
    """The job's identity, as the single-machine pipeline computes it (``_Run.plan``): the
    same job key, so parts and sidecars agree with ``tokenmill tokenize``'s."""

    fingerprint: dict[str, Any]
    spec: TokenizerSpec
    options: EncodeOptions
    job: str
    option_fields: dict[str, Any]
    output_prefix: str
    parts_directory: str

    @classmethod
    def plan(
        cls, config: TokenizeConfig, tokenizer: Tokenizer, make_parts: bool = True
    ) -> RunIdentity:
        """The identity of ``config`` run with ``tokenizer``; creates the parts directory."""
        fingerprint = tokenizer.fingerprint()
        options = encode_options(config, tokenizer)
        output_prefix = os.path.abspath(config.output_prefix)
        os.makedirs(os.path.dirname(output_prefix), exist_ok=True)
        if make_parts:
            os.makedirs(output_prefix + ".parts", exist_ok=True)
        return cls(
            fingerprint=fingerprint,
            spec=config.tokenizer.resolved(tokenizer),
            options=options,
            job=_job_key(fingerprint, options, config.output_format),
            option_fields={
                "prepend_bos": config.prepend_bos,
                "append_eod": config.append_eod,
                "window": config.window,
                "overlap": config.overlap,
            },
            output_prefix=output_prefix,
            parts_directory=output_prefix + ".parts",
        )


@dataclass(frozen=True)
class RangeJob:
    """What every actor needs (pickled once into each): the run's identity and layout."""

    run: RunIdentity
    identities: tuple[dict[str, Any], ...]
    output_format: str
    chunk_bytes: int | None
    kill_marker: str = ""

    def part(self, item: InputRange) -> str:
        """The part prefix of a range."""
        return os.path.join(self.run.parts_directory, item.name)


def _range_part_is_done(prefix: str, identity: dict[str, Any], item: InputRange, job: str) -> bool:
    """A part counts as done only if its record names this job, input and range and its
    files have the recorded sizes (the pipeline's rule plus the range)."""
    try:
        record = read_sidecar(prefix)
    except DataFormatError:
        return False
    if (
        record.get("job") != job
        or record.get("inputs") != [identity]
        or record.get("range") != item.record()
    ):
        return False
    return part_files_complete(prefix, record)


class _Downloaded:
    """An ``s3://`` input copied to this node's temporary directory (removed on exit)."""

    def __init__(self, url: str) -> None:
        from tokenmill.storage.s3 import get_client

        self.directory = tempfile.mkdtemp(prefix="tokenmill-ray-")
        self.path = os.path.join(self.directory, url.rsplit("/", 1)[-1])
        get_client().download(url, self.path)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _chunks(
    item: InputRange, path: str, read: ReadOptions, chunk_bytes: int
) -> Iterator[tuple[Chunk, int]]:
    """The chunks of one range (each with its byte offset, for bytes ranges)."""
    if item.unit == "bytes":
        kind = "jsonl" if detect_format(path) == "jsonl" else "lines"
        yield from _byte_range_chunks(path, kind, item.start, item.stop, chunk_bytes)
        return
    options = dataclasses.replace(read, chunk_bytes=chunk_bytes)
    for chunk in iter_chunks(path, options):
        if item.unit == "row_groups" and not item.start <= chunk.row_group < item.stop:
            continue
        yield chunk, 0


def write_range_part(job: RangeJob, encoder: Encoder, item: InputRange) -> dict[str, Any]:
    """Write one range's part unless it is done already; returns its counts.

    Raises:
        DataFormatError: the input is malformed (names the file, line and field).
    """
    prefix = job.part(item)
    identity = job.identities[item.input_index]
    if _range_part_is_done(prefix, identity, item, job.run.job):
        record = read_sidecar(prefix)
        return {
            "part": item.name,
            "skipped": True,
            **{key: int(record[key]) for key in _COUNTS},
        }
    _remove_leftovers(prefix)
    chunk_bytes = job.chunk_bytes or (
        GIGATOKEN_CHUNK_BYTES if encoder.tokenizer.backend == "gigatoken" else DEFAULT_CHUNK_BYTES
    )
    downloaded = _Downloaded(item.path) if _is_s3(item.path) else None
    path = downloaded.path if downloaded is not None else item.path
    counts = dict.fromkeys(_COUNTS, 0)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.dtype(job.run.options.dtype))
    try:
        for chunk, offset in _chunks(item, path, job.run.options.read, chunk_bytes):
            encoded = _encode(encoder, chunk, offset, item, path)
            builder.add_documents(
                encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
            )
            counts["documents"] += encoded.documents
            counts["sequences"] += int(encoded.sequence_lengths.shape[0])
            counts["tokens"] += int(encoded.tokens.shape[0])
            counts["text_bytes"] += encoded.text_bytes
            counts["unicode17_documents"] += encoded.unicode17_documents
            if job.kill_marker:
                _kill_once(job.kill_marker)
        builder.finalize(get_idx_path(prefix))
    except DataFormatError as error:
        if downloaded is None:
            raise
        raise DataFormatError(str(error).replace(downloaded.path, item.path)) from error
    finally:
        del builder  # an unfinished builder deletes its temporary .bin
        if downloaded is not None:
            downloaded.close()
    write_sidecar(
        prefix,
        job.run.fingerprint,
        job=job.run.job,
        inputs=[dict(identity)],
        range=item.record(),
        options=job.run.option_fields,
        dtype=job.run.options.dtype,
        bin_bytes=os.path.getsize(get_bin_path(prefix)),
        idx_bytes=os.path.getsize(get_idx_path(prefix)),
        **counts,
    )
    return {"part": item.name, "skipped": False, **counts}


_COUNTS = ("documents", "sequences", "tokens", "text_bytes", "unicode17_documents")


def _encode(encoder: Encoder, chunk: Chunk, offset: int, item: InputRange, path: str) -> Encoded:
    """Encode a chunk; an error inside a byte range is raised again with the file's line
    numbers (the lines before the range are counted only then)."""
    try:
        return encoder(chunk)
    except DataFormatError:
        if item.unit != "bytes" or offset == 0:
            raise
        before = _count_lines_before(path, offset)
        encoder(dataclasses.replace(chunk, first_line=before + 1))
        raise


def _kill_once(marker: str) -> None:
    """The test hook: the first caller records its pid and dies by SIGKILL."""
    try:
        descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    os.kill(os.getpid(), signal.SIGKILL)


class RangeWorker:
    """The ``map_batches`` actor: loads the tokenizer once, then writes the parts of the ranges
    it is given (one row per range)."""

    def __init__(self, job: RangeJob) -> None:
        # one CPU per actor: gigatoken encodes on the calling thread; no tokenizer thread pools
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.job = job
        self.encoder = Encoder(job.run.spec, job.run.options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        results = [
            write_range_part(self.job, self.encoder, InputRange(**json.loads(str(text))))
            for text in batch["range"]
        ]
        return {
            "part": numpy.array([result["part"] for result in results]),
            "skipped": numpy.array([result["skipped"] for result in results]),
            **{
                key: numpy.array([result[key] for result in results], dtype=numpy.int64)
                for key in _COUNTS
            },
        }


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (else ``RAY_ADDRESS``, else a new local one) unless
    this process already is connected; True if this call connected.

    Raises:
        ImportError: Ray is not installed (names the extra).
    """
    try:
        import ray
    except ImportError as error:
        raise ImportError("the Ray engine needs Ray: pip install 'tokenmill[ray]'") from error
    if ray.is_initialized():
        return False
    ray.init(
        address=address or os.environ.get("RAY_ADDRESS") or None, logging_level=logging.WARNING
    )
    return True


def tokenize_on_ray(
    config: TokenizeConfig,
    address: str | None = None,
    range_bytes: int = DEFAULT_RANGE_BYTES,
    actors: int | None = None,
) -> TokenizeResult:
    """``tokenize(config)`` with the parts written by a Ray actor pool (module docstring).

    Args:
        config: as for :func:`tokenmill.tokenize.tokenize`; ``workers``, ``rank`` and
            ``world_size`` are not used (Ray schedules), ``memory_budget`` neither (each actor
            holds one chunk at a time).
        address: the Ray cluster (``ray://`` or ``host:port``); None: ``RAY_ADDRESS``, else the
            cluster this process is connected to, else a new local one.
        range_bytes: text per range (one task, one part).
        actors: actors in the pool, one CPU each; None: the cluster's CPUs.

    Returns:
        What the run did; ``parts`` lists the parts written, ``skipped`` those found done.

    Raises:
        FileNotFoundError, DataFormatError, ValueError: as :func:`tokenmill.tokenize.tokenize`.
        ImportError: Ray is not installed.
    """
    if config.output_prefix.startswith(("s3://", "msc://")):
        raise ValueError(
            f"the Ray engine writes to a file system every node sees, not {config.output_prefix}; "
            "tokenize to a shared path and upload the result (tokenmill publish)"
        )
    if config.world_size != 1:
        raise ValueError("the Ray engine schedules the whole job: leave rank/world_size unset")
    _check_output_format(config.output_format)
    if config.output_format == "nanogpt" and not config.prepend_bos:
        raise ValueError(
            "output_format 'nanogpt' needs prepend_bos (--prepend-bos): its documents start with "
            "BOS and its .bos.idx lists them"
        )
    started = time.perf_counter()
    tokenizer = _load_tokenizer(config)
    files, identities = _expand(config.inputs)
    with own_output(config.output_prefix):
        run = RunIdentity.plan(config, tokenizer)
        ranges = plan_ranges(files, config.read, range_bytes, [i["size"] for i in identities])
        job = RangeJob(
            run=run,
            identities=tuple(identities),
            output_format=config.output_format,
            chunk_bytes=config.read.chunk_bytes,
            kill_marker=os.environ.get(_KILL_VARIABLE, ""),
        )
        _remove_foreign_parts(run.parts_directory, {item.name for item in ranges})
        pending = [
            item
            for item in ranges
            if not _range_part_is_done(job.part(item), identities[item.input_index], item, run.job)
        ]
        written: list[str] = []
        if pending:
            written = _run_actors(job, pending, address, actors, config.progress)
        parts = [job.part(item) for item in ranges]
        for item, prefix in zip(ranges, parts):
            if not _range_part_is_done(prefix, identities[item.input_index], item, run.job):
                raise RuntimeError(f"{prefix}: the Ray tasks ended without this part")
        totals = _commit(config, run, tokenizer.bos_id, ranges, parts)
    return TokenizeResult(
        output_prefix=run.output_prefix,
        parts=[job.part(item) for item in pending if item.name in set(written)],
        skipped=[job.part(item) for item in ranges if item not in pending],
        documents=totals["documents"],
        tokens=totals["tokens"],
        text_bytes=totals["text_bytes"],
        seconds=time.perf_counter() - started,
        fingerprint=run.fingerprint,
        backend=tokenizer.describe_backend(),
        unicode17_documents=totals["unicode17_documents"],
    )


def _remove_foreign_parts(directory: str, names: set[str]) -> None:
    """Remove range parts of other plans (another range size, other inputs) and parts of the
    single-machine pipeline, so the parts directory holds this run's alone."""
    for entry in os.listdir(directory):
        stem = entry.lstrip(".").split(".", 1)[0]
        if stem.startswith(("range-", "part-")) and stem not in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, entry))


def _run_actors(
    job: RangeJob,
    pending: list[InputRange],
    address: str | None,
    actors: int | None,
    progress: bool,
) -> list[str]:
    """Write the pending parts on the actor pool; returns the names written (not found done)."""
    connected = connect(address)
    try:
        import ray
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = progress
        context.print_on_execution_start = progress
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        size = actors or max(1, int(resources.get("CPU", 1)))
        size = max(1, min(size, len(pending)))
        items = [{"range": json.dumps(dataclasses.asdict(item))} for item in pending]
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            RangeWorker,
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=size),
            num_cpus=1,
            fn_constructor_kwargs={"job": job},
        )
        rows = dataset.take_all()
    finally:
        if connected:
            import ray

            ray.shutdown()
    return [str(row["part"]) for row in rows if not row["skipped"]]


def _commit(
    config: TokenizeConfig,
    run: RunIdentity,
    bos_id: int | None,
    ranges: list[InputRange],
    parts: list[str],
) -> dict[str, int]:
    """Merge the parts into the output (module docstring, step 4); returns the totals."""
    from tokenmill.tokenize.merge import dataset_counts, merge_datasets, write_merged_sidecar
    from tokenmill.tokenize.nanogpt_output import write_nanogpt_output

    records = [read_sidecar(prefix) for prefix in parts]
    totals = {key: sum(int(record[key]) for record in records) for key in _COUNTS}
    # one record per input, as the single-machine pipeline's parts are: its sidecar is the same
    per_input: list[dict[str, Any]] = []
    for item, record in zip(ranges, records):
        if per_input and per_input[-1]["inputs"] == record["inputs"]:
            per_input[-1]["unicode17_documents"] += int(record["unicode17_documents"])
            continue
        per_input.append(
            {
                "tokenizer": record["tokenizer"],
                "options": record["options"],
                "inputs": record["inputs"],
                "unicode17_documents": int(record["unicode17_documents"]),
            }
        )
        del item
    if config.output_format == "nanogpt":
        assert bos_id is not None  # checked by _load_tokenizer
        with contextlib.suppress(FileNotFoundError):
            os.remove(sidecar_path(run.output_prefix))
        write_nanogpt_output(parts, run.output_prefix, bos_id, config.nanogpt_shard_tokens)
        counts = dataset_counts(parts)
    else:
        merge_datasets(
            parts,
            run.output_prefix,
            progress=config.progress,
            move_single=not config.keep_parts,
        )
        counts = dataset_counts([run.output_prefix])
    write_merged_sidecar(run.output_prefix, run.fingerprint, per_input, run.options.dtype, *counts)
    if not config.keep_parts:
        shutil.rmtree(run.parts_directory, ignore_errors=True)
    return totals
