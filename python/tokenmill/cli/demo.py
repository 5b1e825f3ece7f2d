"""``tokenmill demo``: write shards, build a blended train/valid/test split, stream batches.

Everything runs offline on text made on the spot: documents are sentences of the Zen of
Python (from the standard library's ``this`` module) in a seeded random order, tokenized as
UTF-8 bytes (ids 0-255, EOD = 256). The demo then does what a Megatron trainer does at start-up
and during training, through tokenmill's Megatron-compatible API, and reports the timings.
"""

from __future__ import annotations

import argparse
import codecs
import tempfile
import time
from pathlib import Path

EPILOG = """\
The same steps with your own data:
  1. write shards with tokenmill.IndexedDatasetBuilder (or megatron's preprocess_data.py);
  2. build splits with tokenmill.BlendedMegatronDatasetBuilder(GPTDataset, sizes,
     lambda: True, GPTDatasetConfig(blend=([prefix, ...], [weight, ...]), split="969,30,1",
     sequence_length=..., random_seed=..., tokenizer=..., path_to_cache=...));
  3. iterate the returned datasets with a torch DataLoader.
See the README for each step.
"""

EOD = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus an end-of-document id (what GPTDatasetConfig reads)."""

    vocab_size = 257
    eod = EOD

    def __init__(self) -> None:
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257}

    def encode(self, text: str) -> list[int]:
        return [*text.encode("utf-8"), EOD]

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run an end-to-end example on embedded data (offline, a few seconds)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", type=Path, help="keep the shards and caches here")
    parser.add_argument("--documents", type=int, default=3000, help="documents per corpus")
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--train-samples", type=int, default=4000)
    parser.set_defaults(handler=run)


def _sentences() -> list[str]:
    import this  # prints the Zen when first imported (silenced by the caller); text is rot13

    text = codecs.decode(this.s, "rot13")
    return [line.strip() for line in text.splitlines() if line.strip()]


def run(args: argparse.Namespace) -> int:
    if args.output_dir is None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-demo-") as directory:
            return _demo(Path(directory), args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    return _demo(args.output_dir, args)


def _demo(directory: Path, args: argparse.Namespace) -> int:
    import contextlib
    import io

    import numpy as np

    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
    from tokenmill.formats.megatron import IndexedDataset, IndexedDatasetBuilder

    with contextlib.redirect_stdout(io.StringIO()):
        sentences = _sentences()
    tokenizer = ByteTokenizer()
    rng = np.random.default_rng(0)
    prefixes = []
    started = time.perf_counter()
    total_tokens = 0
    for name in ("zen-a", "zen-b", "zen-c"):
        prefix = str(directory / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(args.documents):
            count = int(rng.integers(1, 8))
            picked = rng.choice(len(sentences), count)
            tokens = tokenizer.encode(" ".join(sentences[i] for i in picked))
            total_tokens += len(tokens)
            builder.add_document(np.asarray(tokens, dtype=np.uint16), [len(tokens)])
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    write_seconds = time.perf_counter() - started
    print(
        f"wrote 3 Megatron .bin/.idx corpora: {3 * args.documents:,} documents, "
        f"{total_tokens:,} tokens in {write_seconds:.2f} s  ({directory})"
    )

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.sequence_length,
        blend=(prefixes, [0.5, 0.3, 0.2]),
        split="90,5,5",
        tokenizer=tokenizer,
        path_to_cache=str(directory / "cache"),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [args.train_samples, args.train_samples // 20, args.train_samples // 20]
    timings = []
    for _ in range(2):
        started = time.perf_counter()
        train, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, config
        ).build()
        timings.append(time.perf_counter() - started)
    print(
        f"built the blend (weights 0.5/0.3/0.2, split 90,5,5): train {len(train):,}, "
        f"valid {len(valid):,}, test {len(test):,} samples of {args.sequence_length} tokens "
        f"in {timings[0]:.3f} s; again from the cache in {timings[1]:.3f} s"
    )
    counts = np.bincount(np.asarray(train.dataset_index), minlength=3)
    print(f"train samples per corpus: {counts.tolist()} (asked 50% / 30% / 20%)")

    import torch

    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=False, num_workers=0)
    started = time.perf_counter()
    batches = 0
    for batch in loader:
        batches += 1
        assert batch["tokens"].shape == (batch["tokens"].shape[0], args.sequence_length)
    seconds = time.perf_counter() - started
    samples = len(train)
    print(
        f"streamed {batches} batches through a DataLoader: {samples / seconds:,.0f} samples/s, "
        f"{samples * args.sequence_length / seconds / 1e6:.1f} M tokens/s"
    )
    first = train[0]
    text = tokenizer.decode(first["tokens"][:120].tolist())
    print(f"train[0] (corpus {int(first['dataset_id'])}) begins: {text!r}")
    low_level = IndexedDataset(prefixes[0])
    print(
        f"corpus zen-a: {len(low_level):,} sequences, dtype {low_level.dtype.__name__}, "
        f"cache files: {len(list((directory / 'cache').glob('*.npy')))} .npy"
    )
    print("done: see `tokenmill demo --help` to run the same steps on your own data")
    return 0
