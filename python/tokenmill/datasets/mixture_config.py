"""The declarative mixture config: named sources and ordered phases (a curriculum).

A config comes from a TOML file, a YAML file (needs PyYAML) or a dict, and is checked on
construction; every bad field raises :class:`MixtureConfigError` naming the file, the field and
the value. TOML::

    seed = 1234
    chunk_tokens = 4096          # the mixture is drawn chunk by chunk (see MixturePlan)
    exhaustion = "halt"          # or "drop": an exhausted source leaves, the rest renormalise
    weighting = "tokens"         # weights are fractions of tokens; "documents": of documents

    [sources.web]                # a source: Megatron prefixes, shard files or directories
    paths = ["web/part0", "web/part1"]
    [sources.code]
    paths = ["code/"]
    epochs = 2                   # the source may be read twice (each epoch reshuffled)

    [[phases]]
    name = "main"
    tokens = 1_000_000           # the phase's token budget
    weights = { web = 0.7, code = 0.3 }
    [[phases]]
    name = "anneal"
    tokens = 200_000
    weights = { web = 0.2, code = 0.8 }

A source may also be written as a path or a list of paths (``web = "web/part0"``). Relative paths
are resolved against the config file's directory. Weights need not sum to one; a source missing
from a phase's weights has weight 0 in that phase. ``bos_token``/``eos_token``/``dtype`` of a
source are passed to :class:`~tokenmill.formats.documents.DocumentCorpus` for formats without
their own document index (nanogpt, raw ``.bin``, ``.npy``).
"""

from __future__ import annotations

import math
import operator
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.errors import TokenmillError

__all__ = [
    "EXHAUSTION_POLICIES",
    "WEIGHTINGS",
    "MixtureConfig",
    "MixtureConfigError",
    "MixturePhase",
    "MixtureSource",
]

EXHAUSTION_POLICIES = ("halt", "drop")
WEIGHTINGS = ("tokens", "documents")


class MixtureConfigError(TokenmillError, ValueError):
    """A mixture config field is missing or invalid (the message names the field and value)."""


def _where(origin: str | None, field_name: str) -> str:
    return f"{origin}: {field_name}" if origin else field_name


MAX_COUNT = 1 << 53
"""The largest token count, epoch count or token id a config may give (9e15; seeds go to 2^64): anything
larger is a typo or corruption, and would make planning or validation run without end."""


def _integer(
    value: Any, field_name: str, origin: str | None, minimum: int, maximum: int | None = MAX_COUNT
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool) or type(value).__name__ == "bool_":  # `true` is no count
                raise TypeError
            value = operator.index(value)
        except TypeError:
            from tokenmill.common.config_text import shown

            raise MixtureConfigError(
                f"{_where(origin, field_name)} must be an integer, got {shown(value)}"
            ) from None
    if value < minimum:
        raise MixtureConfigError(f"{_where(origin, field_name)} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise MixtureConfigError(
            f"{_where(origin, field_name)} must be <= 2**53 ({maximum}), got {value}"
        )
    return int(value)


def shown_weights(weights: list[tuple[str, float]]) -> str:
    """The first weights, for a message of bounded length."""
    text = ", ".join(f"{name}={value!r}" for name, value in weights[:8])
    return text + (f", ... ({len(weights)} in all)" if len(weights) > 8 else "")


def _optional_token(value: Any, field_name: str, origin: str | None) -> int | None:
    return None if value is None else _integer(value, field_name, origin, 0)


