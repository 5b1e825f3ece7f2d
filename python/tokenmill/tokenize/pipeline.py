"""The parallel, restartable tokenize pipeline: text files in, one Megatron ``.bin/.idx`` out.

Algorithm:

1. The inputs (files, globs, directories) are expanded and sorted; input ``i`` belongs to rank
   ``i % world_size``. Each input becomes one *part*, ``<prefix>.parts/part-IIIIII-of-NNNNNN``
   (a Megatron ``.bin/.idx`` plus a ``.tokenmill.json`` record).
2. The parent streams each pending input as ordered chunks (:mod:`tokenmill.tokenize.readers`)
   to ``workers`` workers (0: in this process): processes for the reference backends (each
   single-threaded), threads for gigatoken (each encoding on its own thread with the GIL
   released; gigatoken's rayon pool is not used), so ``workers`` (``--threads``) is the whole
   parallelism. Each worker reads and encodes its chunk (BOS/EOD, windowing, dtype;
   :mod:`tokenmill.tokenize.encode`) and returns flat arrays. At most ``2 * workers + 2``
   chunks are in flight, and no more than ``memory_budget`` bytes by the estimate
   ``MEMORY_PER_TEXT_BYTE`` x chunk bytes (one chunk always proceeds, so a single document
   larger than the budget is encoded alone), so memory stays bounded whatever the input size;
   results are consumed in submission order, so the bytes written do not depend on the worker
   count.
3. A part's ``.bin`` and ``.idx`` go to temporary names and are renamed when the input is done;
   the record (the *manifest* entry: input path, size, mtime, job key, sizes, counts) is renamed
   into place last. A part counts as done only if its record matches the current input and job
   and the files have the recorded sizes, so a killed run resumes by skipping finished inputs and
   redoing the rest, and a changed input or option is redone rather than reused.
4. With ``world_size == 1`` the parts are concatenated (``IndexedDatasetBuilder.add_index``,
   megatron's merge semantics) into ``<prefix>.bin/.idx`` with ``<prefix>.tokenmill.json``; the
   parts directory is then removed unless ``keep_parts``. With several ranks each rank only
   writes its parts, and ``tokenmill merge <prefix>.parts --output <prefix>`` assembles them.

Ownership: the run holds ``<dir>/.<name>.tokenmill-owner`` (`tokenmill.common.ownership`; one rank of
several owns ``<prefix>.parts/rank-R-of-W``), so a second job writing the same output fails with
"X is being written by another tokenmill (pid, host)" instead of mixing its parts in; worker
processes exit when the job dies.

Each document becomes one sequence of one document in the output, exactly as megatron's
``tools/preprocess_data.py`` writes it (``--append-eod`` appends the EOD id; an empty document
becomes a document with no sequence and no EOD). ``window`` splits longer documents (after BOS
and EOD are added) into sequences of at most ``window`` tokens, consecutive ones sharing
``overlap`` tokens; they stay one document. The token dtype is ``DType.optimal_dtype(vocab)``.

Cost: tokenization dominates (5-30 MB/s per core, see benchmarks/TOKENIZE.md); the parent only
decompresses, cuts chunks at newlines and writes, which is two orders of magnitude cheaper.

Size: about 650 lines, kept together on purpose: the run plan (``_Run``), the chunk scheduler
(``_write_parts``), the part writer and the assembly share the run's identity and the resume
rule (what makes a part reusable), and reading them side by side is how that rule is checked.
The pieces with no such coupling live beside it (readers, encode, merge, nanogpt_output).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob as glob_module
import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy

from tokenmill.common.ownership import own_output
from tokenmill.errors import DataFormatError
from tokenmill.formats.dataset_sidecar import read_sidecar, sidecar_path, write_sidecar
from tokenmill.formats.megatron import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from tokenmill.tokenize.encode import (
    Encoded,
    EncodeOptions,
    Encoder,
    InlineExecutor,
    encode_in_worker,
    initialize_worker,
    process_context,
    window_bounds,
)
from tokenmill.tokenize.nanogpt_output import write_nanogpt_output
from tokenmill.tokenize.progress import Progress
from tokenmill.tokenize.readers import (
    GIGATOKEN_CHUNK_BYTES,
    Chunk,
    ReadOptions,
    expand_inputs,
    file_identity,
    iter_chunks,
)
from tokenmill.tokenize.tokenizers import Tokenizer, TokenizerSpec

__all__ = [
    "OUTPUT_FORMATS",
    "TokenizeConfig",
    "TokenizeResult",
    "encode_options",
    "part_files_complete",
    "part_prefix",
    "resolve_rank",
    "tokenize",
]

OUTPUT_FORMATS = ("megatron", "nanogpt")

DEFAULT_MEMORY_BUDGET = 1 << 30
"""Bytes of chunks in flight (by the estimate below), besides the output being written."""

MEMORY_PER_TEXT_BYTE = 6
"""Peak bytes held per byte of chunk text while it is encoded: the raw chunk, the packed text,
gigatoken's uint32 ids (4 bytes per 2.5-4 text bytes), the shaped tokens and numpy temporaries
(measured about 5x on the linux-doc corpus with GPT-2; benchmarks/TOKENIZE.md)."""

# Test hook: after this many parts are finished, the parent stops (until killed), so a kill test
# lands between two known events instead of racing a timer.
_PAUSE_VARIABLE = "TOKENMILL_TEST_PAUSE_AFTER_PARTS"
# Test hook, with the one above: the paused run creates "<this path>.paused" and goes on once the
# path itself exists, so a test can act while the run is known to be mid-way (owning its output).
_RESUME_VARIABLE = "TOKENMILL_TEST_RESUME_FILE"


def _test_pause() -> None:
    """The pause of the test hooks above: until killed, or until the resume file appears."""
    resume = os.environ.get(_RESUME_VARIABLE, "")
    if not resume:
        while True:
            time.sleep(3600)  # wait to be killed
    with open(f"{resume}.paused", "w"):
        pass
    while not os.path.exists(resume):
        time.sleep(0.01)


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from the arguments, else ``RANK``/``WORLD_SIZE``, else
    ``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT`` (task ids counted from
    ``SLURM_ARRAY_TASK_MIN``), else 0 and 1.

    Raises:
        ValueError: a value is not an integer, or the rank is outside ``[0, world_size)``.
    """

    def number(name: str, value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None

    source = "arguments"
    if rank is None and world_size is None:
        environ = os.environ
        if "RANK" in environ or "WORLD_SIZE" in environ:
            source = "RANK/WORLD_SIZE"
            rank = number("RANK", environ.get("RANK", "0"))
            world_size = number("WORLD_SIZE", environ.get("WORLD_SIZE", "1"))
        elif "SLURM_ARRAY_TASK_ID" in environ:
            source = "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
            minimum = number("SLURM_ARRAY_TASK_MIN", environ.get("SLURM_ARRAY_TASK_MIN", "0"))
            rank = number("SLURM_ARRAY_TASK_ID", environ["SLURM_ARRAY_TASK_ID"]) - minimum
            world_size = number(
                "SLURM_ARRAY_TASK_COUNT", environ.get("SLURM_ARRAY_TASK_COUNT", "1")
            )
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size} (from {source})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank} (from {source})")
    return rank, world_size


