"""Real-size check of the nanogpt shard cap: a 2.2 GB uint16 token stream converted to nanogpt
shards with `tokenmill convert`, every shard read back with modded-nanogpt's loading method (one
unbuffered `readinto` of the whole payload, which on Linux returns at most 2^31 - 4096 bytes) and
compared token by token with the stream.

Runs twice: with the default shard size (10^8 tokens, fineweb's) and with `--shard-tokens` at the
cap (1,073,739,776 tokens: a 2,147,479,552-byte payload, the most one read returns). Needs about
4.5 GB of free disk (the stream plus one conversion at a time) and a 2 GiB buffer; everything is
deleted afterwards. tests/test_interop_peers.py covers the same at small sizes and with a sparse
shard at the cap; this script is the by-hand, real-data check.

    nice python scripts/check_nanogpt_shard_cap.py [--tokens 1100000000] [--directory /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from tokenmill.formats.nanogpt import HEADER_BYTES, LEGACY_MAGIC, max_shard_tokens

CHUNK = 1 << 26  # tokens generated / compared at a time


def generate(path: str, count: int) -> None:
    """Tokens below GPT-2's 50257 ids, a different value at nearly every position."""
    with open(path, "wb") as stream:
        for start in range(0, count, CHUNK):
            index = np.arange(start, min(count, start + CHUNK), dtype=np.uint64)
            stream.write(((index * np.uint64(2654435761)) % np.uint64(50257)).astype("<u2"))


def load_like_modded_nanogpt(path: str, buffer: np.ndarray) -> np.ndarray:
    """modded-nanogpt's method: header checks, then ONE unbuffered readinto of the payload."""
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != LEGACY_MAGIC or header[1] != 1:
        raise SystemExit(f"{path}: magic {header[0]} version {header[1]}")
    count = int(header[2])
    tokens = buffer[:count]
    with open(path, "rb", buffering=0) as stream:
        stream.seek(HEADER_BYTES)
        read = stream.readinto(memoryview(tokens).cast("B"))
    if read != 2 * count:
        raise SystemExit(f"{path}: one readinto returned {read} of {2 * count} bytes")
    return tokens


def check(stream_path: str, out: str, count: int, shard_tokens: int | None) -> list[int]:
    command = ["tokenmill", "convert", stream_path, out, "--to", "nanogpt", "--dtype", "uint16", "-q"]  # fmt: skip
    if shard_tokens is not None:
        command += ["--shard-tokens", str(shard_tokens)]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    print(f"  {' '.join(command[1:])}: {time.perf_counter() - started:.1f} s", flush=True)
    stream = np.memmap(stream_path, dtype="<u2", mode="r")
    buffer = np.empty(max_shard_tokens(np.uint16), dtype=np.uint16)
    sizes, offset = [], 0
    for name in sorted(os.listdir(out)):
        if not name.endswith(".bin"):
            continue
        tokens = load_like_modded_nanogpt(os.path.join(out, name), buffer)
        for start in range(0, tokens.shape[0], CHUNK):
            end = min(tokens.shape[0], start + CHUNK)
            if not np.array_equal(tokens[start:end], stream[offset + start : offset + end]):
                raise SystemExit(f"{name}: tokens differ from the stream near {offset + start}")
        offset += tokens.shape[0]
        sizes.append(int(tokens.shape[0]))
    if offset != count:
        raise SystemExit(f"shards hold {offset} tokens, the stream {count}")
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_100_000_000, help="2.2 GB of uint16")
    parser.add_argument("--directory", default=tempfile.gettempdir())
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tokenmill-shard-cap-", dir=args.directory)
    try:
        stream_path = os.path.join(work, "stream.bin")
        generate(stream_path, args.tokens)
        print(f"stream: {args.tokens:,} uint16 tokens, {os.path.getsize(stream_path):,} bytes")
        for shard_tokens in (None, max_shard_tokens(np.uint16)):
            out = os.path.join(work, "shards")
            sizes = check(stream_path, out, args.tokens, shard_tokens)
            largest = max(sizes)
            print(
                f"  {len(sizes)} shards, largest {largest:,} tokens ({2 * largest:,} payload "
                "bytes): every shard read whole by one readinto and equal to the stream"
            )
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
