"""Mixtures and curricula over any token sources, with a ledger that makes resume exact.

A :class:`Mixture` opens the sources of a :class:`~tokenmill.datasets.mixture_config.MixtureConfig`
and defines one global token stream (see :mod:`tokenmill.index.mixture_plan` for which source
feeds which chunk). Within a source the tokens follow its documents in a shuffled order: epoch
``e`` of source ``name`` is ``numpy.random.RandomState(seed_e).permutation(documents)`` with
``seed_e = crc32(f"{seed}/{name}/{e}")``, the documents laid end to end. So a source's stream is a
pure function of (seed, name, its files), and "tokens consumed" (the ledger) is a position in it.

Weights are **fractions of tokens**: a chunk is drawn from a source with probability equal to its
normalised weight, so in expectation a phase of T tokens takes ``w * T`` tokens from it. With
``weighting = "documents"`` a weight is a fraction of documents instead; it is converted to a
token weight ``w * mean document length`` of the source.

State. ``state_dict()`` of the loaders holds ``{position, segment_start, ledger}`` plus the
mixture's fingerprint and each source's (documents, tokens). :meth:`Mixture.cursor` resumes from
one: the same mixture continues the same stream exactly; changed weights or phases start a new
segment at the position, every source continuing from its ledger; changed source data is an error.

Cost: opening reads each source's document lengths (the Megatron index, or a BOS/EOS scan).
An epoch's order takes 12 bytes per document (int32 permutation, int64 cumulative ends) in every
process that reads the source, built when first read (about 10-20 ns per document; the last two
epochs are kept). Reading n tokens costs one binary search plus one copy per document touched.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.config_text import shown
from tokenmill.datasets.mixture_config import MixtureConfig, MixtureSource
from tokenmill.formats.documents import DocumentCorpus
from tokenmill.index.cache_checks import check_mixture_state
from tokenmill.index.mixture_plan import MixtureCursor, MixturePlan, Piece

__all__ = ["Mixture", "MixtureReport", "SourceData"]

STATE_FORMAT = "tokenmill.Mixture"
STATE_VERSION = 1


def _expand(path: str) -> list[str]:
    """A source path as the paths DocumentCorpus opens: a directory of Megatron shards becomes
    its prefixes (sorted); anything else is opened as given."""
    if os.path.isdir(path):
        prefixes = sorted(
            str(idx.with_suffix(""))
            for idx in Path(path).glob("*.idx")
            if idx.with_suffix(".bin").is_file()
        )
        if prefixes:
            return prefixes
    return [path]


class SourceData:
    """One source's documents and its shuffled token stream (epoch after epoch).

    Raises:
        FileNotFoundError, DataFormatError, ValueError: a path cannot be opened (named).
    """

    def __init__(self, spec: MixtureSource, seed: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.seed = seed
        self.corpora = [
            DocumentCorpus(
                path, bos_token=spec.bos_token, eos_token=spec.eos_token, dtype=spec.dtype
            )
            for raw in spec.paths
            for path in _expand(raw)
        ]
        lengths = [c.sequence_lengths.astype(np.int64) for c in self.corpora]
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.first_document = [0]
        for corpus in self.corpora:
            self.first_document.append(self.first_document[-1] + len(corpus))
        self.documents = int(self.lengths.shape[0])
        self.tokens = int(self.lengths.sum())
        self.dtypes = {str(c.source.dtype) for c in self.corpora}
        self._epochs: dict[int, tuple[npt.NDArray[np.integer], npt.NDArray[np.int64]]] = {}

    @property
    def inventory(self) -> int:
        """Tokens the source may give: its tokens times its epochs."""
        return self.tokens * self.spec.epochs

    def epoch_seed(self, epoch: int) -> int:
        return zlib.crc32(f"{self.seed}/{self.name}/{epoch}".encode())

    def epoch_order(self, epoch: int) -> tuple[npt.NDArray[np.integer], npt.NDArray[np.int64]]:
        """(document order, cumulative token ends in that order) of one epoch."""
        if epoch not in self._epochs:
            from tokenmill import _core
            from tokenmill.common.core_call import core_call

            # int32 when it fits: the permutation is the same (it depends only on the count)
            wide = self.documents > np.iinfo(np.int32).max
            order: npt.NDArray[np.integer] = np.arange(
                self.documents, dtype=np.int64 if wide else np.int32
            )
            core_call(_core.shuffle_like_numpy, order, self.epoch_seed(epoch))
            ends = np.cumsum(self.lengths[order])
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, ends)
        return self._epochs[epoch]

    def document_tokens(self, document: int, offset: int, length: int) -> npt.NDArray[Any]:
        corpus = bisect.bisect_right(self.first_document, document) - 1
        local = document - self.first_document[corpus]
        return self.corpora[corpus].get(local, offset, length)

    def read(self, offset: int, out: npt.NDArray[Any]) -> None:
        """Fill ``out`` with tokens ``[offset, offset + len(out))`` of the source's stream.

        Raises:
            IndexError: the range passes the source's last epoch.
        """
        length, filled = int(out.shape[0]), 0
        if offset < 0 or offset + length > self.inventory:
            raise IndexError(
                f"source {self.name!r}: tokens [{offset}, {offset + length}) are outside its "
                f"{self.inventory} tokens ({self.spec.epochs} epoch(s) of {self.tokens})"
            )
        while filled < length:
            epoch, within = divmod(offset + filled, self.tokens)
            order, ends = self.epoch_order(epoch)
            rank = int(np.searchsorted(ends, within, side="right"))
            while filled < length and rank < self.documents:
                end = int(ends[rank])
                size = int(self.lengths[order[rank]])
                start_in_doc = within - (end - size)
                take = min(length - filled, end - within)
                if take > 0:
                    out[filled : filled + take] = self.document_tokens(
                        int(order[rank]), start_in_doc, take
                    )
                filled += take
                within += take
                rank += 1

    def read_array(self, offset: int, length: int) -> npt.NDArray[np.int64]:
        """Tokens ``[offset, offset + length)`` of the source's stream as int64."""
        out = np.empty(length, dtype=np.int64)
        self.read(offset, out)
        return out