@dataclass(frozen=True)
class TokenizeConfig:
    """Everything ``tokenize`` needs, checked on construction.

    Args:
        inputs: files, globs or directories.
        output_prefix: the output dataset path without ``.bin``/``.idx``; an ``s3://`` prefix is
            written to a local staging path and uploaded (``tokenmill.storage.staging``).
        tokenizer: which tokenizer to run.
        read: how to read documents (keys, columns, txt mode, chunk size).
        prepend_bos: put the BOS id before every document.
        append_eod: put the EOD id after every document (megatron's ``--append-eod``).
        window: split documents longer than this many tokens into windows; None: never.
        overlap: tokens shared by consecutive windows, at most ``window // 2``.
        workers: the cores to use (the CLI's ``--threads``): encode threads for gigatoken,
            worker processes for the other backends; 0 encodes in this process.
        rank: this process's share of the inputs, see :func:`resolve_rank`.
        world_size: the number of processes sharing the inputs.
        output_format: "megatron" (`.bin/.idx`), or "nanogpt": a modded-nanogpt shard
            `<output_prefix>.bin` with its `.bos.idx` (documents start with BOS: needs a BOS id
            and prepend_bos); above ``nanogpt_shard_tokens`` tokens (default 10**8, fineweb's
            shards) the output is split into `<output_prefix>_000000.bin`, ...
        nanogpt_shard_tokens: tokens per nanogpt shard (see ``formats.nanogpt.shard_token_cap``).
        keep_parts: keep ``<prefix>.parts`` after assembling the output.
        progress: draw a progress bar on stderr.
        memory_budget: bytes the chunks in flight may take (estimated as
            ``MEMORY_PER_TEXT_BYTE`` x their text); the output being written (the index arrays,
            8 bytes per sequence and document) comes on top.
        assemble: with ``world_size == 1``, concatenate the parts into the output; False: leave
            them in ``<prefix>.parts`` (as a rank of several does), for a caller that uses each
            part itself (the raw-text cache: one pipeline run per rank over all its pieces).
        on_part: called with (input path, part prefix) as soon as each part is finished, in
            input order, while the next inputs are still being encoded; it may move the part's
            files away (then pass ``assemble=False``). Not part of the job's identity.
    """

    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    read: ReadOptions = field(default_factory=ReadOptions)
    prepend_bos: bool = False
    append_eod: bool = True
    window: int | None = None
    overlap: int = 0
    workers: int = 0
    rank: int = 0
    world_size: int = 1
    output_format: str = "megatron"
    nanogpt_shard_tokens: int | None = None
    keep_parts: bool = False
    progress: bool = True
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    assemble: bool = True
    on_part: Callable[[str, str], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        inputs: object = self.inputs
        if isinstance(inputs, str):
            raise TypeError(f"inputs must be a sequence of paths, got the string {inputs!r}")
        object.__setattr__(self, "inputs", tuple(os.fspath(item) for item in self.inputs))
        if not self.inputs:
            raise ValueError("inputs must name at least one file, glob or directory")
        if not self.output_prefix:
            raise ValueError("output_prefix must be a non-empty path")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(
                f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, "
                f"got {self.output_format!r}"
            )
        if self.window is not None:
            window_bounds(0, self.window, self.overlap)  # validates window and overlap
        elif self.overlap:
            raise ValueError(f"overlap={self.overlap} needs a window; got window=None")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {self.memory_budget}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")


@dataclass
class TokenizeResult:
    """What a run did."""

    output_prefix: str | None
    parts: list[str]
    skipped: list[str]
    documents: int
    tokens: int
    text_bytes: int
    seconds: float
    fingerprint: dict[str, Any]
    backend: str = ""
    unicode17_documents: int = 0


def part_prefix(parts_directory: str, index: int, count: int) -> str:
    """The prefix of input ``index``'s part among ``count`` inputs."""
    return os.path.join(parts_directory, f"part-{index:06d}-of-{count:06d}")


def _job_key(fingerprint: dict[str, Any], options: EncodeOptions, output_format: str) -> str:
    read = asdict(options.read)
    read.pop("chunk_bytes")  # chunking never changes the output
    for limit in ("max_record_bytes", "max_decompression_ratio"):
        read.pop(limit)  # a limit refuses or accepts; it never changes what is written
    payload = {
        "tokenizer": fingerprint,
        "read": read,
        "dtype": options.dtype,
        "prepend_bos": options.prepend_bos,
        "append_eod": options.append_eod,
        "window": options.window,
        "overlap": options.overlap,
        "format": output_format,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _part_is_done(prefix: str, identity: dict[str, Any], job: str) -> bool:
    try:
        record = read_sidecar(prefix)
    except DataFormatError:
        return False
    if record.get("job") != job or record.get("inputs") != [identity]:
        return False
    return part_files_complete(prefix, record)


def _remove_leftovers(prefix: str) -> None:
    """Remove a part's files and the temporary files a killed run left behind."""
    directory, name = os.path.split(prefix)
    for suffix in (".bin", ".idx", ".tokenmill.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(prefix + suffix)
        for leftover in glob_module.glob(
            os.path.join(
                glob_module.escape(directory), f".{glob_module.escape(name + suffix)}.*.tmp"
            )
        ):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)


def _check_output_format(output_format: str) -> None:
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(
            f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}"
        )


def _tokenize_to_object_storage(config: TokenizeConfig) -> TokenizeResult:
    """An ``s3://`` output prefix: tokenize into the staging path, then upload (see
    ``tokenmill.storage.staging``); a rerun after a kill resumes from the staged parts."""
    from tokenmill.storage.object_storage import require_s3
    from tokenmill.storage.staging import remove_staged_prefix, staged_path, upload_prefix

    require_s3(config.output_prefix)
    if config.world_size != 1:
        raise ValueError(
            f"an s3:// output ({config.output_prefix}) needs world_size 1 (got "
            f"{config.world_size}): with several machines, tokenize to a shared filesystem, run "
            "`tokenmill merge` there, and upload the result"
        )
    local = staged_path(config.output_prefix)
    result = tokenize(dataclasses.replace(config, output_prefix=local))
    upload_prefix(local, config.output_prefix)
    if not config.keep_parts:
        remove_staged_prefix(local)
    return dataclasses.replace(result, output_prefix=config.output_prefix)


def tokenize(config: TokenizeConfig) -> TokenizeResult:
    """Tokenize text files into a Megatron ``.bin/.idx`` dataset (see the module docstring).

    Args:
        config: what to read, how to tokenize, where to write.

    Returns:
        The parts written, the inputs skipped because a previous run finished them, totals.

    Raises:
        FileNotFoundError: an input or the tokenizer file is missing.
        DataFormatError: an input is malformed (names the file, line and field).
        ValueError: the tokenizer lacks a BOS/EOD id that the options need.
    """
    if config.output_prefix.startswith(("s3://", "msc://")):
        return _tokenize_to_object_storage(config)
    _check_output_format(config.output_format)
    if config.output_format == "nanogpt" and not config.prepend_bos:
        raise ValueError(
            "output_format 'nanogpt' needs prepend_bos (--prepend-bos): its documents start with BOS and "
            "its .bos.idx lists them"
        )
    started = time.perf_counter()
    tokenizer = _load_tokenizer(config)
    if config.read.chunk_bytes is None:
        chunk_bytes = GIGATOKEN_CHUNK_BYTES if tokenizer.backend == "gigatoken" else None
        config = dataclasses.replace(
            config, read=dataclasses.replace(config.read, chunk_bytes=chunk_bytes)
        )
    # one writer per output: a second job gets OutputBusyError instead of mixing its parts in
    owned = config.output_prefix if config.world_size == 1 else _rank_prefix(config)
    with own_output(owned):
        return _tokenize_owned(config, tokenizer, started)


def _rank_prefix(config: TokenizeConfig) -> str:
    """What one rank of a multi-rank job owns: its share of the parts."""
    return f"{config.output_prefix}.parts/rank-{config.rank}-of-{config.world_size}"


def _tokenize_owned(config: TokenizeConfig, tokenizer: Tokenizer, started: float) -> TokenizeResult:
    """`tokenize` once the output (or this rank's share) is owned."""
    run = _Run.plan(config, tokenizer)
    progress = Progress(
        sum(identity["size"] for _, identity in run.pending), enabled=config.progress
    )
    if config.progress:
        count = max(1, config.workers)
        if tokenizer.backend == "gigatoken":
            unit = "thread" if count == 1 else "threads"
        else:
            unit = "worker process" if config.workers else "process"
            unit = unit if count == 1 else unit + "es"
        progress.write(f"[tokenize] backend: {tokenizer.describe_backend()}; {count} {unit}")
        progress.write(f"[tokenize] markers: {describe_markers(config, tokenizer)}")
    if run.skipped and config.progress:
        progress.write(
            f"[tokenize] skipped {len(run.skipped)} completed input(s) of {len(run.mine)} "
            f"(parts in {run.parts_directory})"
        )
    written, totals = _write_parts(config, run, progress, tokenizer)
    progress.close()
    if totals["unicode17_documents"] and config.progress:
        reference = "tiktoken" if tokenizer.kind == "tiktoken" else "tokenizers"
        handled = (
            f"encoded by the reference backend ({reference}), as gigatoken classifies them "
            "differently"
            if run.fingerprint.get("unicode17") == "reference"
            else f"kept gigatoken's ids, which differ from {reference}'s ({reference} is not "
            "installed)"
        )
        progress.write(
            f"[tokenize] {totals['unicode17_documents']:,} document(s) hold code points new "
            f"in Unicode 17.0: {handled}"
        )

    result_prefix: str | None = None
    if config.world_size == 1 and config.assemble:
        _assemble(config, run, tokenizer)
        result_prefix = run.output_prefix
    elif config.progress and config.world_size > 1:
        progress.write(
            f"[tokenize] rank {config.rank}/{config.world_size}: {len(written)} part(s) written, "
            f"{len(run.skipped)} skipped; when every rank is done run: tokenmill merge "
            f"{run.parts_directory} --output {run.output_prefix}"
        )
    return TokenizeResult(
        output_prefix=result_prefix,
        parts=written,
        skipped=run.skipped,
        documents=totals["documents"],
        tokens=totals["tokens"],
        text_bytes=totals["text_bytes"],
        seconds=time.perf_counter() - started,
        fingerprint=run.fingerprint,
        backend=tokenizer.describe_backend(),
        unicode17_documents=totals["unicode17_documents"],
    )


def describe_markers(config: TokenizeConfig, tokenizer: Tokenizer) -> str:
    """The special tokens a run adds to each document, e.g. ``BOS 50256 before each document,
    no EOD`` (printed by ``tokenmill tokenize`` so the output holds no surprise)."""
    bos = f"BOS {tokenizer.bos_id} before each document" if config.prepend_bos else "no BOS"
    eod = f"EOD {tokenizer.eod_id} after each document" if config.append_eod else "no EOD"
    return f"{bos}, {eod}"


def _load_tokenizer(config: TokenizeConfig) -> Tokenizer:
    """The configured tokenizer, with every special id the options need.

    Raises:
        ValueError: the tokenizer lacks a BOS/EOD id that the options need.
    """
    tokenizer = config.tokenizer.load()
    for wanted, name, value in (
        (config.prepend_bos, "BOS (prepend_bos)", tokenizer.bos_id),
        (config.append_eod, "EOD (append_eod)", tokenizer.eod_id),
        (config.output_format == "nanogpt", "BOS (nanogpt output)", tokenizer.bos_id),
    ):
        if wanted and value is None:
            raise ValueError(
                f"tokenizer {tokenizer.describe()} has no {name} token; name one with "
                "--bos-token/--eod-token or switch the option off"
            )
    return tokenizer


def part_files_complete(prefix: str, record: dict[str, Any]) -> bool:
    """Whether the part `prefix`'s .bin and .idx have the sizes its record names (a part's
    record is written last, so sizes that differ mean the files are not the ones it vouches
    for); shared by the local pipeline and the Ray engine."""
    for path, key in ((get_bin_path(prefix), "bin_bytes"), (get_idx_path(prefix), "idx_bytes")):
        try:
            if os.path.getsize(path) != record.get(key):
                return False
        except OSError:
            return False
    return True


def encode_options(config: TokenizeConfig, tokenizer: Tokenizer) -> EncodeOptions:
    """What every part of `config`'s run is encoded with (the smallest dtype holding the
    tokenizer's ids): one derivation for the local pipeline and the Ray engine, whose parts must
    be byte-identical."""
    return EncodeOptions(
        read=config.read,
        dtype=numpy.dtype(DType.optimal_dtype(tokenizer.vocab_size)).name,
        vocab_size=tokenizer.vocab_size,
        bos_id=tokenizer.bos_id,
        eod_id=tokenizer.eod_id,
        prepend_bos=config.prepend_bos,
        append_eod=config.append_eod,
        window=config.window,
        overlap=config.overlap,
    )


@dataclass
class _Run:
    """One rank's work: the job identity and which of its inputs still need a part."""

    fingerprint: dict[str, Any]
    spec: TokenizerSpec
    options: EncodeOptions
    job: str
    option_fields: dict[str, Any]
    files: list[str]
    output_prefix: str
    parts_directory: str
    mine: list[int]
    pending: list[tuple[int, dict[str, Any]]]
    skipped: list[str]

    @classmethod
    def plan(cls, config: TokenizeConfig, tokenizer: Tokenizer) -> _Run:
        """The job key, the parts directory (created), and this rank's pending inputs; the
        leftovers of a killed run are removed from every pending part."""
        fingerprint = tokenizer.fingerprint()
        options = encode_options(config, tokenizer)
        job = _job_key(fingerprint, options, config.output_format)
        files = expand_inputs(config.inputs)
        output_prefix = os.path.abspath(config.output_prefix)
        parts_directory = output_prefix + ".parts"
        _own_directory(parts_directory)
        mine = [index for index in range(len(files)) if index % config.world_size == config.rank]
        pending: list[tuple[int, dict[str, Any]]] = []
        skipped: list[str] = []
        for index in mine:
            identity = file_identity(files[index])
            prefix = part_prefix(parts_directory, index, len(files))
            if _part_is_done(prefix, identity, job):
                skipped.append(files[index])
            else:
                _remove_leftovers(prefix)
                pending.append((index, identity))
        option_fields = {
            "prepend_bos": config.prepend_bos,
            "append_eod": config.append_eod,
            "window": config.window,
            "overlap": config.overlap,
        }
        return cls(
            fingerprint=fingerprint,
            spec=config.tokenizer.resolved(tokenizer),
            options=options,
            job=job,
            option_fields=option_fields,
            files=files,
            output_prefix=output_prefix,
            parts_directory=parts_directory,
            mine=mine,
            pending=pending,
            skipped=skipped,
        )

    def part(self, index: int) -> str:
        """The prefix of input `index`'s part."""
        return part_prefix(self.parts_directory, index, len(self.files))


def _own_directory(path: str) -> None:
    """Create the directory `path` (its parent may be missing) or take the one there, refusing a
    symlink or anything else planted at that name: parts are never written through a link
    (elsewhere on the machine), and the directory is removed whole at the end.

    Raises:
        ValueError: `path` is a symlink or not a directory.
    """
    import stat

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    status = os.lstat(path)
    if stat.S_ISLNK(status.st_mode):
        raise ValueError(
            f"refusing to write parts into {path}: it is a symlink to {os.path.realpath(path)} "
            "(tokenmill did not create it); remove it"
        )
    if not stat.S_ISDIR(status.st_mode):
        raise ValueError(f"refusing to write parts into {path}: it is not a directory")


def _chunk_text_bytes(chunk: Chunk) -> int:
    """The text a chunk holds (for the memory budget): its bytes, or a parquet row group's
    uncompressed size."""
    if chunk.kind != "parquet":
        return len(chunk.data)
    from tokenmill.tokenize.readers import _open_parquet

    return int(_open_parquet(chunk.path).metadata.row_group(chunk.row_group).total_byte_size)


def _write_parts(
    config: TokenizeConfig, run: _Run, progress: Progress, tokenizer: Tokenizer
) -> tuple[list[str], dict[str, int]]:
    """Encode every pending input on the workers and write its part, in input order.

    Returns:
        The parts written and the totals (documents, tokens, text bytes, Unicode-17 documents).
    """
    pause_after = int(os.environ.get(_PAUSE_VARIABLE, "0") or 0)
    executor: Any
    encoder = None
    if config.workers == 0 or tokenizer.backend == "gigatoken":
        encoder = Encoder(run.spec, run.options, tokenizer)
    if encoder is not None and config.workers == 0:
        executor = InlineExecutor(encoder)
    elif tokenizer.backend == "gigatoken":
        executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="encode")
    else:
        executor = ProcessPoolExecutor(
            max_workers=config.workers,
            mp_context=process_context(),
            initializer=initialize_worker,
            initargs=(run.spec, run.options, os.getpid()),
        )
    task = encoder if encoder is not None and config.workers > 0 else encode_in_worker
    window = 2 * config.workers + 2
    budget = config.memory_budget
    sizes: dict[int, int] = {}  # id(future) -> estimated bytes held

    def jobs() -> Iterator[tuple[int, Future[Encoded] | None]]:
        for index, _ in run.pending:
            for chunk in iter_chunks(run.files[index], config.read):
                future = executor.submit(task, chunk)
                sizes[id(future)] = MEMORY_PER_TEXT_BYTE * _chunk_text_bytes(chunk)
                yield index, future
            yield index, None  # end of this input

    totals = {"documents": 0, "tokens": 0, "text_bytes": 0, "unicode17_documents": 0}
    writers: dict[int, _PartWriter] = {}
    written: list[str] = []
    identities = dict(run.pending)

    def consume(index: int, future: Future[Encoded] | None) -> None:
        nonlocal pause_after
        if index not in writers:
            writers[index] = _PartWriter(run.part(index), run.options.dtype)
        if future is None:  # the input is done
            written.append(writers.pop(index).finish(run, identities[index]))
            if config.on_part is not None:
                config.on_part(run.files[index], written[-1])
            if pause_after and len(written) >= pause_after:
                pause_after = 0
                _test_pause()
            return
        sizes.pop(id(future), None)
        encoded = future.result()
        writers[index].add(encoded)
        tokens = int(encoded.tokens.shape[0])
        progress.update(encoded.documents, tokens, encoded.text_bytes, encoded.source_bytes)
        totals["documents"] += encoded.documents
        totals["tokens"] += tokens
        totals["text_bytes"] += encoded.text_bytes
        totals["unicode17_documents"] += encoded.unicode17_documents

    try:
        inflight: deque[tuple[int, Future[Encoded] | None]] = deque()
        for item in jobs():
            inflight.append(item)
            while len(inflight) > window or (len(inflight) > 1 and sum(sizes.values()) > budget):
                consume(*inflight.popleft())
        while inflight:
            consume(*inflight.popleft())
    except BaseException:
        # wait=True: the queued chunks are cancelled and the running ones (at most one per
        # worker) finish, so the pool's manager thread has ended when the error reaches the
        # caller. With wait=False it was still running at interpreter exit, where CPython
        # 3.11's exit hook writes to the pipe that thread closes as it ends (no lock between
        # the two): now and then "Exception ignored ... Bad file descriptor" (or "handle is
        # closed") followed tokenize's one-line error.
        executor.shutdown(wait=True, cancel_futures=True)
        writers.clear()  # abandoned builders delete their temporary .bin
        raise
    executor.shutdown(wait=True)
    return written, totals


