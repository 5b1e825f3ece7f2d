"""Raw text at launch: every rank tokenizes its share of a blend's raw-text entries into a
content-addressed cache of Megatron prefixes, which the ordinary GPTDataset path then reads.

Algorithm (:func:`tokenize_raw_text`, run by every rank with the same arguments):

1. Each entry (a file, a directory or a glob) is expanded exactly as ``tokenmill tokenize``
   expands its inputs (:func:`tokenmill.tokenize.expand_inputs`: sorted; directories searched
   recursively). A *piece* is one input file.
2. A piece's key is the sha256 of its input fingerprint (absolute path, size, mtime and ctime in
   nanoseconds), the tokenizer's fingerprint (file sha256, kind, vocabulary, special ids,
   backend and version) and the options (read options, BOS/EOD, dtype). Its prefix is
   ``<cache>/pieces/<key>``. A piece is *committed* when ``<key>.tokenmill.json`` exists: the
   ``.bin`` and ``.idx`` are renamed into place first and the sidecar last (`_commit_prefix`,
   the one place that names the cache's files); their data was fsynced by its writer before,
   and the renames of a rank's batch are made durable by one fsync of the cache directory. Committed pieces are never
   rewritten, so a second launch tokenizes nothing, a killed launch leaves only whole pieces
   (plus a temporary directory, removed when its piece is next tokenized), and a changed input
   file changes only its own key.
3. The pieces are shared out by size (largest first, to the least loaded rank; ties by path),
   a pure function of the piece list, so every rank computes the same plan without talking.
   Each rank tokenizes all its uncommitted pieces in one run of ``tokenmill tokenize``'s own
   pipeline (``assemble=False``; each part, the bytes of the offline run's part for that input,
   is committed by the ``on_part`` callback as soon as it is finished, so a kill loses only the
   pieces in flight). Then every rank publishes its outcome and waits only for the owners of
   the pieces it still does not see committed (`distributed.share_outcome`: no barrier, so a
   warm relaunch, where every piece is committed, waits for nobody; a failing owner's error is
   raised on every rank waiting for its pieces, which in one job is every rank).
4. An entry of one file resolves to its piece. An entry of several files resolves to the merge
   of its pieces in input order, ``<cache>/merged/<sha256 of the piece keys>``: every rank
   copies the pieces it tokenized into the merged ``.bin`` at their offsets, in parallel, and
   rank ``i % world`` joins merge ``i``'s indices as ``IndexedDatasetBuilder.add_index`` does
   (`_concatenate`), the same bytes ``tokenmill tokenize`` writes from its parts. So each entry's prefix holds the
   same documents, sequences and tokens, in the same order, as ``tokenmill tokenize ENTRY``'s
   output, whatever the number of ranks or pieces, and the samples of GPTDataset over it are
   the offline path's.

Memory per rank is bounded by the pipeline's streaming window (``memory_budget`` of chunks in
flight) and the merge's block copy, never by the input size. Rank 0 shows a progress bar over
its share (tqdm on a terminal, plain lines in logs); every rank logs one summary line.

Tokenizers (:func:`adapt_tokenizer`): a tokenmill spec (a ``tokenizer.json`` / ``.tiktoken``
path, optionally ``gigatoken:``/``reference:``, or a ``TokenizerSpec``) is loaded, and the
loaded object replaces the spec in the datasets' config (it carries ``vocab_size`` and ``eod``);
a tokenmill tokenizer object is used as it is; any other object is treated as a Megatron
tokenizer: when it is backed by a ``tokenizer.json`` or ``.tiktoken`` file tokenmill reads, that
file runs on tokenmill's fast backend once it gives the same ids as the object's own
``tokenize`` (and the same EOD) on a sample of the data; otherwise the object's ``tokenize``
encodes every document (correct, slower; said once in the log).

Not yet: ``s3://`` entries (a clear ValueError names them), pieces smaller than a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy

from tokenmill.common import distributed
from tokenmill.common.atomic import atomic_write_text, fsync_directory, fsync_enabled
from tokenmill.common.cache_directory import check_cache_directory
from tokenmill.common.progress import Progress
from tokenmill.datasets.raw_text import RawTextResolution
from tokenmill.formats.dataset_sidecar import check_compatible, read_sidecar, sidecar_path
from tokenmill.formats.megatron import (
    DType,
    get_bin_path,
    get_idx_path,
)
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
from tokenmill.tokenize.readers import ReadOptions, expand_inputs, read_documents
from tokenmill.tokenize.reference_backends import Tokenizer, package_version, tokenmill_version
from tokenmill.tokenize.tokenizers import TokenizerSpec

__all__ = [
    "RawText",
    "RawTextStats",
    "adapt_tokenizer",
    "adapt_tokenizer_once",
    "tokenize_raw_text",
]

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
"""Bumped when the bytes a piece holds for the same key would change."""

# Test hook: after this many pieces are committed, the rank stops until killed (so a kill test
# lands between two known events instead of racing a timer).
_PAUSE_VARIABLE = "TOKENMILL_TEST_RAW_TEXT_PAUSE_AFTER_PIECES"
_PAUSED_VARIABLE = "TOKENMILL_TEST_RAW_TEXT_PAUSED_FILE"  # created when the pause begins


@dataclass(frozen=True)
class RawText:
    """Options of raw-text blend entries, and their resolver (``GPTDatasetConfig.raw_text``).

    Args:
        cache_dir: where the tokenized pieces go; None: ``<path_to_cache>/raw_text`` of the
            config (one of the two is needed; all ranks must see the same directory).
        json_key: the field of each JSON line that holds the text (``tokenmill tokenize``'s).
        column: the parquet column that holds the text.
        prepend_bos: put the tokenizer's BOS before each document.
        append_eod: put its EOD after each document (``tokenmill tokenize``'s default).
        threads: gigatoken threads per rank; None: the node's cores over its ranks, at most 8.
        memory_budget: bytes of text chunks in flight per rank (the streaming window).
        sample_documents: documents on which a Megatron tokenizer and the fast backend of its
            file must agree before the fast backend is used.
        progress: progress bar on rank 0.
    """

    cache_dir: str | None = None
    json_key: str = "text"
    column: str = "text"
    prepend_bos: bool = False
    append_eod: bool = True
    threads: int | None = None
    memory_budget: int = 256 << 20
    sample_documents: int = 64
    progress: bool = True

    def resolve(self, entries: Sequence[str], config: Any) -> RawTextResolution:
        """The prefix of each raw-text entry (the datasets layer's resolver protocol)."""
        cache_dir = self.cache_dir
        if cache_dir is None:
            if getattr(config, "path_to_cache", None) is None:
                raise ValueError(
                    f"blend entry {entries[0]!r} names raw text: its tokens need a cache "
                    "directory shared by all ranks; set path_to_cache or RawText(cache_dir=...)"
                )
            # a world-writable path_to_cache would let another user make raw_text/ first
            check_cache_directory(config.path_to_cache)
            cache_dir = os.path.join(config.path_to_cache, "raw_text")
        prefixes, stats, replacement = tokenize_raw_text(entries, config.tokenizer, cache_dir, self)
        logger.info("%s", stats.summary())
        return RawTextResolution(prefixes=prefixes, tokenizer=replacement)


@dataclass
class RawTextStats:
    """What one rank did."""

    rank: int
    world_size: int
    pieces: int = 0
    tokenized: list[str] = dataclasses.field(default_factory=list)
    reused: int = 0
    merged: int = 0
    text_bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    backend: str = ""

    def summary(self) -> str:
        """One log line."""
        rate = self.text_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"[raw text] rank {self.rank}/{self.world_size}: tokenized {len(self.tokenized)} of "
            f"{self.pieces} piece(s) ({self.text_bytes / 1e6:.1f} MB of text, {self.tokens:,} "
            f"tokens, {rate:.1f} MB/s), {self.reused} already cached, {self.merged} merge(s), "
            f"{self.seconds:.1f} s; backend {self.backend}"
        )


@dataclass(frozen=True)
class _Loaded(TokenizerSpec):
    """A spec whose tokenizer is already loaded (a tokenmill or wrapped Megatron object): the
    pipeline runs it in this process or on its threads, never pickles it."""

    loaded: Any = None

    def load(self) -> Tokenizer:
        return self.loaded  # type: ignore[no-any-return]

    def resolved(self, tokenizer: Tokenizer) -> TokenizerSpec:
        return self


class MegatronTokenizerAdapter(Tokenizer):
    """A Megatron tokenizer's own ``tokenize`` as a tokenmill tokenizer (the slow path)."""

    def __init__(self, tokenizer: Any) -> None:
        self.wrapped = tokenizer
        self.kind = "megatron"
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod_id = _special_id(tokenizer, "eod")
        self.bos_id = _special_id(tokenizer, "bos")
        self.path = None
        self.backend = "megatron"
        description = getattr(tokenizer, "unique_identifiers", None) or {
            "class": type(tokenizer).__qualname__,
            "vocab_size": self.vocab_size,
        }
        self.sha256 = hashlib.sha256(
            json.dumps(description, sort_keys=True, default=str).encode()
        ).hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        return [numpy.asarray(self.wrapped.tokenize(text), dtype=numpy.int64) for text in texts]

    def decode(self, ids: Any) -> str:
        return str(self.wrapped.detokenize(list(ids)))

    def backend_fields(self) -> dict[str, Any]:
        return {"backend": "megatron", "backend_version": type(self.wrapped).__qualname__}

    def describe(self) -> str:
        return f"megatron ({type(self.wrapped).__qualname__})"


def _special_id(tokenizer: Any, name: str) -> int | None:
    try:
        value = getattr(tokenizer, name, None)
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return None if value is None else int(value)


def _tokenizer_file(tokenizer: Any) -> str | None:
    """The ``tokenizer.json`` or ``.tiktoken`` file behind a Megatron tokenizer, if any."""
    candidates: list[Any] = []
    for owner in (
        tokenizer,
        getattr(tokenizer, "_tokenizer", None),
        getattr(tokenizer, "tokenizer", None),
    ):
        if owner is None:
            continue
        for name in (
            "tokenizer_model",
            "tokenizer_path",
            "pretrained_model_name_or_path",
            "name_or_path",
            "path",
            "vocab_file",
        ):
            candidates.append(getattr(owner, name, None))
        init_kwargs = getattr(owner, "init_kwargs", None)
        if isinstance(init_kwargs, dict):
            candidates.append(init_kwargs.get("tokenizer_file"))
    for candidate in candidates:
        if not isinstance(candidate, (str, os.PathLike)):
            continue
        path = os.fspath(candidate)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return os.path.join(path, "tokenizer.json")
        if os.path.isfile(path) and path.endswith((".json", ".tiktoken")):
            return path
    return None


def adapt_tokenizer(
    tokenizer: Any, sample_file: str, options: RawText
) -> tuple[TokenizerSpec, Tokenizer, Any]:
    """The spec the pipeline runs, the loaded tokenizer, and the object the datasets should use
    instead of ``tokenizer`` (None: keep it). See the module docstring for the cases."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = TokenizerSpec.parse(os.fspath(tokenizer))
    if isinstance(tokenizer, TokenizerSpec):
        loaded = tokenizer.load()
        return _Loaded(loaded=loaded), loaded, loaded
    if isinstance(tokenizer, Tokenizer):
        return _Loaded(loaded=tokenizer), tokenizer, None
    if not callable(getattr(tokenizer, "tokenize", None)):
        raise ValueError(
            f"the config's tokenizer {tokenizer!r} is neither a tokenmill tokenizer (spec or "
            "object) nor a Megatron tokenizer (no tokenize method): raw text cannot be tokenized"
        )
    path = _tokenizer_file(tokenizer)
    reason: str | None = "it names no tokenizer.json or .tiktoken file tokenmill reads"
    if path is not None:
        fast = TokenizerSpec.parse(path).load()
        reason = _disagreement(tokenizer, fast, sample_file, options)
        if reason is None:
            logger.info(
                "[raw text] %s: its file %s runs on %s (same ids on a sample of %s)",
                type(tokenizer).__qualname__,
                path,
                fast.describe_backend(),
                sample_file,
            )
            return _Loaded(loaded=fast), fast, None
    adapter = MegatronTokenizerAdapter(tokenizer)
    logger.warning(
        "[raw text] %s: tokenizing with its own tokenize() (slower): %s",
        type(tokenizer).__qualname__,
        reason,
    )
    return _Loaded(loaded=adapter), adapter, None


def _disagreement(megatron: Any, fast: Tokenizer, sample_file: str, options: RawText) -> str | None:
    """Why the fast backend cannot stand in for a Megatron tokenizer, or None if it can."""
    if int(megatron.vocab_size) != fast.vocab_size:
        return f"vocabulary {megatron.vocab_size} != the file's {fast.vocab_size}"
    for name, wanted, mine in (
        ("EOD", options.append_eod, fast.eod_id),
        ("BOS", options.prepend_bos, fast.bos_id),
    ):
        if wanted and _special_id(megatron, name.lower()) != mine:
            return f"its {name} id {_special_id(megatron, name.lower())} != the file's {mine}"
    read = ReadOptions(json_key=options.json_key, column=options.column)
    for number, text in enumerate(read_documents(sample_file, read)):
        if number >= options.sample_documents:
            break
        expected = [int(i) for i in megatron.tokenize(text)]
        got = [int(i) for i in fast.encode_batch([text])[0]]
        if expected != got:
            return f"document {number} of {sample_file} encodes differently"
    return None


@dataclass
class _Adapted:
    """What the resolver needs of the tokenizer: its fingerprint (the piece keys), vocabulary
    size (the dtype), backend (the log), the datasets' replacement, and the pipeline's spec,
    loaded only when a piece is to be tokenized (`spec`)."""

    fingerprint: dict[str, Any]
    vocab_size: int
    backend: str
    replacement: Any
    load: Callable[[], tuple[TokenizerSpec, Tokenizer]]
    record: str | None = None  # the recorded verdict the fingerprint was read from

    def spec(self) -> TokenizerSpec:
        """The pipeline's spec. Raises RuntimeError if the loaded tokenizer's fingerprint is not
        the one the keys were computed with (a recorded verdict that no longer holds)."""
        spec, loaded = self.load()
        fresh = json.dumps(loaded.fingerprint(), sort_keys=True, default=str)
        if fresh != json.dumps(self.fingerprint, sort_keys=True, default=str):
            raise RuntimeError(
                f"{self.record}: the tokenizer loaded now ({loaded.describe_backend()}) has "
                "another fingerprint than the recorded verdict the piece keys were computed "
                f"with: {fresh} != "
                f"{json.dumps(self.fingerprint, sort_keys=True, default=str)}; delete the "
                "record and relaunch"
            )
        return spec


def _adapted(loaded: Tokenizer, spec: TokenizerSpec, replacement: Any) -> _Adapted:
    return _Adapted(
        fingerprint=loaded.fingerprint(),
        vocab_size=int(loaded.vocab_size),
        backend=loaded.describe_backend(),
        replacement=replacement,
        load=lambda: (spec, loaded),
    )


# Texts every Megatron tokenizer encodes into the verdict's key: a tokenizer configured to
# encode differently (a BOS added, special-token text read as special, a prefix space) gets
# another key, whatever its identifiers say.
_PROBES = ("", "Hello, world!", " two  spaces\tand a tab\n", "<|endoftext|>", "émile 数据 🙂 12.5%")

# The files beside a tokenizer file that a HuggingFace or Megatron tokenizer also reads.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _verdict_key(tokenizer: Any, path: str | None, sample_file: str, options: RawText) -> str:
    """The key of a Megatron tokenizer's verdict: its identity and behaviour on the probes,
    its files (name, size, times), the sampled file (path, size, times), the options the
    sample check reads, and tokenmill's and gigatoken's versions."""

    def status(file: str) -> list[Any]:
        found = os.stat(file)
        return [os.path.abspath(file), found.st_size, found.st_mtime_ns, found.st_ctime_ns]

    files: list[Any] = []
    if path is not None:
        directory = os.path.dirname(path)
        names = sorted({os.path.basename(path), *_TOKENIZER_FILES})
        files = [
            status(os.path.join(directory, n))
            for n in names
            if os.path.isfile(os.path.join(directory, n))
        ]
    try:
        probes: Any = [[int(i) for i in tokenizer.tokenize(text)] for text in _PROBES]
    except Exception as error:  # a tokenizer that refuses a probe: that is its behaviour
        probes = f"{type(error).__name__}: {error}"
    payload = {
        "version": CACHE_VERSION,
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "identifiers": getattr(tokenizer, "unique_identifiers", None),
        "vocab_size": int(tokenizer.vocab_size),
        "eod": _special_id(tokenizer, "eod"),
        "bos": _special_id(tokenizer, "bos"),
        "files": files,
        "probes": probes,
        "sample": status(sample_file),
        "options": [
            options.json_key,
            options.column,
            options.prepend_bos,
            options.append_eod,
            options.sample_documents,
        ],
        "versions": [tokenmill_version(), package_version("gigatoken")],
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_verdict(path: str) -> dict[str, Any] | None:
    """A recorded verdict, or None when there is none or it is not whole (then it is decided
    again and rewritten)."""
    try:
        with open(path, encoding="utf-8") as stream:
            record = json.load(stream)
        return {
            "fingerprint": dict(record["fingerprint"]),
            "vocab_size": int(record["vocab_size"]),
            "backend": str(record["backend"]),
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adapt_tokenizer_once(
    tokenizer: Any, sample_file: str, options: RawText, cache_dir: str
) -> _Adapted:
    """:func:`adapt_tokenizer`, with a Megatron tokenizer's verdict (its file's fast backend or
    its own ``tokenize``) recorded in ``<cache_dir>/tokenizers/<key>.json`` (key:
    :func:`_verdict_key`): a relaunch reads the verdict instead of loading the fast backend
    and sampling the data again (0.4-0.5 s for GPT-2's tokenizer.json on this machine), and
    loads the tokenizer only if it has a piece to tokenize. tokenmill specs and objects are
    adapted as they are (a spec is loaded: the datasets use the loaded object)."""
    if isinstance(tokenizer, (str, os.PathLike, TokenizerSpec, Tokenizer)) or not callable(
        getattr(tokenizer, "tokenize", None)
    ):
        spec, loaded, replacement = adapt_tokenizer(tokenizer, sample_file, options)
        return _adapted(loaded, spec, replacement)
    path = _tokenizer_file(tokenizer)
    record_path = os.path.join(
        _cache_entries(cache_dir, "tokenizers"),
        _verdict_key(tokenizer, path, sample_file, options) + ".json",
    )

    def load() -> tuple[TokenizerSpec, Tokenizer]:
        spec, loaded, _ = adapt_tokenizer(tokenizer, sample_file, options)
        return spec, loaded

    record = _read_verdict(record_path)
    if record is None:
        spec, loaded = load()
        adapted = _adapted(loaded, spec, None)
        fields = {k: getattr(adapted, k) for k in ("fingerprint", "vocab_size", "backend")}
        atomic_write_text(record_path, json.dumps(fields, sort_keys=True, default=str))
        return adapted
    logger.info(
        "[raw text] %s: %s, as decided by an earlier launch (%s)",
        type(tokenizer).__qualname__,
        record["backend"],
        record_path,
    )
    return _Adapted(
        fingerprint=record["fingerprint"],
        vocab_size=record["vocab_size"],
        backend=record["backend"],
        replacement=None,
        load=load,
        record=record_path,
    )


def _cache_entries(root: str, kind: str) -> str:
    directory = os.path.join(root, kind)
    os.makedirs(directory, exist_ok=True)
    return directory


def _committed(prefix: str) -> bool:
    """Whether `prefix` is committed: its sidecar exists (`_commit_prefix` renames it into place
    after the ``.bin`` and ``.idx``, so one ``stat`` answers for the three files)."""
    return os.path.exists(sidecar_path(prefix))


def _commit_prefix(temporary: str, final: str) -> bool:
    """Move a finished prefix into the cache: ``.bin``, ``.idx``, then the sidecar that marks it
    committed (the one place that names the cache's files; see "Commit" in the module
    docstring). A prefix another rank committed meanwhile is left as it is (same key, same
    bytes): False.

    The files' data is already on disk (the pipeline's builder and sidecar writer fsync before
    naming them; so does :func:`_concatenate`); the renames are made durable by the caller,
    with one fsync of the cache directory per batch."""
    if _committed(final):
        return False
    for path in (get_bin_path, get_idx_path, sidecar_path):
        os.replace(path(temporary), path(final))
    return True


def _temporary_directory(root: str, key: str) -> str:
    """A fresh working directory for `key`, after removing those of dead processes of this
    host (a killed launch's leftovers)."""
    host = socket.gethostname()
    directory = _cache_entries(root, "tmp")
    for name in os.listdir(directory):
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[0] == key and parts[1] == host:
            with contextlib.suppress(ValueError):
                if not _pid_alive(int(parts[2])):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    path = os.path.join(directory, f"{key}.{host}.{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _share(sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Piece -> rank: largest first, to the least loaded rank (ties: lowest rank)."""
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for key, size in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = rank
        loads[rank] += max(size, 1)
    return owner


def _agree(error: BaseException | None) -> None:
    """Every rank's outcome to every rank, all ranks waiting for all (a collective: the merge's
    steps need it): the failing rank's exception is raised on all ranks at once (the others'
    with a note naming it). Through the process group's store and one barrier
    (`distributed.build_then_share`), never a collective over a tensor made in Python, which
    gloo may free while the interpreter finalizes (an abort at exit)."""

    def outcome() -> None:
        if error is not None:
            raise error

    distributed.build_then_share(outcome, role="tokenizes raw text")


def _shareable(error: BaseException | None) -> BaseException | None:
    """An interrupt travels as a RuntimeError naming it (the others must still hear of it)."""
    if error is None or isinstance(error, Exception):
        return error
    return RuntimeError(f"{type(error).__name__} while tokenizing raw text")


def _raise_shared(share: Any, error: BaseException | None, *args: Any) -> None:
    """`share(shareable error, *args)`; this rank's own error (an interrupt too) is re-raised
    as itself."""
    shared = _shareable(error)
    try:
        share(shared, *args)
    except Exception:
        if error is not None and error is not shared:
            raise error from None
        raise


def _concatenate(
    merges: list[tuple[str, list[str]]],
    pieces_dir: str,
    cache_dir: str,
    owner: dict[str, int],
    rank: int,
    world_size: int,
) -> int:
    """Write each multi-file entry's concatenation of its pieces (``merge_datasets``' bytes: the
    ``.bin`` files one after the other, their indices joined as ``add_index`` joins them) with
    every rank copying the pieces it tokenized, in parallel; merge ``i`` is set up, indexed and
    committed by rank ``i % world_size``. A collective (three exchanges of outcomes).

    Returns:
        The merges this rank committed.
    """
    plans = []
    for number, (final, piece_keys) in enumerate(merges):
        sources = [os.path.join(pieces_dir, key) for key in piece_keys]
        sizes = [os.path.getsize(get_bin_path(source)) for source in sources]
        offsets = numpy.concatenate([[0], numpy.cumsum(sizes, dtype=numpy.int64)]).tolist()
        working = os.path.join(_cache_entries(cache_dir, "tmp"), os.path.basename(final) + ".merge")
        plans.append((number % world_size, final, piece_keys, sources, sizes, offsets, working))

    error: BaseException | None = None
    try:  # 1. the writer of each merge creates its .bin at full size (after a killed try's)
        for writer, _, _, _, _, offsets, working in plans:
            if writer == rank:
                shutil.rmtree(working, ignore_errors=True)
                os.makedirs(working)
                with open(os.path.join(working, "merged.bin"), "wb") as stream:
                    stream.truncate(offsets[-1])
    except BaseException as failure:
        error = failure
    _raise_shared(_agree, error)
    try:  # 2. every rank copies the pieces it tokenized into place
        for _, _, piece_keys, sources, sizes, offsets, working in plans:
            ours = [i for i, key in enumerate(piece_keys) if owner[key] == rank]
            if not ours:
                continue
            descriptor = os.open(os.path.join(working, "merged.bin"), os.O_WRONLY)
            try:
                for i in ours:
                    with open(get_bin_path(sources[i]), "rb") as source:
                        _copy_range(source.fileno(), descriptor, sizes[i], offsets[i])
                if fsync_enabled():
                    os.fsync(descriptor)
            finally:
                os.close(descriptor)
    except BaseException as failure:
        error = failure
    _raise_shared(_agree, error)
    committed = 0
    try:  # 3. the writer joins the indices and commits
        for writer, final, _, sources, _, _, working in plans:
            if writer != rank:
                continue
            temporary = os.path.join(working, "merged")
            _write_joined_index(sources, temporary)
            committed += _commit_prefix(temporary, final)
            shutil.rmtree(working, ignore_errors=True)
        if committed and fsync_enabled():
            fsync_directory(os.path.dirname(plans[0][1]))
    except BaseException as failure:
        error = failure
    _raise_shared(_agree, error)
    return committed


def _copy_range(source: int, destination: int, size: int, offset: int) -> None:
    """Copy ``size`` bytes from the start of ``source`` to ``offset`` of ``destination`` (in the
    kernel where it can)."""
    copied = 0
    with contextlib.suppress(OSError, AttributeError):  # EXDEV, unsupported: copy by hand
        while copied < size:
            step = os.copy_file_range(source, destination, size - copied, copied, offset + copied)
            if step == 0:
                break
            copied += step
    while copied < size:
        block = os.pread(source, min(64 << 20, size - copied), copied)
        if not block:
            raise OSError(f"piece shrank while being copied (fd {source}, at byte {copied})")
        copied += os.pwrite(destination, block, offset + copied)


def _write_joined_index(sources: list[str], prefix: str) -> None:
    """``<prefix>.idx`` and sidecar for ``<prefix>.bin``, the concatenation of ``sources``: the
    index ``IndexedDatasetBuilder.add_index`` would write (lengths joined, pointers recomputed,
    document boundaries shifted), checked against the ``.bin`` by opening the result."""
    from tokenmill.formats.megatron import IndexedDataset
    from tokenmill.formats.megatron_index import write_index
    from tokenmill.tokenize.merge import write_merged_sidecar

    lengths: list[Any] = []
    boundaries: list[Any] = [numpy.zeros(1, dtype="<i8")]
    offset = 0
    dtype: Any = None
    for source in sources:
        dataset = IndexedDataset(source)
        dtype = dataset.index.dtype
        lengths.append(numpy.asarray(dataset.sequence_lengths, dtype="<i4"))
        boundaries.append(numpy.asarray(dataset.document_indices[1:], dtype="<i8") + offset)
        offset += len(dataset)
        del dataset
    joined = numpy.concatenate(lengths)
    documents = numpy.concatenate(boundaries)
    with open(get_idx_path(prefix), "wb") as stream:
        write_index(stream, dtype, joined, documents)
        stream.flush()
        if fsync_enabled():
            os.fsync(stream.fileno())
    merged = IndexedDataset(prefix)  # raises if the .idx and .bin disagree
    tokens = int(merged.sequence_lengths.sum(dtype="int64"))
    del merged
    sidecars = [read_sidecar(source) for source in sources]
    write_merged_sidecar(
        prefix,
        check_compatible(sources),
        sidecars,
        dtype,
        int(documents.shape[0]) - 1,
        int(joined.shape[0]),
        tokens,
    )


def _piece_key(
    path: str, status: os.stat_result, fingerprint: dict[str, Any], options: dict[str, Any]
) -> str:
    payload = {
        "version": CACHE_VERSION,
        "input": {
            "path": os.path.abspath(path),
            "size": status.st_size,
            "mtime_ns": status.st_mtime_ns,
            "ctime_ns": status.st_ctime_ns,
        },
        "tokenizer": fingerprint,
        "options": options,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _default_threads() -> int:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_ranks)))


def tokenize_raw_text(
    entries: Sequence[str], tokenizer: Any, cache_dir: str, options: RawText | None = None
) -> tuple[dict[str, str], RawTextStats, Any]:
    """Tokenize the raw-text entries into the cache by all ranks together (see the module
    docstring); called by every rank with the same arguments.

    Returns:
        Each entry's prefix, this rank's stats, and the tokenizer the datasets should use
        instead of the given one (None: keep it).

    Raises:
        FileNotFoundError: an entry matches no file.
        ValueError: an ``s3://`` entry, or a tokenizer that cannot encode text.
        DataFormatError: an input is malformed (names the file, line and field).
        RuntimeError: another rank failed (every rank raises).
    """
    options = options or RawText()
    # committed pieces are reused by key, which anyone can compute: nobody else may write here
    check_cache_directory(cache_dir, "raw-text cache directory")
    started = time.perf_counter()
    rank, world_size = distributed.get_rank(), distributed.get_world_size()
    stats = RawTextStats(rank=rank, world_size=world_size)
    for entry in entries:
        if entry.startswith(("s3://", "msc://")):
            raise ValueError(
                f"blend entry {entry!r}: raw text on object storage is not supported yet; "
                "tokenize it with `tokenmill tokenize` (which writes s3:// outputs)"
            )
    files = {entry: expand_inputs([entry]) for entry in entries}
    first = next(iter(files.values()))[0]
    adapted = adapt_tokenizer_once(tokenizer, first, options, cache_dir)
    replacement = adapted.replacement
    stats.backend = adapted.backend
    dtype = numpy.dtype(DType.optimal_dtype(adapted.vocab_size)).name
    read = ReadOptions(json_key=options.json_key, column=options.column)
    key_options = {
        "json_key": read.json_key,
        "column": read.column,
        "txt_mode": read.txt_mode,
        "prepend_bos": options.prepend_bos,
        "append_eod": options.append_eod,
        "dtype": dtype,
    }
    fingerprint = adapted.fingerprint
    pieces_dir = _cache_entries(cache_dir, "pieces")
    keys: dict[str, str] = {}
    sizes: dict[str, int] = {}  # one stat per input: its key and its share of the work
    for paths in files.values():
        for path in paths:
            if path not in keys:
                status = os.stat(path)
                keys[path] = _piece_key(path, status, fingerprint, key_options)
                sizes[path] = status.st_size
    stats.pieces = len(keys)
    owner = _share([(key, sizes[path]) for path, key in keys.items()], world_size)
    mine = [
        (path, key)
        for path, key in keys.items()
        if owner[key] == rank and not _committed(os.path.join(pieces_dir, key))
    ]
    stats.reused = sum(1 for key in keys.values() if owner[key] == rank) - len(mine)
    workers = 0
    if adapted.fingerprint.get("backend") == "gigatoken":
        workers = options.threads if options.threads is not None else _default_threads()
    pause_after = int(os.environ.get(_PAUSE_VARIABLE, "0") or 0)
    error: BaseException | None = None
    progress = Progress(
        "raw text",
        total=sum(sizes[path] for path, _ in mine),
        unit="B",
        unit_scale=True,
        enabled=options.progress and rank == 0 and bool(mine),
    )
    key_of = dict(mine)
    committed_any = False

    def piece_done(path: str, part: str) -> None:
        # called by the pipeline as each input's part is finished, while the next inputs are
        # still being encoded: the piece is in the cache before the next one is done
        nonlocal committed_any
        committed_any |= _commit_prefix(part, os.path.join(pieces_dir, key_of[path]))
        stats.tokenized.append(path)
        progress.update(sizes[path])
        if pause_after and len(stats.tokenized) >= pause_after:
            with open(os.environ.get(_PAUSED_VARIABLE, os.devnull), "w"):
                pass
            while True:  # the test kills this process here
                time.sleep(3600)

    try:
        if mine:
            # one pipeline run over all of this rank's pieces: one tokenizer set-up, and the
            # encoder threads stay busy across the pieces' boundaries
            working = _temporary_directory(cache_dir, f"rank-{rank}-of-{world_size}")
            result = tokenize(
                TokenizeConfig(
                    inputs=tuple(path for path, _ in mine),
                    output_prefix=os.path.join(working, "pieces"),
                    tokenizer=adapted.spec(),
                    read=read,
                    prepend_bos=options.prepend_bos,
                    append_eod=options.append_eod,
                    workers=workers,
                    progress=False,
                    memory_budget=options.memory_budget,
                    assemble=False,
                    on_part=piece_done,
                )
            )
            stats.text_bytes += result.text_bytes
            stats.tokens += result.tokens
            if committed_any and fsync_enabled():
                fsync_directory(pieces_dir)  # the batch's renames, made durable at once
            shutil.rmtree(working, ignore_errors=True)
    except BaseException as failure:  # every rank must hear of it, or the others hang
        error = failure
    progress.close(final_line=False)
    # wait only for the owners of the pieces still missing here (none on a warm relaunch: no
    # rank waits for another, no barrier); every rank publishes its outcome, so a waiter never
    # waits on a rank that had nothing to do
    awaited = {owner[key] for key in keys.values() if not _committed(os.path.join(pieces_dir, key))}
    _raise_shared(distributed.share_outcome, error, awaited)

    prefixes: dict[str, str] = {}
    merged_dir = _cache_entries(cache_dir, "merged")
    merges: list[tuple[str, list[str]]] = []
    for entry, paths in files.items():
        if len(paths) == 1:
            prefixes[entry] = os.path.join(pieces_dir, keys[paths[0]])
            continue
        merged_key = hashlib.sha256(json.dumps([keys[p] for p in paths]).encode()).hexdigest()
        prefixes[entry] = os.path.join(merged_dir, merged_key)
        if not _committed(prefixes[entry]) and prefixes[entry] not in dict(merges):
            merges.append((prefixes[entry], [keys[p] for p in paths]))
    if merges:
        stats.merged = _concatenate(merges, pieces_dir, cache_dir, owner, rank, world_size)
    missing = [prefix for prefix in prefixes.values() if not _committed(prefix)]
    if missing:
        raise RuntimeError(
            f"raw-text cache {cache_dir}: {missing[0]} is not committed after every rank "
            "finished (is cache_dir shared by all ranks?)"
        )
    stats.seconds = time.perf_counter() - started
    return prefixes, stats, replacement
