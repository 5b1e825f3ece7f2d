"""Dataset configs from YAML, TOML or JSON files, with megatron-core's field names.

A run's data is described by one mapping whose keys are `GPTDatasetConfig` fields (megatron's
names, plus tokenmill's own fields), three extra keys, and nothing else::

    random_seed: 1234
    sequence_length: 2048
    blend: [[data/web_text_document, data/code_text_document], [0.7, 0.3]]
    split: "969,30,1"
    path_to_cache: /shared/index-cache
    reset_position_ids: false
    reset_attention_mask: false
    eod_mask_loss: false
    create_attention_mask: false
    tokenizer: {vocab_size: 50257, eod: 50256,
                unique_identifiers: {class: _GPT2BPETokenizer, tokenizer_path: [gpt2]}}
    sizes: [1000000, 10000, 1000]      # optional: samples per split (the CLI's --sizes wins)
    packing: {sequence_length: 2048}   # optional: also plan PackedDataset rows per prefix

* `blend` / `blend_per_split` entries are `[prefixes, weights or null]` pairs or megatron's
  command-line lists (`["30", "data/web", "70", "data/code"]`, see `get_blend_from_list`).
  Prefixes are kept exactly as written: they are part of megatron's cache key, so they must be
  the strings the trainer passes (relative prefixes resolve against the working directory).
* `tokenizer` is either what megatron's datasets read from a tokenizer (`vocab_size`, `eod`,
  `unique_identifiers`, optionally `pad` and `eos`): the trainer's tokenizer's
  `unique_identifiers` enter the cache key, so copy them exactly; or one of tokenmill's
  tokenizers (`kind: bytes`, or `kind: huggingface|tiktoken` with a `path` relative to the
  config file), whose identifiers tokenmill computes.
* Blend entries may name raw text (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet``
  files, directories or globs): they are tokenized at build time by all ranks into
  ``<path_to_cache>/raw_text`` (see `tokenmill.raw_text`). `raw_text` (optional) is a mapping of
  `tokenmill.RawText` options (``{json_key: content, prepend_bos: true}``); without it such
  entries get the defaults, those of ``tokenmill tokenize``.
* Any other key is an error naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.datasets.config import GPTDatasetConfig
from tokenmill.datasets.utils import Blend, get_blend_from_list

__all__ = ["ConfigTokenizer", "RunConfig", "load_run_config", "parse_sizes", "read_config_file"]

_EXTRA_KEYS = ("sizes", "packing")
_TOKENIZER_ATTRIBUTES = ("vocab_size", "eod", "unique_identifiers", "pad", "eos")


class ConfigTokenizer:
    """A tokenizer stand-in carrying only what megatron's datasets read from one.

    Args:
        vocab_size: the vocabulary size (chooses the token dtype).
        eod: the end-of-document id.
        unique_identifiers: the trainer tokenizer's identifiers (part of the cache key).
        pad: the pad id, if the tokenizer has one.
        eos: the end-of-sequence id, if the tokenizer has one.
    """

    def __init__(
        self,
        vocab_size: int,
        eod: int,
        unique_identifiers: Mapping[str, Any],
        pad: int | None = None,
        eos: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        self.unique_identifiers = dict(unique_identifiers)
        if pad is not None:
            self.pad = pad
        if eos is not None:
            self.eos = eos

    def __repr__(self) -> str:
        return f"ConfigTokenizer({self.unique_identifiers!r})"


@dataclass(frozen=True)
class RunConfig:
    """A dataset config read from a file.

    Attributes:
        path: the config file.
        config: the GPTDatasetConfig it describes.
        sizes: samples per split from the file, or None when the file gives none.
        packing: the PackingConfig to plan for every prefix, or None.
        identity: a JSON-able description of everything that shapes the caches (the file's
            fields with the tokenizer replaced by its unique_identifiers).
    """

    path: str
    config: GPTDatasetConfig
    sizes: tuple[int | None, ...] | None
    packing: Any
    identity: dict[str, Any]

    def prefixes(self) -> list[str]:
        """Every dataset prefix of the blends, in first-seen order."""
        blends: list[Blend | None] = (
            [self.config.blend] if self.config.blend else list(self.config.blend_per_split or [])
        )
        prefixes: list[str] = []
        for blend in blends:
            if blend is not None:
                prefixes.extend(p for p in blend[0] if p not in prefixes)
        return prefixes


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a `.yaml`/`.yml`, `.toml` or `.json` file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown extension, unparsable text, or a top level that is not a mapping.
    """
    name = os.fspath(path)
    suffix = Path(name).suffix.lower()
    with open(name, "rb") as stream:
        raw = stream.read()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ValueError(
            f"{name}: unknown config extension {suffix!r} (use .yaml, .yml, .toml or .json)"
        )
    yaml: Any = None
    if suffix in (".yaml", ".yml"):
        try:
            yaml = importlib.import_module("yaml")
        except ImportError as error:
            raise ValueError(
                f"{name}: reading YAML needs PyYAML (pip install 'tokenmill[cache]'), or use "
                "a .toml or .json config"
            ) from error
    from tokenmill.common.config_text import ConfigTextError, parse_config_text

    kind = "yaml" if yaml is not None else "toml" if suffix == ".toml" else "json"
    try:
        # bounded: alias count, depth and expanded size (tokenmill.common.config_text)
        data = parse_config_text(raw.decode("utf-8"), name, kind)
    except ConfigTextError:
        raise
    except Exception as error:  # JSON, TOML, YAML and UTF-8 errors alike
        raise ValueError(f"{name}: cannot parse config: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{name}: the config must be a mapping, got {type(data).__name__}")
    return data


