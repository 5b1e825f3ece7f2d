"""Dataset configs with megatron-core 0.19's fields, defaults and validation.

`BlendedMegatronDatasetConfig` and `GPTDatasetConfig` accept exactly the arguments megatron-core
accepts and derive `split_matrix`, `mock` and `token_dtype_code` the same way, so a trainer can
switch its import. Where megatron-core asserts, tokenmill raises ValueError naming the field and
value. tokenmill's own additions come last, have defaults that keep megatron's behaviour, and
are not part of any cache key:

* `cache_build_scope`: "global" (megatron: global rank 0 builds missing index caches) or "node"
  (the first rank of every node builds, for caches on node-local disks).
* `cache_data_check`: what happens when the `.bin`/`.idx` behind a cached index changed since the
  entry was built (size, mtime or sampled contents differ from the fingerprint written beside the
  entry; see `tokenmill.index.fingerprint`): "rebuild" (default: the cache-building rank rebuilds
  it, other ranks raise StaleCacheError), "error" (StaleCacheError everywhere) or "off"
  (megatron-core's path-only key: nothing is checked and no sidecar is written).
* `exact_sample_count`: megatron computes the sample count of a split that keeps its partial last
  sample (valid with `drop_last_partial_validation_sequence=False`) in single precision, which can
  add one bogus sample above 2^24 tokens. False (default) reproduces that; True counts exactly.
* `index_build_threads`: threads for the C++ index build (results never depend on it).
* `raw_text`: the resolver of blend entries naming raw text (`tokenmill.datasets.raw_text`).
* `token_output_dtype`: dtype of the returned `tokens` and `labels`: "int64" (default, megatron's
  `.long()`), "int32", or "storage" (the `.bin` dtype, e.g. uint16; 4x less memory and transfer
  than int64). Pad positions are 0 in every case.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from tokenmill.common.megatron_log import log, megatron_logger
from tokenmill.common.megatron_version import followed
from tokenmill.datasets.utils import (
    Blend,
    Split,
    SplitMatrix,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from tokenmill.errors import MegatronAssertionError

if TYPE_CHECKING:
    from tokenmill.storage.object_storage import ObjectStorageConfig

__all__ = ["BlendedMegatronDatasetConfig", "GPTDatasetConfig"]

logger = logging.getLogger(__name__)
_MEGATRON_LOG = megatron_logger("blended_megatron_dataset_config")

TOKENMILL_FIELDS = frozenset(
    {
        "sft_mock_dataset_config_json",
        "varlen_mock_dataset_config_json",
        "varlen_sbhd_validation",
        "dynamic_context_parallel",
        "cache_build_scope",
        "cache_data_check",
        "exact_sample_count",
        "index_build_threads",
        "token_output_dtype",
        "raw_text",
    }
)
"""Config fields megatron-core 0.19 does not have (tokenmill's own, and Megatron-LM main's):
left out of the config in megatron's log lines."""

_MAIN_FIELDS = frozenset(
    {"sft_mock_dataset_config_json", "varlen_mock_dataset_config_json", "varlen_sbhd_validation"}
)
"""Megatron-LM main's (0.20) fields of the list above: in its log lines when main is followed."""

_UINT16_CARDINALITY = 1 << 16


