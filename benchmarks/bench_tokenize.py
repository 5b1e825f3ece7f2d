"""Tokenize end to end vs the tokenizers' own fastest APIs, same corpus, same thread count.

Rows (each in a fresh process: gigatoken's pre-token cache is process-wide, so a second run in
one process would start warm; the time covers loading the tokenizer and the work, not the
interpreter start and imports; peak RSS is the process's):

* ``gigatoken encode_files``: gigatoken reads the jsonl itself (``JsonlFileSource``), all ids
  in memory: its fastest API on a file, the baseline of the ratio;
* ``tokenmill gigatoken -> megatron`` / ``-> nanogpt``: ``tokenmill.tokenize`` with the
  gigatoken backend, reading the jsonl and writing finished ``.bin/.idx`` (or a
  modded-nanogpt ``.bin`` + ``.bos.idx``), ``workers`` = threads;
* ``tokenmill tiktoken -> megatron``: the same pipeline on the tiktoken backend (processes);
* ``tiktoken encode_ordinary_batch`` and ``HF encode_batch``: the texts already in memory (no
  reading, no writing; HF runs once, it is 50x slower than the rest);
* ``Megatron-LM preprocess_data.py``: Megatron-LM's own script (``--megatron-lm DIR``, a
  checkout; never vendored, run unchanged: on Python 3.11 ``typing.override`` is supplied from
  typing_extensions), with the same tokenizer.json through ``HuggingFaceTokenizer`` (needs
  ``transformers``), ``--workers`` = threads, when it runs; otherwise the row says why.

Then a memory row: the corpus repeated into a temporary jsonl of at least ``--big-gb`` GB,
tokenized by tokenmill (gigatoken, default 1 GiB budget) and by gigatoken's ``encode_files``;
the file is deleted afterwards.

``ratio`` is gigatoken encode_files' time / the row's time (target for tokenmill + gigatoken:
>= 0.90). ``cpu`` is user + system CPU seconds of the row's process: on a shared machine it moves
less than wall time. Every tokenmill output is checked token-identical to tiktoken's ids.

Corpus: every UTF-8 ``.gz`` file of Debian's ``linux-doc-6.1`` (8,854 documents, 46 MB of
reStructuredText, GPL-2.0, not redistributed), written once as a jsonl into ``--work-dir``.
Tokenizer: the real GPT-2 BPE, ``whisper/assets/gpt2.tiktoken`` from the MIT-licensed
``openai-whisper==20250625`` source distribution (``pip download --no-deps`` into
``--work-dir``; whisper is never installed), checked against tiktoken's r50k_base sha256; its
tokenizer.json / vocab.json + merges.txt forms are derived from the ranks here.

Usage: ``python benchmarks/bench_tokenize.py [--threads 1 2] [--repeat 3] [--work-dir DIR]
[--big-gb 1.0] [--megatron-lm DIR [--megatron-python PYTHON]]``
(``apt-get install -y linux-doc-6.1`` first if the corpus is missing).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path

LINUX_DOC = Path("/usr/share/doc/linux-doc-6.1")
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER = "openai-whisper==20250625"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             WHISPER, "-d", str(download)],
            check=True,
        )  # fmt: skip
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


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (HF ByteLevel, vocab.json)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table: dict[int, str] = {}
    extra = 0
    for value in range(256):
        if value in printable:
            table[value] = chr(value)
        else:
            table[value] = chr(256 + extra)
            extra += 1
    return table


def gpt2_vocab_and_merges(ranks_path: Path, work: Path) -> tuple[Path, Path, Path]:
    """vocab.json, merges.txt and tokenizer.json of the ranks (merge of token t: the two pieces
    BPE makes of t with the ranks below t's)."""
    vocab_path, merges_path, json_path = (
        work / "gpt2-vocab.json",
        work / "gpt2-merges.txt",
        work / "gpt2-tokenizer.json",
    )
    if json_path.exists():
        return vocab_path, merges_path, json_path
    ranks = {}
    for line in ranks_path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    alphabet = byte_level_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(
                (ranks.get(parts[i] + parts[i + 1], 1 << 30), i) for i in range(len(parts) - 1)
            )
            if best[0] >= rank:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        merges.append(f"{spell(parts[0])} {spell(parts[1])}")
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab["<|endoftext|>"] = len(ranks)
    vocab_path.write_text(json.dumps(vocab), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(json_path))
    return vocab_path, merges_path, json_path


# Each row runs this in a fresh interpreter; it prints one JSON line.
ROW = textwrap.dedent(
    """
    import json, resource, sys, time
    what, threads, corpus, ranks, hf_json, out = sys.argv[1:7]
    threads = int(threads)
    texts = None
    # imports and in-memory inputs come before the clock starts: the time is the tokenizer's
    # loading and the work
    if what in ("tiktoken", "hf"):
        texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    if what == "gigatoken":
        import gigatoken
    elif what == "tiktoken":
        import tiktoken, tiktoken.load
    elif what == "hf":
        from tokenizers import Tokenizer
    else:
        import gigatoken
        from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
        from tokenmill.tokenize.tokenizers import TokenizerSpec
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    tokens = None
    if what == "gigatoken":
        tok = gigatoken.Tokenizer.from_tiktoken(ranks, pretokenizer="gpt2", special_tokens={})
        result = tok.encode_files(gigatoken.JsonlFileSource([corpus]), parallel=threads > 1)
        tokens = int(result.layout.content.data.shape[0])
    elif what == "tiktoken":
        PATTERN = sys.argv[7]
        enc = tiktoken.Encoding("gpt2", pat_str=PATTERN, special_tokens={"<|endoftext|>": 50256},
                                mergeable_ranks=tiktoken.load.load_tiktoken_bpe(ranks))
        tokens = sum(map(len, enc.encode_ordinary_batch(texts, num_threads=threads)))
    elif what == "hf":
        tok = Tokenizer.from_file(hf_json)
        tok.encode_special_tokens = True
        tokens = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
    else:
        backend, output_format = what.split("-")
        result = tokenize(TokenizeConfig(
            inputs=(corpus,), output_prefix=out, progress=False, workers=threads,
            tokenizer=TokenizerSpec("tiktoken", ranks, backend=backend),
            prepend_bos=output_format == "nanogpt", output_format=output_format))
        tokens = result.tokens
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    print(json.dumps({"seconds": seconds, "cpu": cpu, "tokens": tokens,
                      "rss_mb": after.ru_maxrss / 1024}))
    """
)


def run_row(
    what: str, threads: int, corpus: Path, ranks: Path, hf_json: Path, out: Path
) -> dict[str, float]:
    environment = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    if what == "hf":
        environment["RAYON_RS_NUM_CPUS"] = str(threads)
        environment["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    result = subprocess.run(
        [sys.executable, "-c", ROW, what, str(threads), str(corpus), str(ranks), str(hf_json),
         str(out), GPT2_PATTERN],
        capture_output=True, text=True, env=environment, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"row {what} failed:\n{result.stderr}")
    row: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return row


def hf_tokenizer_directory(work: Path, hf_json: Path) -> Path:
    """What Megatron's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` loads
    (transformers' AutoTokenizer, no hub): the tokenizer.json and a tokenizer_config.json."""
    tokenizer_dir = work / "gpt2-hf-tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    shutil.copyfile(hf_json, tokenizer_dir / "tokenizer.json")
    special = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2TokenizerFast", "model_max_length": 10**9}
    config |= {"eos_token": special, "bos_token": special, "unk_token": special}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tokenizer_dir


def run_megatron(
    args: argparse.Namespace, threads: int, corpus: Path, hf_json: Path, ranks: Path
) -> dict[str, float] | str:
    """Megatron-LM's tools/preprocess_data.py, or why it does not run.

    Its GPT2BPETokenizer path asks the Hugging Face hub for gpt2's configuration (offline here),
    so the script runs with ``--tokenizer-type HuggingFaceTokenizer`` on a local directory
    holding the same tokenizer.json (transformers loads it without the hub). Its output is
    checked token-identical to tiktoken's ids like tokenmill's.
    """
    if args.megatron_lm is None:
        return "not run: pass --megatron-lm DIR (a Megatron-LM checkout; nothing is vendored)"
    script = args.megatron_lm / "tools" / "preprocess_data.py"
    if not script.exists():
        return f"not run: {script} does not exist"
    tokenizer_dir = hf_tokenizer_directory(args.work_dir, hf_json)
    prefix = args.work_dir / "megatron-lm-out"
    command = [
        args.megatron_python or sys.executable, "-c",
        # Megatron-LM main imports typing.override (Python 3.12); on 3.11 typing_extensions'
        # identical decorator stands in, so the script runs unchanged on this machine's torch.
        "import typing, typing_extensions; "
        "typing.override = getattr(typing, 'override', typing_extensions.override); "
        "import resource, runpy, sys, time; started = time.perf_counter(); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "usage = resource.getrusage(resource.RUSAGE_SELF); "
        "children = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print('BENCH', time.perf_counter() - started, usage.ru_utime + usage.ru_stime + "
        "children.ru_utime + children.ru_stime, max(usage.ru_maxrss, children.ru_maxrss))",
        str(script), "--input", str(corpus), "--output-prefix", str(prefix),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir),
        "--append-eod", "--workers", str(threads),
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(args.megatron_lm), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH")]
    if result.returncode != 0 or not lines:
        error = (result.stderr.strip().splitlines() or ["no output"])[-1]
        interpreter = subprocess.run(
            [command[0], "-c", "import sys; print(sys.version.split()[0])"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        hint = "; it needs torch and transformers" if "No module" in error else ""
        return f"does not run with Python {interpreter}: {error}{hint}"
    check_tokens(Path(f"{prefix}_text_document"), corpus, ranks)
    _, seconds, cpu, rss = lines[-1].split()
    return {"seconds": float(seconds), "cpu": float(cpu), "rss_mb": float(rss) / 1024}


def check_tokens(prefix: Path, corpus: Path, ranks: Path, limit: int = 300) -> None:
    """The first documents of a tokenmill output equal tiktoken's ids (+ EOD)."""
    import numpy as np
    import tiktoken
    import tiktoken.load

    from tokenmill.formats.megatron import IndexedDataset

    encoding = tiktoken.Encoding(
        "gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(ranks)),
        special_tokens={"<|endoftext|>": 50256},
    )
    dataset = IndexedDataset(str(prefix))
    with open(corpus, encoding="utf-8") as stream:
        for index, line in zip(range(limit), stream):
            expected = [*encoding.encode_ordinary(json.loads(line)["text"]), 50256]
            if not np.array_equal(dataset[index], np.asarray(expected)):
                sys.exit(f"{prefix}: document {index} differs from tiktoken's ids")


def print_row(
    name: str, row: dict[str, float] | str, text_bytes: int, tokens: int, base: float
) -> None:
    if isinstance(row, str):
        print(f"| {name:<44} | {row}")
        return
    seconds = row["seconds"]
    print(
        f"| {name:<44} | {seconds:7.2f} | {row['cpu']:6.2f} | {text_bytes / seconds / 1e6:7.1f} | "
        f"{tokens / seconds / 1e6:7.2f} | {row['rss_mb']:7.0f} | {base / seconds:5.2f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3, help="best of N (alternating) runs")
    parser.add_argument("--work-dir", type=Path, default=Path("bench-tokenize-work"))
    parser.add_argument("--tiktoken", type=Path, help="a local gpt2.tiktoken (else downloaded)")
    parser.add_argument("--big-gb", type=float, default=1.0, help="memory row input (0: skip)")
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout")
    parser.add_argument("--megatron-python", help="the interpreter for Megatron-LM's script")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(args.work_dir)
    ranks = args.tiktoken or fetch_gpt2(args.work_dir)
    _, _, hf_json = gpt2_vocab_and_merges(ranks, args.work_dir)
    with open(corpus, encoding="utf-8") as stream:
        text_bytes = sum(len(json.loads(line)["text"].encode("utf-8")) for line in stream)
    import gigatoken  # noqa: F401  (the benchmark needs it)

    from tokenmill.tokenize.tokenizers import package_version

    versions = ", ".join(
        f"{name} {package_version(name)}" for name in ("gigatoken", "tiktoken", "tokenizers")
    )
    print(
        f"corpus {corpus}: {text_bytes / 1e6:.1f} MB of text; GPT-2 BPE ({ranks.name}); "
        f"{versions}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    rows = [
        ("gigatoken", "gigatoken encode_files (jsonl, ids in memory)"),
        ("gigatoken-megatron", "tokenmill gigatoken -> .bin/.idx"),
        ("gigatoken-nanogpt", "tokenmill gigatoken -> nanogpt .bin/.bos.idx"),
        ("reference-megatron", "tokenmill tiktoken -> .bin/.idx"),
        ("tiktoken", "tiktoken encode_ordinary_batch (in memory)"),
        ("hf", "HF tokenizers encode_batch_fast (in memory)"),
    ]
    header = f"| {'what':<44} | {'time s':>7} | {'cpu s':>6} | {'MB/s':>7} | {'M tok/s':>7} | {'RSS MB':>7} | {'ratio':>5} |"
    for threads in args.threads:
        print(f"\n{threads} thread(s), best of {args.repeat}:\n{header}")
        print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
        best: dict[str, dict[str, float]] = {}
        for repeat in range(args.repeat):
            for what, _name in rows:
                if what == "hf" and repeat:
                    continue  # 50x slower than the rest: one run says enough
                out = args.work_dir / f"out-{what}"
                row = run_row(what, threads, corpus, ranks, hf_json, out)
                if what not in best or row["seconds"] < best[what]["seconds"]:
                    best[what] = row
        check_tokens(args.work_dir / "out-gigatoken-megatron", corpus, ranks)
        check_tokens(args.work_dir / "out-reference-megatron", corpus, ranks)
        tokens = int(best["tiktoken"]["tokens"])
        base = best["gigatoken"]["seconds"]
        for what, name in rows:
            print_row(name, best[what], text_bytes, tokens, base)
        megatron = run_megatron(args, threads, corpus, hf_json, ranks)
        print_row("Megatron-LM tools/preprocess_data.py", megatron, text_bytes, tokens, base)
    if args.big_gb > 0:
        memory_row(args, corpus, ranks, hf_json, text_bytes)
    print(
        "\nratio = gigatoken encode_files' time / this row's time (target for tokenmill + "
        "gigatoken: >= 0.90); the first 300 documents of each tokenmill output were checked "
        "identical to tiktoken's ids"
    )
    return 0


def memory_row(
    args: argparse.Namespace, corpus: Path, ranks: Path, hf_json: Path, text_bytes: int
) -> None:
    """Peak RSS on a >= big_gb GB input (the corpus repeated), tokenmill vs encode_files."""
    data = corpus.read_bytes()
    copies = max(1, int(args.big_gb * 1e9 / len(data)) + 1)
    threads = max(args.threads)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as directory:
        big = Path(directory) / "big.jsonl"
        with open(big, "wb") as stream:
            for _ in range(copies):
                stream.write(data)
        size = big.stat().st_size
        print(
            f"\nmemory: {big.name}, {size / 1e9:.2f} GB (the corpus x {copies}), {threads} thread(s):"
        )
        print(
            f"| {'what':<48} | {'time s':>7} | {'cpu s':>6} | {'MB/s':>7} | {'RSS MB':>7} | "
            f"{'ratio':>5} |"
        )
        print(f"|{'-' * 50}|{'-' * 9}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 7}|")
        measured = {}
        for what in ("gigatoken", "gigatoken-megatron", "gigatoken", "gigatoken-megatron"):
            row = run_row(what, threads, big, ranks, hf_json, Path(directory) / "out")
            if what not in measured or row["seconds"] < measured[what]["seconds"]:
                measured[what] = row
        base = measured["gigatoken"]["seconds"]
        for what, name in (
            ("gigatoken", "gigatoken encode_files (ids in memory)"),
            ("gigatoken-megatron", "tokenmill gigatoken -> .bin/.idx (1 GiB budget)"),
        ):
            row = measured[what]
            megabytes = text_bytes * copies / row["seconds"] / 1e6
            print(
                f"| {name:<48} | {row['seconds']:7.2f} | {row['cpu']:6.2f} | {megabytes:7.1f} | "
                f"{row['rss_mb']:7.0f} | {base / row['seconds']:5.2f} |"
            )
    # the temporary directory (input and output) is deleted here


if __name__ == "__main__":
    from evidence import recorded

    with recorded("tokenize"):
        status = main()
    sys.exit(status)