def parse_sizes(values: Sequence[Any], where: str) -> tuple[int | None, ...]:
    """Three sample counts (train, valid, test); each an int >= 0 or None/"none"/"null"/"-".

    Raises:
        ValueError: not three values, or a value that is neither.
    """
    if isinstance(values, (str, bytes)) or len(values) != 3:
        raise ValueError(f"{where}: sizes must be 3 values (train valid test), got {values!r}")
    sizes: list[int | None] = []
    for value in values:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "-")):
            sizes.append(None)
            continue
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: size {value!r} is not an integer or None") from None
        if (isinstance(value, float) and value != number) or number < 0:
            raise ValueError(f"{where}: size {value!r} must be a whole number >= 0")
        sizes.append(number)
    return tuple(sizes)


def _parse_blend(value: Any, where: str) -> Blend | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple)):
        prefixes, weights = value
        if not all(isinstance(p, str) for p in prefixes):
            raise ValueError(f"{where}: prefixes must be strings, got {prefixes!r}")
        if weights is not None:
            if not isinstance(weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights
            ):
                raise ValueError(f"{where}: weights must be a list of numbers, got {weights!r}")
            weights = [float(w) for w in weights]
        return list(prefixes), weights
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        try:
            return get_blend_from_list([str(v) for v in value])
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    raise ValueError(
        f"{where}: expected [prefixes, weights or null] or a megatron blend list, got {value!r}"
    )


def _tokenizer(value: Any, where: str, base: Path) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a mapping, got {value!r}")
    if "kind" in value:
        from tokenmill.tokenize.tokenizers import TokenizerSpec, load_tokenizer

        allowed = {"kind", "path", "bos_token", "eod_token"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(allowed)})")
        path = value.get("path")
        if path is not None and not os.path.isabs(path):
            path = os.fspath(base / path)
        return load_tokenizer(
            TokenizerSpec(value["kind"], path, value.get("bos_token"), value.get("eod_token"))
        )
    unknown = sorted(set(value) - set(_TOKENIZER_ATTRIBUTES))
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} (give kind/path for a tokenmill tokenizer, or "
            f"{list(_TOKENIZER_ATTRIBUTES)})"
        )
    for required in ("vocab_size", "eod", "unique_identifiers"):
        if required not in value:
            raise ValueError(f"{where}: missing {required!r}")
    for number_field in ("vocab_size", "eod", "pad", "eos"):
        number = value.get(number_field)
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise ValueError(f"{where}.{number_field}: must be an integer, got {number!r}")
    if not isinstance(value["unique_identifiers"], dict):
        raise ValueError(
            f"{where}.unique_identifiers: must be a mapping, got {value['unique_identifiers']!r}"
        )
    return ConfigTokenizer(
        value["vocab_size"],
        value["eod"],
        value["unique_identifiers"],
        value.get("pad"),
        value.get("eos"),
    )