@dataclass(frozen=True)
class MixtureSource:
    """One named source of a mixture.

    Args:
        name: the name phases refer to.
        paths: Megatron prefixes, nanogpt/raw/``.npy`` files or directories of them, read in
            this order; the source's documents are all of theirs.
        bos_token, eos_token, dtype: document boundaries and raw dtype, as DocumentCorpus.
        epochs: how many times the source may be read (each epoch in its own shuffled order).
    """

    name: str
    paths: tuple[str, ...]
    bos_token: int | None = None
    eos_token: int | None = None
    dtype: str | None = None
    epochs: int = 1
    origin: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f"sources.{self.name}"
        if not isinstance(self.name, str) or not self.name:
            raise MixtureConfigError(
                f"{_where(self.origin, 'sources')}: a source name must be a non-empty string, "
                f"got {self.name!r}"
            )
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else self.paths
        if not isinstance(paths, Sequence) or not paths:
            raise MixtureConfigError(
                f"{_where(self.origin, where + '.paths')} must be a non-empty list of paths, "
                f"got {self.paths!r}"
            )
        for path in paths:
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise MixtureConfigError(
                    f"{_where(self.origin, where + '.paths')}: not a path: {path!r}"
                )
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        object.__setattr__(
            self, "bos_token", _optional_token(self.bos_token, where + ".bos_token", self.origin)
        )
        object.__setattr__(
            self, "eos_token", _optional_token(self.eos_token, where + ".eos_token", self.origin)
        )
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise MixtureConfigError(
                f"{_where(self.origin, where + '.dtype')} must be a dtype name, got {self.dtype!r}"
            )
        object.__setattr__(self, "epochs", _integer(self.epochs, where + ".epochs", self.origin, 1))


@dataclass(frozen=True)
class MixturePhase:
    """One phase of the curriculum: a token budget and the weights of the sources in it.

    Args:
        name: a label for messages and plots.
        tokens: the phase's token budget (the phases run one after the other).
        weights: source name -> weight >= 0 (fractions of tokens, or of documents under
            ``weighting = "documents"``); normalised, so they need not sum to one.
    """

    name: str
    tokens: int
    weights: tuple[tuple[str, float], ...]
    origin: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f"phases.{self.name}"
        if not isinstance(self.name, str) or not self.name:
            raise MixtureConfigError(
                f"{_where(self.origin, 'phases')}: a phase name must be a non-empty string, "
                f"got {self.name!r}"
            )
        object.__setattr__(self, "tokens", _integer(self.tokens, where + ".tokens", self.origin, 1))
        items = self.weights.items() if isinstance(self.weights, Mapping) else self.weights
        weights: list[tuple[str, float]] = []
        for item in items:
            name, value = item
            key = f"{where}.weights.{name}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MixtureConfigError(
                    f"{_where(self.origin, key)} must be a number, got {value!r}"
                )
            if not math.isfinite(value) or value < 0:
                raise MixtureConfigError(
                    f"{_where(self.origin, key)} must be finite and >= 0, got {value!r}"
                )
            weights.append((str(name), float(value)))
        if len({name for name, _ in weights}) != len(weights):
            raise MixtureConfigError(
                f"{_where(self.origin, where + '.weights')} names a source twice: {weights!r}"
            )
        if not math.isfinite(sum(value for _, value in weights)):
            # normalising would divide by inf and give every source weight 0
            raise MixtureConfigError(
                f"{_where(self.origin, where + '.weights')} sum to more than a float64 holds "
                f"({shown_weights(weights)}); use relative weights of ordinary size"
            )
        if not any(value > 0 for _, value in weights):
            raise MixtureConfigError(
                f"{_where(self.origin, where + '.weights')} needs a weight > 0, got {weights!r}"
            )
        object.__setattr__(self, "weights", tuple(weights))

    def weight(self, source: str) -> float:
        """The weight of ``source`` in this phase (0 when the phase does not name it)."""
        return dict(self.weights).get(source, 0.0)


