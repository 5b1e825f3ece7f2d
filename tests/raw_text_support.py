"""Corpora, tokenizers and gloo rank jobs of the raw-text tests (tests/test_raw_text.py).

A rank job is a plain dict (it crosses into forked processes): world size, rendezvous, the blend
entries, tokenizer spec, cache directories, the output directory, and which rank pauses (to be
SIGKILLed) after how many committed pieces.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import multiprocessing
import os
import random
import socket
from pathlib import Path
from typing import Any

import numpy as np

FORK = multiprocessing.get_context("fork")

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "which",
    "or",
    "be",
    "are",
    "it",
    "this",
    "<|endoftext|>",
    "émile",
    "naïve",
    "数据",
    "🙂",
    "tokenmill",
    "megatron",
    "gradient",
    "sample",
    "shard",
    "index",
]


def documents(seed: int, count: int) -> list[str]:
    """Short documents of varied length, some empty, some with special-token text inside."""
    rng = random.Random(seed)
    result = []
    for _ in range(count):
        length = rng.choice([0, 1, 3, 8, 20, 45, 90])
        result.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return result


def write_corpus(path: Path, texts: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: texts}), str(path), row_group_size=17)
        return path
    payload = "".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts))
    data = payload.encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def make_corpora(root: Path) -> dict[str, str]:
    """One entry of each kind: a .jsonl, a .jsonl.zst, a .parquet, a directory of four files
    (two formats, one nested), and a glob."""
    entries = {
        "jsonl": str(write_corpus(root / "a.jsonl", documents(1, 60))),
        "zst": str(write_corpus(root / "b.jsonl.zst", documents(2, 50))),
        "parquet": str(write_corpus(root / "c.parquet", documents(3, 70))),
    }
    for number, name in enumerate(["d1.jsonl", "d2.jsonl.gz", "sub/d3.jsonl", "d4.parquet"]):
        write_corpus(root / "dir" / name, documents(10 + number, 30 + 5 * number))
    entries["directory"] = str(root / "dir")
    for number in range(3):
        write_corpus(root / "globbed" / f"g{number}.jsonl", documents(20 + number, 25))
    entries["glob"] = str(root / "globbed" / "g*.jsonl")
    return entries


def train_bpe(path: Path) -> Path:
    """A 400-token byte-level BPE tokenizer.json trained on the spot (no post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents(0, 200) * 3, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def write_tiktoken(path: Path) -> Path:
    """A tiny .tiktoken file: the 256 bytes plus a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"ng"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    return path


def gpt_config(entries: list[str], tokenizer: Any, cache: str, **extra: Any) -> Any:
    from tokenmill.datasets.gpt import GPTDatasetConfig

    weights = [1.0 + i for i in range(len(entries))] if len(entries) > 1 else None
    return GPTDatasetConfig(
        random_seed=1234,
        sequence_length=24,
        tokenizer=tokenizer,
        blend=(entries, weights),
        split="80,15,5",
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=False,
        path_to_cache=cache,
        **extra,
    )


SIZES = [120, 20, 6]


def build(config: Any) -> list[Any]:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    return BlendedMegatronDatasetBuilder(GPTDataset, SIZES, lambda: True, config).build()


def samples_digest(datasets: list[Any]) -> str:
    """One hash over every field of every sample of every split."""
    hasher = hashlib.sha256()
    for dataset in datasets:
        if dataset is None:
            hasher.update(b"none")
            continue
        hasher.update(str(len(dataset)).encode())
        for index in range(len(dataset)):
            sample = dataset[index]
            for name in sorted(sample):
                hasher.update(name.encode())
                hasher.update(np.asarray(sample[name]).tobytes())
    return hasher.hexdigest()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_main(job: dict[str, Any], rank: int) -> None:
    """One rank: a gloo group, the raw-text blend built as a trainer would, its digest and
    which pieces it tokenized written to ``<out>/<rank>.json``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if job.get("pause_rank") == rank:
        os.environ["TOKENMILL_TEST_RAW_TEXT_PAUSE_AFTER_PIECES"] = str(job["pause_after"])
        os.environ["TOKENMILL_TEST_RAW_TEXT_PAUSED_FILE"] = os.path.join(job["out"], "paused")
    import torch.distributed as dist

    import tokenmill.raw_text.resolver as resolver
    from tokenmill.raw_text import RawText

    dist.init_process_group(
        "gloo", init_method=job["rendezvous"], rank=rank, world_size=job["world"]
    )
    tokenized: list[str] = []
    runs: list[int] = []  # one entry per pipeline run
    original = resolver.tokenize

    def counting(config: Any) -> Any:
        tokenized.extend(config.inputs)
        runs.append(len(config.inputs))
        return original(config)

    resolver.tokenize = counting  # type: ignore[assignment]
    config = gpt_config(
        job["entries"],
        job["tokenizer"],
        job["cache"],
        raw_text=RawText(cache_dir=job["raw_cache"], threads=1, progress=False),
    )
    try:
        digest = samples_digest(build(config))
    except Exception as error:  # every rank must raise, none may hang
        notes = list(getattr(error, "__notes__", []))
        Path(job["out"], f"{rank}.json").write_text(
            json.dumps({"error": str(error), "type": type(error).__name__, "notes": notes})
        )
        dist.destroy_process_group()
        return
    dist.barrier()
    Path(job["out"], f"{rank}.json").write_text(
        json.dumps({"digest": digest, "tokenized": tokenized, "pipeline_runs": len(runs)})
    )
    dist.destroy_process_group()


def resolve_after_rank_0_main(job: dict[str, Any], rank: int) -> None:
    """One rank resolving the raw-text entries (`tokenize_raw_text`) only: rank 1 starts only
    once rank 0 has finished resolving (or after 30 s), and writes whether it had to give up
    waiting to ``<out>/<rank>.json``."""
    import time

    import torch.distributed as dist

    from tokenmill.raw_text import RawText
    from tokenmill.raw_text.resolver import tokenize_raw_text

    dist.init_process_group(
        "gloo", init_method=job["rendezvous"], rank=rank, world_size=job["world"]
    )
    signal = Path(job["out"], "rank-0-resolved")
    gave_up = False
    if rank == 1:
        deadline = time.monotonic() + 30
        while not signal.exists() and not gave_up:
            time.sleep(0.01)
            gave_up = time.monotonic() > deadline
    options = RawText(threads=1, progress=False)
    prefixes, _, _ = tokenize_raw_text(job["entries"], job["tokenizer"], job["raw_cache"], options)
    if rank == 0:
        signal.touch()
    dist.barrier()
    Path(job["out"], f"{rank}.json").write_text(
        json.dumps({"gave_up": gave_up, "prefixes": sorted(prefixes.values())})
    )
    dist.destroy_process_group()