def _names_raw_text(kwargs: Mapping[str, Any]) -> bool:
    from tokenmill.datasets.raw_text import is_raw_text

    blends = [kwargs.get("blend"), *(kwargs.get("blend_per_split") or [])]
    return any(is_raw_text(entry) for blend in blends if blend for entry in blend[0])


def _raw_text(options: Any, where: str) -> Any:
    """`tokenmill.RawText` from the config file's `raw_text` mapping (None or true: defaults).

    Raises:
        ValueError: not a mapping, or an option RawText does not take (naming it).
    """
    from tokenmill.raw_text import RawText

    if options is None or options is True:
        return RawText()
    if not isinstance(options, dict):
        raise ValueError(f"{where} must be a mapping of RawText options, got {options!r}")
    known = {item.name for item in dataclasses.fields(RawText)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    return RawText(**options)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda obj: obj.unique_identifiers))


_SIMPLE_TYPES: dict[str, type] = {"int": int, "bool": bool, "float": float, "str": str}


def _check_field_types(config_class: Any, values: Mapping[str, Any], where: str) -> None:
    """ConfigTextError naming the field when a value's type differs from its field's annotation
    (``int``, ``bool``, ``float``, ``str``, optionally ``| None``; a float field takes an int):
    "12" is not coerced to 12. Fields with other annotations are left to the config class."""
    from tokenmill.common.config_text import typed

    for item in dataclasses.fields(config_class):
        if item.name not in values:
            continue
        names = [part.strip() for part in str(item.type).split("|")]
        optional = "None" in names
        names = [name for name in names if name != "None"]
        if not names or any(name not in _SIMPLE_TYPES for name in names):
            continue
        if optional and values[item.name] is None:
            continue
        typed(values, item.name, tuple(_SIMPLE_TYPES[name] for name in names), where)


def load_run_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read a dataset config file (see the module docstring for its keys).

    Raises:
        FileNotFoundError: the file or a tokenizer file is missing.
        ValueError: unknown keys or bad values (naming the file and the field).
    """
    name = os.fspath(path)
    data = read_config_file(name)
    base = Path(name).resolve().parent
    init_fields = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    unknown = sorted(set(data) - init_fields - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(
            f"{name}: unknown field {unknown[0]!r} (GPTDatasetConfig fields, 'sizes' and "
            "'packing' are allowed)"
        )
    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in _EXTRA_KEYS}
    if "tokenizer" not in kwargs:
        raise ValueError(f"{name}: missing field 'tokenizer'")
    kwargs["tokenizer"] = _tokenizer(kwargs["tokenizer"], f"{name}: tokenizer", base)
    if "blend" in kwargs:
        kwargs["blend"] = _parse_blend(kwargs["blend"], f"{name}: blend")
    if kwargs.get("blend_per_split") is not None:
        splits = kwargs["blend_per_split"]
        if not isinstance(splits, list) or len(splits) != 3:
            raise ValueError(f"{name}: blend_per_split must be a list of 3 blends, got {splits!r}")
        kwargs["blend_per_split"] = [
            _parse_blend(blend, f"{name}: blend_per_split[{i}]") for i, blend in enumerate(splits)
        ]
    _check_field_types(GPTDatasetConfig, kwargs, name)
    raw_options = kwargs.pop("raw_text", None)
    identity = _jsonable({**kwargs, "packing": data.get("packing")})
    if raw_options is not None or _names_raw_text(kwargs):
        kwargs["raw_text"] = _raw_text(raw_options, f"{name}: raw_text")
    try:
        config = GPTDatasetConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from error
    if config.mock:
        raise ValueError(f"{name}: no blend or blend_per_split: mock data has nothing to cache")

    sizes = parse_sizes(data["sizes"], f"{name}: sizes") if "sizes" in data else None
    packing = None
    if data.get("packing") is not None:
        from tokenmill.datasets.packed import PackingConfig

        options = data["packing"]
        if not isinstance(options, dict):
            raise ValueError(f"{name}: packing must be a mapping, got {options!r}")
        _check_field_types(PackingConfig, options, f"{name}: packing")
        options = {"path_to_cache": config.path_to_cache, **options}
        try:
            packing = PackingConfig(**options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: packing: {error}") from error

    return RunConfig(name, config, sizes, packing, identity)
