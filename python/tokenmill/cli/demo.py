"""``tokenmill demo``: tokenize a real corpus, build a blended train/valid/test split, stream batches.

Everything runs offline on the corpus shipped inside the package: the Jargon File 4.4.7 (public
domain; 2,307 lexicon entries, 1.3 MB of text, one document per entry). The demo

1. tokenizes it with the built-in byte tokenizer through the parallel, restartable pipeline
   (``tokenmill tokenize``) into two Megatron ``.bin/.idx`` datasets (the first and second half of the lexicon) and
   checks that they decode back to the input exactly;
2. if HF ``tokenizers`` is installed, trains a 4k byte-level BPE on the spot, tokenizes the
   corpus with it on the fastest backend available (gigatoken when installed, with the same ids
   as HF tokenizers) and prints that backend's throughput, and shows that mixing its shards
   with the byte-level ones is refused;
3. builds a 60/40 blend with a 90/5/5 train/valid/test split (``BlendedMegatronDatasetBuilder``
   + ``GPTDataset``, megatron-core's API), twice, the second time from the index cache;
4. streams the training split through a torch DataLoader and reports the throughput;
5. trains on raw text: the same blend naming the two ``.jsonl`` files instead of the tokenized
   prefixes (``GPTDatasetConfig(raw_text=tokenmill.RawText())``) is tokenized at build time into
   a cache and gives the same samples; the second build tokenizes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import tempfile
import time
from pathlib import Path
from typing import Any

EPILOG = """\
The same steps with your own data:
  1. tokenize it (jsonl, jsonl.gz, jsonl.zst, parquet or txt; files, globs or directories):
       tokenmill tokenize 'data/web/*.jsonl.gz' --tokenizer tokenizer.json --output data/web \\
           --workers 8
     (--tokenizer bytes | tokenizer.json (HF) | gpt2.tiktoken; --column for parquet,
      --txt-mode line for one document per line; see `tokenmill tokenize --help`)
  2. build the splits in Python, exactly as megatron-core does:
       from tokenmill import BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig
       from tokenmill.tokenize import load_tokenizer
       config = GPTDatasetConfig(
           blend=(["data/web", "data/code"], [0.7, 0.3]), split="969,30,1",
           sequence_length=2048, random_seed=1234, tokenizer=load_tokenizer("tokenizer.json"),
           path_to_cache="cache", reset_position_ids=False, reset_attention_mask=False,
           eod_mask_loss=False, create_attention_mask=False)
       train, valid, test = BlendedMegatronDatasetBuilder(
           GPTDataset, [n_train, n_valid, n_test], lambda: True, config).build()
  3. iterate them with torch.utils.data.DataLoader.
Or skip step 1: name the raw files in the blend and let every rank tokenize its share at
build time (cached; the same samples): GPTDatasetConfig(blend=(["data/web/*.jsonl.gz"], None),
tokenizer="tokenizer.json", raw_text=tokenmill.RawText(), ...), or under patch_megatron,
--data-path data/web.jsonl (see docs/raw-text.md).
Or stream parquet text straight into [B, T] batches with exact resume:
  tokenmill.tokenize.ParquetTokenLoader(files, B, T, "tokenizer.json").
See the README for each step.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run an end-to-end example on the embedded Jargon File (offline, a few seconds)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", type=Path, help="keep the datasets and caches here")
    parser.add_argument(
        "--documents", type=int, help="use only the first N entries (default: all 2,307)"
    )
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--train-samples", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=0, help="tokenizer worker processes")
    parser.set_defaults(handler=run)


def corpus_path() -> Path:
    """The embedded corpus, ``tokenmill/data/jargon.jsonl.gz``."""
    return Path(__file__).resolve().parent.parent / "data" / "jargon.jsonl.gz"