@dataclass(frozen=True)
class MixtureReport:
    """Demand against inventory (see :meth:`Mixture.report`).

    ``demand[phase][source]`` is the exact token demand of the rest of the stream; ``consumed``
    the ledger it starts from; ``shortfall[source]`` the tokens missing (0: enough).
    """

    sources: tuple[str, ...]
    phases: tuple[str, ...]
    phase_tokens: tuple[int, ...]
    demand: tuple[tuple[int, ...], ...]
    consumed: tuple[int, ...]
    inventory: tuple[int, ...]
    exhaustion: str

    @property
    def planned(self) -> tuple[int, ...]:
        """Tokens each source gives by the end: consumed plus demand."""
        return tuple(
            self.consumed[s] + sum(row[s] for row in self.demand) for s in range(len(self.sources))
        )

    @property
    def shortfall(self) -> tuple[int, ...]:
        return tuple(max(0, p - i) for p, i in zip(self.planned, self.inventory))

    @property
    def ok(self) -> bool:
        """No shortfall, or the drop policy (which turns one into renormalised weights)."""
        return self.exhaustion == "drop" or not any(self.shortfall)


class Mixture:
    """The sources of a mixture config and its global token stream.

    Args:
        config: a MixtureConfig, a dict in the config layout, or the path of a TOML/YAML file.

    Raises:
        MixtureConfigError: the config is invalid.
        FileNotFoundError, DataFormatError, ValueError: a source cannot be opened.
    """

    def __init__(self, config: MixtureConfig | Mapping[str, Any] | str | os.PathLike[str]) -> None:
        if isinstance(config, (str, os.PathLike)):
            config = MixtureConfig.from_file(config)
        elif not isinstance(config, MixtureConfig):
            config = MixtureConfig.from_dict(config)
        self.config = config
        self._fingerprint: str | None = None
        self.sources = [SourceData(spec, config.seed) for spec in config.sources]
        self._check_tokenizers()
        weights = []
        for phase in config.phases:
            row = [phase.weight(s.name) for s in self.sources]
            if config.weighting == "documents":
                row = [
                    w * (s.tokens / s.documents if s.documents else 0.0)
                    for w, s in zip(row, self.sources)
                ]
                if not any(w > 0 for w in row):
                    raise ValueError(
                        f"phase {phase.name!r}: every source weighted by documents is empty"
                    )
            weights.append(row)
        self.plan = MixturePlan(
            config.source_names,
            [s.inventory for s in self.sources],
            [p.name for p in config.phases],
            [p.tokens for p in config.phases],
            weights,
            config.seed,
            config.chunk_tokens,
            config.exhaustion,
        )

    def _check_tokenizers(self) -> None:
        """Refuse to mix shards written by different tokenizers (tokenmill's sidecars).

        Sources written by `tokenmill tokenize` carry ``<prefix>.tokenmill.json``; those that have
        one must agree. Shards without a sidecar are not checked (as the builder does).

        Raises:
            TokenizerMismatchError: two sources' shards come from different tokenizers.
        """
        from tokenmill.formats.dataset_sidecar import check_compatible, sidecar_path

        prefixes = [
            corpus.path_prefix
            for source in self.sources
            for corpus in source.corpora
            if os.path.exists(sidecar_path(corpus.path_prefix))
        ]
        if len(prefixes) >= 2:
            check_compatible(prefixes)

    def __reduce__(self) -> tuple[Any, ...]:
        # DataLoader workers started by spawn/forkserver reopen the files instead of copying
        # every mapped shard through a pipe.
        return (Mixture, (self.config,))

    @property
    def total_tokens(self) -> int:
        return self.plan.total_tokens

    def fingerprint(self) -> str:
        """Hash of what decides the draws: seed, chunk size, sources' names, phases and weights.

        The exhaustion policy is not part of it: switching halt -> drop at a resume changes
        nothing until a source runs dry, so it continues the same segment.
        """
        if self._fingerprint is not None:
            return self._fingerprint[:16]
        data = {
            "seed": self.config.seed,
            "chunk_tokens": self.config.chunk_tokens,
            "sources": list(self.config.source_names),
            "phases": [
                [p.tokens, list(w)] for p, w in zip(self.config.phases, self.plan.phase_weights)
            ],
        }
        self._fingerprint = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        return self._fingerprint[:16]

    def source_summary(self) -> dict[str, dict[str, int]]:
        """Per source: documents, tokens and epochs (resume checks the first two)."""
        return {
            s.name: {"documents": s.documents, "tokens": s.tokens, "epochs": s.spec.epochs}
            for s in self.sources
        }

    # ---- state ---------------------------------------------------------------------------

    def state_of(self, cursor: MixtureCursor) -> dict[str, Any]:
        """The JSON-able state of a cursor."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "sources": self.source_summary(),
            **cursor.state(),
        }

    def cursor(self, state: Mapping[str, Any] | None = None) -> MixtureCursor:
        """A cursor at the start of the stream, or at a saved state.

        A state saved with the same mixture continues its segment (the stream is the one an
        uninterrupted run sees). A state saved with other weights or phases starts a new segment
        at its position; every source continues from its ledger. Sources missing from the state
        start at 0; a state naming a source the mixture does not have is refused (remove it from
        the state's ledger to drop it on purpose).

        Raises:
            ValueError: the state is not a mixture state, a source's data changed (documents or
                tokens differ), or its position is beyond this mixture's budget.
        """
        if state is None:
            return MixtureCursor(self.plan)
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a mixture state (format must be {STATE_FORMAT!r}): {shown(state)}"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"mixture state version must be {STATE_VERSION}, got {state.get('version')!r}"
            )
        # typed and bounded before anything moves (tokenmill.index.cache_checks): "12" or 1.5
        # is an error naming the field, not a coerced position
        bound = (0, 1 << 62)
        check_mixture_state(state, {"position": bound, "segment_start": bound})
        position = int(state["position"])
        segment_start = int(state["segment_start"])
        ledger, sources = state.get("ledger"), state.get("sources")
        if not isinstance(ledger, Mapping) or not isinstance(sources, Mapping):
            raise ValueError(
                "mixture state: missing or bad field: 'ledger' and 'sources' must be mappings, got "
                f"{type(ledger).__name__} and {type(sources).__name__}"
            )
        # typed here; the sign is checked below with the source's name
        check_mixture_state(ledger, {str(name): (-(1 << 62), 1 << 62) for name in ledger})
        saved_ledger = {str(k): int(v) for k, v in ledger.items()}
        saved_sources = dict(sources)
        for name, saved in saved_sources.items():
            if not isinstance(saved, Mapping):
                raise ValueError(
                    f"mixture state: missing or bad field: sources[{shown(name)}] must be a "
                    f"mapping, got {shown(saved)}"
                )
            check_mixture_state(saved, {"documents": bound, "tokens": bound})
        summary = self.source_summary()
        for name in saved_ledger:
            if name not in summary:
                raise ValueError(
                    f"mixture state: source {name!r} has consumed {saved_ledger[name]} tokens but "
                    f"is not in this mixture (sources: {', '.join(summary)}); remove it from "
                    "the state's ledger to drop it on purpose"
                )
        for name, now in summary.items():
            saved = saved_sources.get(name)
            if saved is None:
                continue
            for key in ("documents", "tokens"):
                if int(saved[key]) != now[key]:
                    raise ValueError(
                        f"mixture state: source {name!r} changed since the state was saved: "
                        f"{key} was {saved[key]}, is {now[key]} (its shuffled order and ledger "
                        "no longer match)"
                    )
        if position < 0 or position > self.total_tokens:
            raise ValueError(
                f"mixture state: position {position} is beyond this mixture's budget of "
                f"{self.total_tokens} tokens"
            )
        if state.get("fingerprint") != self.fingerprint():
            segment_start = position  # other weights or phases: a new segment starts here
        elif not 0 <= segment_start <= position:
            raise ValueError(
                f"mixture state: segment_start {segment_start} must be in [0, {position}]"
            )
        ledger = [saved_ledger.get(name, 0) for name in self.config.source_names]
        for name, used, source in zip(self.config.source_names, ledger, self.sources):
            if not 0 <= used <= source.inventory:
                raise ValueError(
                    f"mixture state: ledger of source {name!r} is {used}, outside [0, "
                    f"{source.inventory}]"
                )
        return MixtureCursor(self.plan, position, segment_start, ledger)

    # ---- reading ---------------------------------------------------------------------------

    def read(
        self,
        pieces: Sequence[Piece],
        tokens: npt.NDArray[Any],
        source_ids: npt.NDArray[Any] | None = None,
    ) -> None:
        """Fill ``tokens`` (and ``source_ids``) with the pieces laid end to end."""
        at = 0
        for piece in pieces:
            self.sources[piece.source].read(piece.offset, tokens[at : at + piece.length])
            if source_ids is not None:
                source_ids[at : at + piece.length] = piece.source
            at += piece.length

    def report(self, state: Mapping[str, Any] | None = None) -> MixtureReport:
        """Demand of the rest of the stream (from ``state``, or the start) against inventory."""
        cursor = self.cursor(state)
        demand = self.plan.demand(cursor)
        return MixtureReport(
            sources=self.config.source_names,
            phases=self.plan.phase_names,
            phase_tokens=tuple(p.tokens for p in self.config.phases),
            demand=tuple(tuple(int(v) for v in row) for row in demand),
            consumed=tuple(cursor.ledger),
            inventory=tuple(s.inventory for s in self.sources),
            exhaustion=self.config.exhaustion,
        )