class _PartWriter:
    """One input's part: its ``.bin/.idx`` builder and counts, then its sidecar record."""

    def __init__(self, prefix: str, dtype: str) -> None:
        self.prefix = prefix
        self.builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.dtype(dtype))
        self.counts = {"documents": 0, "sequences": 0, "tokens": 0, "unicode17_documents": 0}

    def add(self, encoded: Encoded) -> None:
        self.builder.add_documents(
            encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
        )
        self.counts["documents"] += encoded.documents
        self.counts["sequences"] += int(encoded.sequence_lengths.shape[0])
        self.counts["tokens"] += int(encoded.tokens.shape[0])
        self.counts["unicode17_documents"] += encoded.unicode17_documents

    def finish(self, run: _Run, identity: dict[str, Any]) -> str:
        """Finalize the ``.bin/.idx``, then write the record that marks the part done."""
        prefix = self.prefix
        self.builder.finalize(get_idx_path(prefix))
        write_sidecar(
            prefix,
            run.fingerprint,
            job=run.job,
            inputs=[dict(identity)],
            options=run.option_fields,
            dtype=run.options.dtype,
            bin_bytes=os.path.getsize(get_bin_path(prefix)),
            idx_bytes=os.path.getsize(get_idx_path(prefix)),
            **self.counts,
        )
        return prefix