@dataclass(frozen=True)
class MixtureConfig:
    """A mixture: sources, ordered phases and how the stream is drawn.

    Args:
        sources: the named sources.
        phases: the curriculum, in order; the total budget is the sum of the phase budgets.
        seed: seeds the chunk draws and every source's document shuffle.
        chunk_tokens: the token stream is cut into chunks of this many tokens and each chunk is
            drawn from one source (a phase's first and last chunk may be shorter).
        exhaustion: ``"halt"`` (default): a source asked for more tokens than it holds stops the
            stream with SourceExhaustedError; ``"drop"``: it leaves the mixture and the weights of
            the others are renormalised.
        weighting: ``"tokens"`` (default): a weight is the expected fraction of the phase's tokens
            drawn from the source; ``"documents"``: the expected fraction of documents (converted
            to token weights with each source's mean document length).

    Raises:
        MixtureConfigError: a field is invalid (named with its value).
    """

    sources: tuple[MixtureSource, ...]
    phases: tuple[MixturePhase, ...]
    seed: int = 1234
    chunk_tokens: int = 4096
    exhaustion: str = "halt"
    weighting: str = "tokens"
    origin: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.sources:
            raise MixtureConfigError(f"{_where(self.origin, 'sources')}: no sources")
        if not self.phases:
            raise MixtureConfigError(f"{_where(self.origin, 'phases')}: no phases")
        names = [source.name for source in self.sources]
        for name in names:
            if names.count(name) > 1:
                raise MixtureConfigError(
                    f"{_where(self.origin, 'sources')}: source {name!r} is defined twice"
                )
        for phase in self.phases:
            for name, _ in phase.weights:
                if name not in names:
                    raise MixtureConfigError(
                        f"{_where(self.origin, f'phases.{phase.name}.weights.{name}')}: "
                        f"no source named {name!r} (sources: {', '.join(names)})"
                    )
        object.__setattr__(self, "seed", _integer(self.seed, "seed", self.origin, 0, None))
        if self.seed >= 2**64:
            raise MixtureConfigError(
                f"{_where(self.origin, 'seed')} must be < 2^64, got {self.seed}"
            )
        object.__setattr__(
            self, "chunk_tokens", _integer(self.chunk_tokens, "chunk_tokens", self.origin, 1)
        )
        if self.exhaustion not in EXHAUSTION_POLICIES:
            raise MixtureConfigError(
                f"{_where(self.origin, 'exhaustion')} must be one of {EXHAUSTION_POLICIES}, "
                f"got {self.exhaustion!r}"
            )
        if self.weighting not in WEIGHTINGS:
            raise MixtureConfigError(
                f"{_where(self.origin, 'weighting')} must be one of {WEIGHTINGS}, "
                f"got {self.weighting!r}"
            )

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)

    @property
    def total_tokens(self) -> int:
        """The token budget of the whole curriculum."""
        return sum(phase.tokens for phase in self.phases)

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        origin: str | None = None,
    ) -> MixtureConfig:
        """A config from a parsed TOML/YAML document (or an equivalent dict).

        Args:
            data: the document.
            base_dir: relative source paths are resolved against it (default: as given).
            origin: the file name used in error messages.
        """
        if not isinstance(data, Mapping):
            raise MixtureConfigError(
                f"{origin or 'mixture config'}: must be a table/mapping, got {type(data).__name__}"
            )
        known = {"seed", "chunk_tokens", "exhaustion", "weighting", "sources", "phases"}
        for key in data:
            if key not in known:
                raise MixtureConfigError(
                    f"{_where(origin, str(key))}: unknown field (known: {', '.join(sorted(known))})"
                )
        raw_sources = data.get("sources")
        if not isinstance(raw_sources, Mapping):
            raise MixtureConfigError(
                f"{_where(origin, 'sources')} must be a table of named sources, got {raw_sources!r}"
            )
        sources = [
            _source_from(name, value, base_dir, origin) for name, value in raw_sources.items()
        ]
        raw_phases = data.get("phases")
        if not isinstance(raw_phases, Sequence) or isinstance(raw_phases, (str, bytes)):
            raise MixtureConfigError(
                f"{_where(origin, 'phases')} must be a list of phases, got {raw_phases!r}"
            )
        phases = [_phase_from(number, value, origin) for number, value in enumerate(raw_phases)]
        options = {
            key: data[key]
            for key in ("seed", "chunk_tokens", "exhaustion", "weighting")
            if key in data
        }
        return cls(tuple(sources), tuple(phases), origin=origin, **options)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MixtureConfig:
        """Read a ``.toml``, ``.yaml`` or ``.yml`` config (relative paths: from its directory).

        Raises:
            FileNotFoundError: no such file.
            MixtureConfigError: unknown extension, unparsable file or invalid field.
        """
        name = os.fspath(path)
        suffix = Path(name).suffix.lower()
        try:
            text = Path(name).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise MixtureConfigError(
                f"{name}: not UTF-8 text (byte {error.start}: {error.reason})"
            ) from None
        data: Any
        if suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                raise MixtureConfigError(f"{name}: not valid TOML: {error}") from None
            except RecursionError:
                raise MixtureConfigError(f"{name}: the config is nested too deeply") from None
            _check_size(data, name)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise MixtureConfigError(
                    f"{name}: YAML configs need PyYAML (pip install 'tokenmill[yaml]')"
                ) from None
            del yaml
            data = _parse_yaml(text, name)
        else:
            raise MixtureConfigError(
                f"{name}: a mixture config must end in .toml, .yaml or .yml, got {suffix!r}"
            )
        return cls.from_dict(data, base_dir=Path(name).resolve().parent, origin=name)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (``from_dict(to_dict())`` gives an equal config)."""
        return {
            "seed": self.seed,
            "chunk_tokens": self.chunk_tokens,
            "exhaustion": self.exhaustion,
            "weighting": self.weighting,
            "sources": {
                source.name: {
                    "paths": list(source.paths),
                    "bos_token": source.bos_token,
                    "eos_token": source.eos_token,
                    "dtype": source.dtype,
                    "epochs": source.epochs,
                }
                for source in self.sources
            },
            "phases": [
                {"name": phase.name, "tokens": phase.tokens, "weights": dict(phase.weights)}
                for phase in self.phases
            ],
        }


def _check_size(data: Any, name: str) -> None:
    from tokenmill.common.config_text import ConfigTextError, check_size

    try:
        check_size(data, name)
    except ConfigTextError as error:
        raise MixtureConfigError(str(error)) from None


def _parse_yaml(text: str, name: str) -> Any:
    """Bounded safe YAML (`tokenmill.common.config_text`: aliases, depth, expanded size)."""
    from tokenmill.common.config_text import parse_config_text

    try:
        return parse_config_text(text, name, "yaml")
    except ValueError as error:
        raise MixtureConfigError(str(error)) from None


def _source_from(
    name: Any, value: Any, base_dir: str | os.PathLike[str] | None, origin: str | None
) -> MixtureSource:
    if isinstance(value, (str, os.PathLike)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    ):
        value = {"paths": value}
    if not isinstance(value, Mapping):
        raise MixtureConfigError(
            f"{_where(origin, f'sources.{name}')} must be a path, a list of paths or a table, "
            f"got {value!r}"
        )
    known = {"paths", "path", "bos_token", "eos_token", "dtype", "epochs"}
    for key in value:
        if key not in known:
            raise MixtureConfigError(
                f"{_where(origin, f'sources.{name}.{key}')}: unknown field "
                f"(known: {', '.join(sorted(known))})"
            )
    if "paths" in value and "path" in value:
        raise MixtureConfigError(
            f"{_where(origin, f'sources.{name}')}: give 'paths' or 'path', not both"
        )
    paths = value.get("paths", value.get("path"))
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if base_dir is not None and isinstance(paths, Sequence):
        paths = [
            os.path.join(base_dir, p) if isinstance(p, str) and not os.path.isabs(p) else p
            for p in paths
        ]
    options = {
        key: value[key] for key in ("bos_token", "eos_token", "dtype", "epochs") if key in value
    }
    return MixtureSource(name, paths, origin=origin, **options)


def _phase_from(number: int, value: Any, origin: str | None) -> MixturePhase:
    if not isinstance(value, Mapping):
        raise MixtureConfigError(
            f"{_where(origin, f'phases[{number}]')} must be a table, got {value!r}"
        )
    known = {"name", "tokens", "weights"}
    for key in value:
        if key not in known:
            raise MixtureConfigError(
                f"{_where(origin, f'phases[{number}].{key}')}: unknown field "
                f"(known: {', '.join(sorted(known))})"
            )
    for key in ("tokens", "weights"):
        if key not in value:
            raise MixtureConfigError(f"{_where(origin, f'phases[{number}].{key}')} is missing")
    weights = value["weights"]
    if not isinstance(weights, Mapping):
        raise MixtureConfigError(
            f"{_where(origin, f'phases[{number}].weights')} must be a table source -> weight, "
            f"got {weights!r}"
        )
    return MixturePhase(
        str(value.get("name", f"phase{number}")),
        value["tokens"],
        tuple(weights.items()),
        origin=origin,
    )
