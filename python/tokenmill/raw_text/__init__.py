"""Train on raw text: blend entries naming ``.jsonl``/``.jsonl.gz``/``.jsonl.zst``/``.parquet``
files, directories or globs are tokenized at build time by all ranks together, into a
content-addressed cache of Megatron ``.bin/.idx`` prefixes (:class:`RawText`).

A layer of its own, between ``megatron`` and ``loading``: the one place where ``tokenize`` meets
``datasets`` (which may not import it; see `tokenmill.datasets.raw_text` for the protocol), so
``megatron`` (``patch_megatron``'s ``--data-path``), ``runs`` and ``cli`` can all wire it.
"""

from __future__ import annotations

from tokenmill.raw_text.resolver import RawText, RawTextStats, tokenize_raw_text

__all__ = ["RawText", "RawTextStats", "tokenize_raw_text"]
