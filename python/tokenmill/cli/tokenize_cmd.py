"""``tokenmill tokenize`` and ``tokenmill merge``: text corpora to Megatron ``.bin/.idx``.

The work is done by :mod:`tokenmill.tokenize`; this module only parses arguments and maps
errors to a one-line message and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from tokenmill.cli._errors import one_line

TOKENIZE_EPILOG = """\
examples:
  # the built-in byte tokenizer, EOD after every document, 2 worker processes
  tokenmill tokenize data/*.jsonl.gz --output out/web --threads 2
  # a HF tokenizer.json, parquet inputs with the text in column "content"
  tokenmill tokenize shards/ --column content --tokenizer tokenizer.json --output out/web
  # tiktoken GPT-2 from a local file; BOS before each document (and so no EOD unless
  # --append-eod); 2048-token windows
  tokenmill tokenize corpus.jsonl.zst --tokenizer gpt2.tiktoken --prepend-bos \\
      --window 2048 --overlap 128 --output out/corpus
  # force a backend: gigatoken (fast), or the file's own library (HF tokenizers / tiktoken)
  tokenmill tokenize corpus.jsonl --tokenizer gigatoken:tokenizer.json --threads 8 -o out/c
  tokenmill tokenize corpus.jsonl --tokenizer reference:tokenizer.json -o out/c
  # 8 machines (or a SLURM array: SLURM_ARRAY_TASK_ID/COUNT), then one merge
  tokenmill tokenize 'data/**/*.jsonl' --rank $R --world-size 8 --output out/web
  tokenmill merge out/web.parts --output out/web
  # a Ray cluster (pip install 'tokenmill[ray]'): the same bytes, Ray schedules and retries
  tokenmill tokenize 'data/**/*.jsonl' --engine ray --ray-address head:6379 --output /shared/web