def _check_blend(blend: Any, field_name: str) -> None:
    if blend is None:
        return
    if not isinstance(blend, (tuple, list)) or len(blend) != 2:
        raise ValueError(f"{field_name} must be a (prefixes, weights or None) pair, got {blend!r}")
    prefixes, weights = blend
    if isinstance(prefixes, str) or not prefixes:
        raise ValueError(f"{field_name} prefixes must be a non-empty list, got {prefixes!r}")
    if weights is not None and len(weights) != len(prefixes):
        raise MegatronAssertionError(
            f"{field_name} prefixes and weights must be equal in number, got {len(prefixes)} "
            f"prefixes and {len(weights)} weights"
        )


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration of Megatron-style datasets (megatron-core's fields and defaults)."""

    random_seed: int
    """The seed of every random draw during dataset creation."""

    sequence_length: int
    """The sequence length."""

    blend: Blend | None = None
    """(prefixes, weights or None); weights None means each dataset contributes one epoch."""

    blend_per_split: list[Blend | None] | None = None
    """One blend per split (train, valid, test); excludes `blend` and `split`."""

    multiple_validation_sets: bool | None = None
    """Treat the validation blend as separate datasets (blend_per_split only)."""

    full_validation: bool | None = None
    """Run a full epoch of every validation set (sizes must then be None)."""

    split: str | None = None
    """Split string such as "969,30,1" (with `blend`)."""

    split_matrix: SplitMatrix | None = field(init=False, default=None)
    """Book-ends of each split, derived from `split`."""

    num_dataset_builder_threads: int = 1
    """Threads that build the datasets of a blend."""

    path_to_cache: str | None = None
    """Directory of the cached index arrays."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files (False: read them with plain file reads)."""

    mock: bool = field(init=False, default=False)
    """Derived: True when neither blend nor blend_per_split is given."""

    tokenizer: Any = None
    """Tokenizer object with megatron's attributes (vocab_size, eod, unique_identifiers, ...)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per member of a weighted blend."""

    allow_ambiguous_pad_tokens: bool | None = False
    """Keep masking a pad id that collides with another special token."""

    fast_cache_load: bool = False
    """Assume every cache is built and skip the checks that prove it."""

    defer_npy_index_mmap: bool = False
    """Map the cached index arrays only on first access."""

    def __post_init__(self) -> None:
        if self.sequence_length is None or int(self.sequence_length) < 1:
            raise ValueError(f"sequence_length must be >= 1, got {self.sequence_length!r}")
        if self.random_seed is None or not 0 <= int(self.random_seed) < 2**32:
            raise ValueError(f"random_seed must be in [0, 2**32), got {self.random_seed!r}")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(
                f"mid_level_dataset_surplus must be >= 0, got {self.mid_level_dataset_surplus}"
            )
        if self.num_dataset_builder_threads < 1:
            raise ValueError(
                f"num_dataset_builder_threads must be >= 1, got {self.num_dataset_builder_threads}"
            )
        if self.fast_cache_load:
            if self.path_to_cache is None:
                raise MegatronAssertionError("fast_cache_load requires path_to_cache")
            if self.blend is not None:
                raise MegatronAssertionError(
                    "fast_cache_load cannot be used with blend; use blend_per_split instead"
                )
        if self.defer_npy_index_mmap and self.path_to_cache is None:
            raise MegatronAssertionError("defer_npy_index_mmap requires path_to_cache")

        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise MegatronAssertionError("blend and blend_per_split are incompatible")
            if self.split is not None:
                raise MegatronAssertionError("split and blend_per_split are incompatible")
            if len(self.blend_per_split) != len(Split):
                raise MegatronAssertionError(
                    f"blend_per_split must contain {len(Split)} blends, "
                    f"got {len(self.blend_per_split)}"
                )
            for split in Split:
                if self.blend_per_split[split.value] is None:
                    log(_MEGATRON_LOG, logging.INFO, f"blend not provided for {split.name} split")
                _check_blend(self.blend_per_split[split.value], f"blend_per_split[{split.name}]")
        else:
            if self.blend is not None:
                _check_blend(self.blend, "blend")
                if self.split is None:
                    raise MegatronAssertionError("split must be provided when blend is not None")
            else:
                self.mock = True
                log(
                    _MEGATRON_LOG,
                    logging.INFO,
                    "Let mock = True, as both blend and blend_per_split are None",
                )
                self.split = "1,1,1"
                log(
                    _MEGATRON_LOG,
                    logging.INFO,
                    f"Let split = {self.split}, an arbitrarily even split, as mock is True",
                )
            self.split_matrix = convert_split_vector_to_split_matrix(
                parse_and_normalize_split(self.split)
            )
            log(_MEGATRON_LOG, logging.INFO, f"Let split_matrix = {self.split_matrix}")

    def megatron_repr(self) -> str:
        """megatron-core's repr of this config: the dataclass repr without tokenmill's own
        fields (`TOKENMILL_FIELDS`), as megatron's builder logs it."""
        # fields of megatron-core 0.19 that the release followed does not have yet, and of
        # Megatron-LM main (0.20) when it is followed
        hidden = set(TOKENMILL_FIELDS)
        if followed() < (0, 19):
            hidden.add("inter_document_masking")
        if followed() >= (0, 20):
            hidden -= _MAIN_FIELDS
        shown = [
            f"{item.name}={getattr(self, item.name)!r}"
            for item in fields(self)
            if item.repr and item.name not in hidden
        ]
        return f"{type(self).__qualname__}({', '.join(shown)})"


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of GPT datasets (megatron-core's fields and defaults, then tokenmill's)."""

    reset_position_ids: bool | None = None
    """Restart position ids after every EOD token."""

    reset_attention_mask: bool | None = None
    """Stop attention across EOD tokens (in the dense mask)."""

    eod_mask_loss: bool | None = None
    """Zero the loss on EOD tokens."""

    create_attention_mask: bool = True
    """Return the dense [1, S, S] mask (costly: prefer cu_seqlens)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the final partial sample of the validation split."""

    add_extra_token_to_sequence: bool = True
    """Read sequence_length + 1 tokens so inputs and labels both have sequence_length."""

    object_storage_cache_path: str | ObjectStorageConfig | None = None
    """Local directory for the `.idx` files of `s3://` datasets (megatron's field); tokenmill also
    takes a whole `tokenmill.storage.object_storage.ObjectStorageConfig` here (chunk and cache
    sizes, prefetch). Not part of the cache key."""

    data_parallel_size: int = 1
    """Data-parallel size (megatron parallelism field)."""

    sequence_parallel_size: int = 0
    """Sequence-parallel size, 0 when disabled (megatron parallelism field)."""

    hybrid_context_parallel: bool = False
    """Hybrid context parallelism (megatron parallelism field)."""

    sequences_per_dataset: dict[str, Any] | None = None
    """Per-prefix (sequence_count, document_count), letting readers skip the .idx header."""

    token_dtype_code: int | None = field(init=False, default=None)
    """Derived: 8 (uint16) when vocab_size <= 65536, else 4 (int32); None without a vocab."""

    context_parallel_size: int | None = None
    """Context-parallel size (megatron parallelism field)."""

    inter_document_masking: bool = False
    """Return cu_seqlens / max_seqlen marking document boundaries instead of a dense mask."""

    # Megatron-LM main (0.20.0-dev) adds these; accepted so its training code can pass them.
    # They configure datasets tokenmill does not implement (SFT and variable-length mock data) and
    # parallelism; no GPTDataset sample, index or cache key depends on them.
    sft_mock_dataset_config_json: str | None = None
    """Megatron-LM main: JSON configuring its mock SFT dataset (unused by GPTDataset)."""

    varlen_mock_dataset_config_json: str | None = None
    """Megatron-LM main: JSON configuring its variable-length mock dataset (unused here)."""

    varlen_sbhd_validation: bool = False
    """Megatron-LM main: SBHD reference samples for variable-length validation (unused here)."""

    dynamic_context_parallel: bool = False
    """Accepted and unused: no Megatron-LM release or main has this field (main's is
    hybrid_context_parallel); kept so configs that set it still load."""

    cache_build_scope: str = "global"
    """tokenmill: "global" (rank 0 builds caches) or "node" (each node's first rank builds)."""

    cache_data_check: str = "rebuild"
    """tokenmill: stale-data policy of index caches: "rebuild", "error" or "off" (megatron)."""

    exact_sample_count: bool = False
    """tokenmill: count partial-sample splits exactly instead of megatron's float32 ceil."""

    index_build_threads: int | None = None
    """tokenmill: threads for the C++ index build (None: up to 4; results never change)."""

    token_output_dtype: str = "int64"
    """tokenmill: dtype of tokens/labels: "int64" (megatron), "int32" or "storage" (the .bin's)."""

    raw_text: Any = None
    """tokenmill: the resolver of blend entries that name raw text (``tokenmill.RawText(...)``:
    tokenized by all ranks at build time into cached prefixes; see `tokenmill.datasets.raw_text`).
    None: such entries need a resolver of their own (``patch_megatron``'s ``--data-path``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise MegatronAssertionError(
                "GPTDatasetConfig needs a tokenizer (vocab_size, eod, ...)"
            )
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise MegatronAssertionError(f"{name} must be set to True or False, got None")
        if self.varlen_sbhd_validation and self.hybrid_context_parallel:
            # Megatron-LM main's check: SBHD validation batches are not packed
            raise MegatronAssertionError(
                "varlen_sbhd_validation=True is incompatible with hybrid_context_parallel=True "
                "(SBHD mode is not packed)"
            )
        if self.cache_build_scope not in ("global", "node"):
            raise ValueError(
                f"cache_build_scope must be 'global' or 'node', got {self.cache_build_scope!r}"
            )
        if self.cache_data_check not in ("rebuild", "error", "off"):
            raise ValueError(
                "cache_data_check must be 'rebuild', 'error' or 'off', got "
                f"{self.cache_data_check!r}"
            )
        if self.token_output_dtype not in ("int64", "int32", "storage"):
            raise ValueError(
                "token_output_dtype must be 'int64', 'int32' or 'storage', got "
                f"{self.token_output_dtype!r}"
            )
        if self.index_build_threads is not None and self.index_build_threads < 1:
            raise ValueError(f"index_build_threads must be >= 1, got {self.index_build_threads}")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.token_dtype_code = (
            None if vocab_size is None else (4 if vocab_size > _UINT16_CARDINALITY else 8)
        )
        if self.sequences_per_dataset is not None and self.token_dtype_code is None:
            raise MegatronAssertionError(
                "sequences_per_dataset needs the tokenizer's vocab_size to know the token dtype"
            )
