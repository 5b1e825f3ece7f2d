"""Tokenize pipeline vs the tokenizer's own batch encoder, same corpus, same thread count.

Baseline: tiktoken's ``encode_ordinary_batch(texts, num_threads=N)`` over all documents already
in memory (no reading, no writing). Pipeline: ``tokenmill.tokenize`` with ``workers=N`` end to
end: reading the jsonl, encoding in N processes, writing and assembling the Megatron
``.bin/.idx``. The ratio pipeline / baseline (tokens per second) is the number that matters;
the target is >= 0.9. The first documents' tokens are checked to be identical.

Corpus: every UTF-8 ``.gz`` file of Debian's ``linux-doc-6.1`` (8,853 documents, 46 MB of
reStructuredText, GPL-2.0, not redistributed), written once as a jsonl into ``--work-dir``.
Tokenizer: the real GPT-2 BPE, ``whisper/assets/gpt2.tiktoken`` from the MIT-licensed
``openai-whisper==20250625`` source distribution (fetched with ``pip download --no-deps`` into
``--work-dir``; whisper is never installed), checked against tiktoken's r50k_base sha256.

Usage: ``python benchmarks/bench_tokenize.py [--threads 2] [--repeat 3] [--work-dir DIR]``
(``apt-get install -y linux-doc-6.1`` first if the corpus is missing).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from tokenmill.formats.megatron import IndexedDataset
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
from tokenmill.tokenize.tokenizers import TiktokenTokenizer, TokenizerSpec

LINUX_DOC = Path("/usr/share/doc/linux-doc-6.1")
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER = "openai-whisper==20250625"


def build_corpus(work: Path) -> Path:
    """The linux-doc jsonl (written once)."""
    corpus = work / "linux-doc-6.1.jsonl"
    if corpus.exists():
        return corpus
    if not LINUX_DOC.is_dir():
        sys.exit(
            f"{LINUX_DOC} not found; install the corpus with:\n"
            "  apt-get update && apt-get install -y linux-doc-6.1"
        )
    temporary = corpus.with_suffix(".tmp")
    with open(temporary, "w", encoding="utf-8") as stream:
        for path in sorted(LINUX_DOC.rglob("*.gz")):
            try:
                text = gzip.decompress(path.read_bytes()).decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # fonts and other binary files
            stream.write(json.dumps({"text": text}) + "\n")
    temporary.replace(corpus)
    return corpus


def fetch_gpt2(work: Path) -> Path:
    """``gpt2.tiktoken`` from the openai-whisper sdist (downloaded once, never installed)."""
    target = work / "gpt2.tiktoken"
    if not target.exists():
        download = work / "whisper-sdist"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                WHISPER,
                "-d",
                str(download),
            ],
            check=True,
        )
        archive = next(download.glob("openai_whisper-*.tar.gz"))
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("assets/gpt2.tiktoken"))
            source = tar.extractfile(member)
            if source is None:
                sys.exit(f"{archive}: {member.name} is not a file")
            target.write_bytes(source.read())
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != GPT2_SHA256:
        sys.exit(f"{target}: sha256 {digest} is not GPT-2's r50k_base ({GPT2_SHA256})")
    return target


def bench(
    args: argparse.Namespace,
    corpus: Path,
    bpe: Path,
    tokenizer: TiktokenTokenizer,
    texts: list[str],
    threads: int,
) -> tuple[float, float, int]:
    """Best-of-``repeat`` seconds of the baseline and of the pipeline (alternating runs) and the
    token count."""
    baseline_seconds = pipeline_seconds = float("inf")
    baseline: list[list[int]] = []
    output = args.work_dir / "linux-doc-gpt2"
    config = TokenizeConfig(
        inputs=(str(corpus),),
        output_prefix=str(output),
        tokenizer=TokenizerSpec("tiktoken", str(bpe)),
        workers=threads,
        append_eod=True,
        progress=False,
    )
    result = None
    for _ in range(args.repeat):
        start = time.perf_counter()
        baseline = tokenizer.encode_ordinary_batch(texts, num_threads=threads)
        baseline_seconds = min(baseline_seconds, time.perf_counter() - start)
        start = time.perf_counter()
        result = tokenize(config)
        pipeline_seconds = min(pipeline_seconds, time.perf_counter() - start)
    tokens = sum(len(ids) for ids in baseline)
    written = IndexedDataset(str(output))
    if result is None or result.tokens != tokens + len(texts):
        sys.exit(f"pipeline wrote the wrong number of tokens, expected {tokens} + {len(texts)}")
    for index in range(min(200, len(texts))):
        if not np.array_equal(written[index][:-1], np.asarray(baseline[index])):
            sys.exit(f"document {index}: pipeline tokens differ from tiktoken's")
    return baseline_seconds, pipeline_seconds, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2], help="threads = worker processes"
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    parser.add_argument("--work-dir", type=Path, default=Path("bench-tokenize-work"))
    parser.add_argument("--tiktoken", type=Path, help="a local gpt2.tiktoken (else downloaded)")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(args.work_dir)
    bpe = args.tiktoken or fetch_gpt2(args.work_dir)
    tokenizer = TiktokenTokenizer(str(bpe))
    with open(corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    print(
        f"corpus {corpus}: {len(texts):,} documents, {text_bytes / 1e6:.1f} MB; "
        f"tokenizer {bpe.name} (vocab {tokenizer.vocab_size}); {args.threads} thread(s); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )

    print(f"\n| {'what':<58} | {'time':>7} | {'M tok/s':>7} | {'MB/s':>6} | {'ratio':>5} |")
    print(f"|{'-' * 60}|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 7}|")
    for threads in args.threads:
        baseline_seconds, pipeline_seconds, tokens = bench(
            args, corpus, bpe, tokenizer, texts, threads
        )
        rows = [
            (f"tiktoken encode_ordinary_batch({threads} threads), in memory", baseline_seconds),
            (f"tokenmill tokenize --workers {threads}, jsonl -> .bin/.idx", pipeline_seconds),
        ]
        for name, seconds in rows:
            print(
                f"| {name:<58} | {seconds:6.2f}s | {tokens / seconds / 1e6:7.2f} | "
                f"{text_bytes / seconds / 1e6:6.1f} | {baseline_seconds / seconds:5.2f} |"
            )
    print(
        "\nratio = baseline time / this time (target for the pipeline: >= 0.90); "
        "the first 200 documents' tokens were checked identical"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