def load_corpus(limit: int | None = None) -> list[dict[str, str]]:
    """The Jargon File entries: ``{"term": ..., "text": ...}`` in lexicon order."""
    with gzip.open(corpus_path(), "rt", encoding="utf-8") as stream:
        entries = [json.loads(line) for line in stream]
    return entries if limit is None else entries[:limit]


def run(args: argparse.Namespace) -> int:
    if args.documents is not None and args.documents < 2:
        raise SystemExit(f"tokenmill demo: --documents must be >= 2, got {args.documents}")
    if args.output_dir is None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-demo-") as directory:
            return _demo(Path(directory), args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    return _demo(args.output_dir, args)


def _train_bpe(texts: list[str], path: Path) -> bool:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return False
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return True


def _demo(directory: Path, args: argparse.Namespace) -> int:
    import numpy as np

    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
    from tokenmill.errors import TokenizerMismatchError
    from tokenmill.formats.dataset_sidecar import check_tokenizer
    from tokenmill.formats.megatron import IndexedDataset
    from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
    from tokenmill.tokenize.tokenizers import ByteTokenizer, TokenizerSpec, load_tokenizer

    entries = load_corpus(args.documents)
    text_bytes = sum(len(entry["text"].encode("utf-8")) for entry in entries)
    print(
        f"corpus: the Jargon File 4.4.7 (public domain), {len(entries):,} entries, "
        f"{text_bytes / 1e6:.2f} MB ({corpus_path().name}, shipped in the package)"
    )
    middle = len(entries) // 2
    halves = {
        "jargon-1": [entry["text"] for entry in entries[:middle]],
        "jargon-2": [entry["text"] for entry in entries[middle:]],
    }
    inputs = {}
    for name, texts in halves.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        inputs[name] = path

    # 1. the byte tokenizer through the pipeline
    byte_tokenizer = ByteTokenizer()
    prefixes, tokens, seconds = [], 0, 0.0
    for name, path in inputs.items():
        result = tokenize(
            TokenizeConfig(
                inputs=(str(path),),
                output_prefix=str(directory / name),
                workers=args.workers,
                progress=False,
            )
        )
        prefixes.append(str(directory / name))
        tokens += result.tokens
        seconds += result.seconds
    first_dataset = IndexedDataset(prefixes[0])
    exact = all(
        byte_tokenizer.decode(first_dataset[i]) == text for i, text in enumerate(halves["jargon-1"])
    )
    print(
        f"tokenized with the built-in byte tokenizer (ids 0-255, EOD {byte_tokenizer.EOD}): "
        f"{len(halves['jargon-1']):,} + {len(halves['jargon-2']):,} documents, "
        f"{tokens:,} tokens in {seconds:.2f} s ({text_bytes / max(seconds, 1e-9) / 1e6:.1f} "
        f"MB/s), dtype {np.dtype(first_dataset.dtype).name}; decodes back exactly: {exact}"
    )

    # 2. a BPE trained on the spot, and the fingerprint check
    bpe_path = directory / "bpe-4k.tokenizer.json"
    started = time.perf_counter()
    texts = [entry["text"] for entry in entries]
    if _train_bpe(texts, bpe_path):
        trained = time.perf_counter() - started
        bpe = load_tokenizer(str(bpe_path))  # the fastest backend that runs the file
        result = tokenize(
            TokenizeConfig(
                inputs=tuple(str(path) for path in inputs.values()),
                output_prefix=str(directory / "jargon-bpe"),
                tokenizer=TokenizerSpec.parse(str(bpe_path)),
                workers=args.workers,
                progress=False,
            )
        )
        bpe_dataset = IndexedDataset(str(directory / "jargon-bpe"))
        round_trip = bpe.decode(bpe_dataset[0][:-1]) == halves["jargon-1"][0]
        print(
            f"trained a {bpe.vocab_size}-token byte-level BPE in {trained:.2f} s; tokenized: "
            f"{result.tokens:,} tokens ({text_bytes / result.tokens:.2f} bytes/token) in "
            f"{result.seconds:.2f} s; decodes back: {round_trip}"
        )
        started = time.perf_counter()
        encoded = sum(int(ids.shape[0]) for ids in bpe.encode_batch(texts))
        encoding = max(time.perf_counter() - started, 1e-9)
        print(
            f"backend: {result.backend}; encoding {text_bytes / encoding / 1e6:.1f} MB/s "
            f"({encoded / encoding / 1e6:.2f} M tokens/s, one thread); end to end "
            f"{result.text_bytes / max(result.seconds, 1e-9) / 1e6:.1f} MB/s with loading the "
            "tokenizer and writing .bin/.idx (fixed costs dominate a 1.3 MB corpus)"
        )
        try:
            check_tokenizer(prefixes[0], bpe)
        except TokenizerMismatchError as error:
            print(f"mixing byte-level and BPE shards is refused: {str(error)[:96]}...")
    else:
        print("(HF tokenizers is not installed: skipped the BPE step; pip install tokenizers)")

    # 3. a blended train/valid/test split, built twice (the second time from the cache)
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.sequence_length,
        blend=(prefixes, [0.6, 0.4]),
        split="90,5,5",
        tokenizer=byte_tokenizer,
        path_to_cache=str(directory / "cache"),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [args.train_samples, max(1, args.train_samples // 20), max(1, args.train_samples // 20)]
    timings = []
    splits: list[Any] = []
    for _ in range(2):
        started = time.perf_counter()
        splits = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        timings.append(time.perf_counter() - started)
    train, valid, test = splits
    print(
        f"built the blend (weights 0.6/0.4, split 90,5,5): train {len(train):,}, "
        f"valid {len(valid):,}, test {len(test):,} samples of {args.sequence_length} tokens "
        f"in {timings[0]:.3f} s; again from the cache in {timings[1]:.3f} s"
    )
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    print(f"train samples per dataset: {counts.tolist()} (asked 60% / 40%)")

    # 4. stream batches
    import torch

    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=False, num_workers=0)
    started = time.perf_counter()
    batches = 0
    for batch in loader:
        batches += 1
        if batch["tokens"].shape[1] != args.sequence_length:
            raise RuntimeError(f"batch of shape {tuple(batch['tokens'].shape)}")
    seconds = time.perf_counter() - started
    samples = len(train)
    print(
        f"streamed {batches} batches through a DataLoader: {samples / seconds:,.0f} samples/s, "
        f"{samples * args.sequence_length / seconds / 1e6:.1f} M tokens/s"
    )
    first = train[0]
    text = byte_tokenizer.decode(first["tokens"][:100])
    print(f"train[0] (dataset {int(first['dataset_id'])}) begins: {text!r}")
    print(
        f"files in {directory}: {', '.join(sorted(p.name for p in directory.glob('jargon-1*')))}"
        f"; cache: {len(list((directory / 'cache').glob('*.npy')))} .npy"
    )

    # 5. the same blend from raw text: tokenized at build time, cached, the same samples
    from tokenmill.raw_text import RawText

    raw_config = dataclasses.replace(
        config,
        blend=([str(path) for path in inputs.values()], [0.6, 0.4]),
        tokenizer="bytes",
        path_to_cache=str(directory / "raw-cache"),
        raw_text=RawText(progress=False),
    )
    timings = []
    for _ in range(2):
        started = time.perf_counter()
        raw_train = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, raw_config
        ).build()[0]
        timings.append(time.perf_counter() - started)
    same = len(raw_train) == len(train) and all(
        np.array_equal(raw_train[i]["tokens"], train[i]["tokens"]) for i in range(len(train))
    )
    print(
        f"trained on raw text (blend of {', '.join(p.name for p in inputs.values())}): "
        f"tokenized and built in {timings[0]:.2f} s, again in {timings[1]:.3f} s (nothing "
        f"tokenized); same samples as the tokenized blend: {same}"
    )
    print("done: see `tokenmill demo --help` to run the same steps on your own data")
    return 0
