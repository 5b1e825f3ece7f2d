"""Train on shards in an S3 bucket through tokenmill's chunk cache, no local copy of the data.

1. The embedded demo corpus is tokenized straight to ``s3://<bucket>/jargon`` (``.bin/.idx``
   staged locally, uploaded). With no ``AWS_ENDPOINT_URL`` configured, the bucket lives on a
   local S3-compatible server (moto, from the ``test`` extra) started by this script.
2. A ``GPTDataset`` over ``s3://<bucket>/jargon`` is built by ``BlendedMegatronDatasetBuilder``
   with megatron's ``object_storage_cache_path`` field: the ``.idx`` is downloaded once, the
   ``.bin`` is read with ranged GETs through an LRU of aligned chunks, prefetched along the
   shuffle order.
3. A tiny GPT (``train_tiny_gpt.TinyGPT``) trains ``--steps`` steps on those samples; every
   batch is checked against the same samples read from a local copy of the shard, and the run
   prints what went over the network.

Run: ``python examples/stream_from_s3.py`` (needs ``pip install 'tokenmill[s3]' moto[server]``,
both in the ``test`` extra). With a real bucket: set ``AWS_ENDPOINT_URL`` (if not AWS),
credentials, and ``--bucket``. ``tests/test_examples.py`` runs it at a small size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_gpt import TinyGPT

from tokenmill import BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig
from tokenmill.cli.demo import load_corpus
from tokenmill.storage.object_storage import ObjectStorageConfig
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
from tokenmill.tokenize.tokenizers import ByteTokenizer


class Tokenizer:
    """What megatron's dataset config reads of a tokenizer (the byte tokenizer's vocabulary)."""

    vocab_size = ByteTokenizer().vocab_size
    eod = ByteTokenizer.EOD
    unique_identifiers: ClassVar[dict[str, object]] = {
        "class": "ByteTokenizer",
        "vocab_size": vocab_size,
    }


def start_local_s3() -> object:
    """A moto S3 server on loopback, with throwaway credentials, for runs with no endpoint."""
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    return server


def datasets(prefix: str, args: argparse.Namespace, cache: Path, object_cache: Path | None):
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.sequence_length,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=Tokenizer(),
        path_to_cache=str(cache),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        object_storage_cache_path=(
            ObjectStorageConfig(
                str(object_cache), bin_chunk_nbytes=64 << 10, bin_cache_nbytes=4 << 20
            )
            if object_cache
            else None
        ),
    )
    samples = args.steps * args.batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [samples, None, None], lambda: True, config
    ).build()
    return train


def as_model_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
    return {
        "input_ids": batch["tokens"],
        "labels": labels,
        "position_ids": batch["position_ids"],
        "doc_ids": torch.zeros_like(batch["tokens"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", default="tokenmill-example")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--documents", type=int, default=None, help="demo documents (all)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    server = None if os.environ.get("AWS_ENDPOINT_URL") else start_local_s3()
    try:
        import boto3

        s3 = boto3.client("s3")
        if server is not None:
            s3.create_bucket(Bucket=args.bucket)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            text = work / "jargon.jsonl"
            text.write_text(
                "".join(
                    json.dumps({"text": e["text"]}) + "\n" for e in load_corpus(args.documents)
                ),
                "utf-8",
            )
            remote = f"s3://{args.bucket}/jargon"
            tokenize(TokenizeConfig(inputs=(str(text),), output_prefix=remote, progress=False))
            local = str(work / "local")  # the same shard on local disk, to check every batch
            tokenize(TokenizeConfig(inputs=(str(text),), output_prefix=local, progress=False))

            streamed = datasets(remote, args, work / "cache-s3", work / "object-cache")
            reference = datasets(local, args, work / "cache-local", None)
            model = TinyGPT(Tokenizer.vocab_size, args.sequence_length + 1)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            started = time.perf_counter()
            losses = []
            for step in range(args.steps):
                indices = list(range(step * args.batch_size, (step + 1) * args.batch_size))
                batch = streamed.get_batch(indices)
                expected = reference.get_batch(indices)
                for key in ("tokens", "labels", "loss_mask", "position_ids"):
                    if not torch.equal(batch[key], expected[key]):
                        print(
                            f"FAIL: step {step} {key} differs from the local read", file=sys.stderr
                        )
                        return 1
                loss = model(as_model_batch(batch))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            seconds = time.perf_counter() - started
            on_disk = sum(
                f.stat().st_size for f in (work / "object-cache").rglob("*") if f.is_file()
            )
    finally:
        if server is not None:
            server.stop()
    tokens = args.steps * args.batch_size * args.sequence_length
    print(
        f"{args.steps} steps from {remote}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{tokens / seconds:,.0f} tokens/s (loading + training); the .idx cached locally "
        f"({on_disk:,} bytes), the .bin read by ranged GETs through the chunk cache"
    )
    print("every batch identical to the same samples read from a local copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