def _assemble(config: TokenizeConfig, run: _Run, tokenizer: Tokenizer) -> None:
    """Merge every part into the output (one rank: all parts are this run's) and remove the
    parts directory unless asked to keep it."""
    from tokenmill.formats.dataset_sidecar import check_compatible
    from tokenmill.tokenize.merge import dataset_counts, merge_datasets, write_merged_sidecar

    all_parts = [run.part(index) for index in range(len(run.files))]
    if config.output_format == "nanogpt":
        assert tokenizer.bos_id is not None  # checked by _load_tokenizer
        fingerprint = check_compatible(all_parts)
        with contextlib.suppress(FileNotFoundError):
            os.remove(sidecar_path(run.output_prefix))
        write_nanogpt_output(
            all_parts, run.output_prefix, tokenizer.bos_id, config.nanogpt_shard_tokens
        )
        write_merged_sidecar(
            run.output_prefix,
            fingerprint,
            [read_sidecar(part) for part in all_parts],
            run.options.dtype,
            *dataset_counts(all_parts),
        )
    else:
        # one part (one input) is renamed into place: the same bytes, written once
        merge_datasets(
            all_parts,
            run.output_prefix,
            progress=config.progress,
            move_single=not config.keep_parts,
        )
    if not config.keep_parts:
        shutil.rmtree(run.parts_directory, ignore_errors=True)