A tokenizer file runs on gigatoken when it is installed (pip install 'tokenmill[gigatoken]'),
loads the file and agrees with the file's own library on a probe text; otherwise on HF
tokenizers (tokenizer.json) or tiktoken (.tiktoken). Both give the same ids; the first line of
the output says which backend ran, and the sidecar records it.
The second line says which markers each document gets ("BOS 50256 before each document, no
EOD"): EOD after each document by default, BOS instead with --prepend-bos (add --append-eod for
both); docs/formats.md lists the flags that reproduce preprocess_data.py, NeMo's processor and
nanochat.
A killed run is resumed by running the same command again: finished inputs are skipped.
Output: <output>.bin/.idx (megatron-core's format) and <output>.tokenmill.json (the tokenizer
fingerprint that `merge` and tokenmill.tokenize.check_tokenizer compare).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tokenize`` and ``merge`` subcommands."""
    parser = subparsers.add_parser(
        "tokenize",
        help="tokenize jsonl/jsonl.gz/jsonl.zst/parquet/txt into Megatron .bin/.idx",
        description="Tokenize text files into one Megatron .bin/.idx dataset, in parallel, "
        "restartably, byte-identically for any worker count.",
        epilog=TOKENIZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", help="files, globs ('**' recurses) or directories")
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        help="output prefix (no .bin/.idx); s3://bucket/key is staged locally, then uploaded",
    )
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        help="'bytes' (built in: UTF-8 bytes, BOS 256, EOD 257), a HF tokenizer.json, or a "
        ".tiktoken BPE file (GPT-2 pattern), optionally prefixed by 'gigatoken:' or 'reference:' "
        "to force the backend (default: gigatoken when it can run the file) [default: bytes]",
    )
    parser.add_argument("--bos-token", help="BOS token string (HF/tiktoken); default: the EOD")
    parser.add_argument(
        "--eod-token", help="EOD token string (HF/tiktoken); default: <|endoftext|>"
    )
    parser.add_argument("--json-key", default="text", help="JSON field with the text [text]")
    parser.add_argument("--column", default="text", help="parquet column with the text [text]")
    parser.add_argument(
        "--txt-mode",
        choices=("file", "line"),
        default="file",
        help=".txt inputs: one document per file or per line [file]",
    )
    parser.add_argument("--prepend-bos", action="store_true", help="put BOS before each document")
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put EOD after each document (megatron's --append-eod) [on, but off with "
        "--prepend-bos: with GPT-2, BOS = EOD and both would mark every boundary twice]",
    )
    parser.add_argument("--window", type=int, help="split documents into windows of N tokens")
    parser.add_argument(
        "--overlap", type=int, default=0, help="tokens shared by consecutive windows (<= N/2)"
    )
    parser.add_argument(
        "--threads",
        "--workers",
        dest="threads",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="cores to use: gigatoken encode threads (and its RAYON_NUM_THREADS), or worker "
        "processes for the other backends; 0 runs in this process [min(cores, 8)]",
    )
    parser.add_argument(
        "--chunk-mb",
        type=float,
        help="work chunk size [8 MB with gigatoken, else 1 MB]",
    )
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=1024.0,
        help="memory the chunks in flight may take, besides the output's index [1024]",
    )
    parser.add_argument("--rank", type=int, help="this machine's rank [env RANK, SLURM, 0]")
    parser.add_argument("--world-size", type=int, help="number of machines [env, 1]")
    parser.add_argument(
        "--format",
        choices=("megatron", "nanogpt"),
        default="megatron",
        help="output format: Megatron .bin/.idx, or a modded-nanogpt .bin + .bos.idx "
        "(needs --prepend-bos) [megatron]",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        help="--format nanogpt: tokens per shard [10**8, fineweb's shards; at most 2**31 - 4096 "
        "bytes of tokens, what modded-nanogpt's loader reads in one call]",
    )
    parser.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this machine's cores (--threads; --rank/--world-size for arrays); ray: a "
        "Ray actor pool writes the parts, the output on a path every node sees "
        "(pip install 'tokenmill[ray]'; docs/ray.md) [local]",
    )
    parser.add_argument(
        "--ray-address",
        help="the Ray cluster for --engine ray (host:port or ray://host:port) [env RAY_ADDRESS, "
        "else a new local cluster]",
    )
    parser.add_argument("--keep-parts", action="store_true", help="keep <output>.parts/")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or lines")
    parser.set_defaults(handler=run_tokenize)

    merge = subparsers.add_parser(
        "merge",
        help="concatenate .bin/.idx datasets (or a <prefix>.parts directory) into one",
        description="Concatenate datasets in order with megatron's add_index semantics. "
        "A directory argument stands for its datasets, sorted (megatron's merge_datasets.py). "
        "Datasets tokenized with different tokenizers are refused.",
    )
    merge.add_argument("inputs", nargs="+", help="dataset prefixes or directories")
    merge.add_argument("--output", "-o", required=True, help="output prefix")
    merge.add_argument(
        "--allow-missing-fingerprint",
        action="store_true",
        help="also merge datasets without a .tokenmill.json (not written by tokenmill)",
    )
    merge.add_argument("--quiet", "-q", action="store_true", help="no progress bar or lines")
    merge.set_defaults(handler=run_merge)


def _fail(error: BaseException) -> int:
    sys.stderr.write(f"tokenmill: error: {one_line(error)}\n")
    return 1


def run_tokenize(args: argparse.Namespace) -> int:
    """Handler of ``tokenmill tokenize``."""
    from tokenmill.errors import TokenmillError
    from tokenmill.tokenize.pipeline import TokenizeConfig, resolve_rank, tokenize
    from tokenmill.tokenize.readers import ReadOptions
    from tokenmill.tokenize.tokenizers import TokenizerSpec

    # one knob: gigatoken's thread pool gets the same size as tokenmill's workers (set before
    # gigatoken is imported; the pipeline's own encodes run on its threads, not on this pool)
    os.environ["RAYON_NUM_THREADS"] = str(max(1, args.threads))
    try:
        rank, world_size = resolve_rank(args.rank, args.world_size)
        config = TokenizeConfig(
            inputs=tuple(args.inputs),
            output_prefix=args.output,
            tokenizer=TokenizerSpec.parse(args.tokenizer, args.bos_token, args.eod_token),
            read=ReadOptions(
                json_key=args.json_key,
                column=args.column,
                txt_mode=args.txt_mode,
                chunk_bytes=None
                if args.chunk_mb is None
                else max(1, int(args.chunk_mb * (1 << 20))),
            ),
            prepend_bos=args.prepend_bos,
            # EOD by default, but not after a prepended BOS unless asked (--append-eod)
            append_eod=not args.prepend_bos if args.append_eod is None else args.append_eod,
            window=args.window,
            overlap=args.overlap,
            workers=args.threads,
            rank=rank,
            world_size=world_size,
            output_format=args.format,
            nanogpt_shard_tokens=args.shard_tokens,
            keep_parts=args.keep_parts,
            progress=not args.quiet,
            memory_budget=max(1, int(args.memory_budget_mb * (1 << 20))),
        )
        if args.engine == "ray":
            from tokenmill.ray.engine import tokenize_on_ray

            result = tokenize_on_ray(config, address=args.ray_address)
        else:
            if args.ray_address:
                raise ValueError("--ray-address needs --engine ray")
            result = tokenize(config)
    except (TokenmillError, ValueError, OSError, NotImplementedError, ImportError) as error:
        return _fail(error)
    if not args.quiet:
        where = result.output_prefix or f"{len(result.parts)} part(s)"
        sys.stderr.write(
            f"[tokenize] done: {result.documents:,} documents, {result.tokens:,} tokens in "
            f"{result.seconds:.2f} s ({result.text_bytes / max(result.seconds, 1e-9) / 1e6:.1f} "
            f"MB/s) with {result.backend} -> {where}\n"
        )
    return 0


def run_merge(args: argparse.Namespace) -> int:
    """Handler of ``tokenmill merge``."""
    from tokenmill.errors import TokenmillError
    from tokenmill.tokenize.merge import find_prefixes, merge_datasets

    try:
        prefixes: list[str] = []
        for item in args.inputs:
            prefixes.extend(find_prefixes(item) if os.path.isdir(item) else [item])
        merge_datasets(
            prefixes,
            args.output,
            allow_missing_fingerprint=args.allow_missing_fingerprint,
            progress=not args.quiet,
        )
    except (TokenmillError, ValueError, OSError) as error:
        return _fail(error)
    return 0
