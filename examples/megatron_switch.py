"""Megatron's own data path, unchanged, on tokenmill: one line, the same batches, faster.

Two fresh processes run what Megatron-LM's ``pretrain_gpt.py`` runs to feed a trainer: the
``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` of ``megatron.core.datasets`` and
``megatron.training``'s ``build_pretraining_data_loader`` (a torch DataLoader with worker
processes and the default collate), both from the megatron-core wheel. The second process first
calls ``tokenmill.patch_megatron()`` and changes nothing else. Each prints a digest of every
batch it served and its samples/s; this script checks that the digests are identical and prints
the speed-up.

Run: ``python examples/megatron_switch.py`` (needs megatron-core:
``pip install --no-deps --ignore-requires-python megatron-core==0.19.2 && pip install triton``).
``tests/test_examples.py`` runs it at a small size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import typing
import warnings
from typing import Any

_VOCAB = 50_000


def feed(args: argparse.Namespace) -> None:
    """One library's run (a fresh process): prints one JSON line."""
    if args.library == "tokenmill":
        import tokenmill

        tokenmill.patch_megatron()  # <- the switch: nothing below changes
    warnings.simplefilter("ignore")
    if not hasattr(typing, "override"):  # megatron.training uses Python 3.12's typing.override
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    import torch
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.global_vars import set_args

    class Tokenizer:  # what Megatron's datasets read of a tokenizer
        vocab_size = _VOCAB
        eod = 0
        unique_identifiers: typing.ClassVar[dict[str, Any]] = {"class": "Example", "vocab": _VOCAB}

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.sequence_length,
        blend=([args.prefix], None),
        split="99,1,0",
        path_to_cache=os.path.join(args.workdir, f"cache-{args.library}"),
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    samples = args.batches * args.batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [samples, 10, None], lambda: True, config
    ).build()
    set_args(  # the fields of Megatron's argument namespace its loader reads
        types.SimpleNamespace(
            dataloader_type="single",
            micro_batch_size=args.batch_size,
            global_batch_size=args.batch_size,
            full_validation=False,
            hybrid_context_parallel=False,
            num_workers=args.workers,
            exit_signal_handler=False,
            data_sharding=True,
        )
    )
    parallel_state.set_data_parallel_rank(0)
    parallel_state._MPU_DATA_PARALLEL_WORLD_SIZE = 1  # a single process, no process group
    loader = build_pretraining_data_loader(train, consumed_samples=0)
    digest = hashlib.sha256()
    started = time.perf_counter()
    served = 0
    for batch in loader:
        for key in sorted(batch):
            value: torch.Tensor = batch[key]
            digest.update(key.encode() + str(value.dtype).encode() + value.numpy().tobytes())
        served += int(batch["tokens"].shape[0])
        if served >= samples:
            break
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "dataset": type(train).__module__,
                "digest": digest.hexdigest(),
                "samples": served,
                "samples_per_second": served / seconds,
            }
        )
    )


def make_corpus(prefix: str, tokens: int) -> None:
    """A random uint16 corpus in documents of 100-4000 tokens."""
    import numpy as np

    from tokenmill import IndexedDatasetBuilder

    rng = np.random.default_rng(1234)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        length = int(rng.integers(100, 4000))
        builder.add_document(rng.integers(1, _VOCAB, length, dtype=np.uint16), lengths=[length])
        written += length
    builder.finalize(prefix + ".idx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--library", choices=["megatron-core", "tokenmill"], help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.library:
        feed(args)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        prefix = os.path.join(workdir, "corpus")
        make_corpus(prefix, args.tokens)
        results = {}
        for library in ("megatron-core", "tokenmill"):
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--library",
                library,
                "--prefix",
                prefix,
                "--workdir",
                workdir,
                "--sequence-length",
                str(args.sequence_length),
                "--batch-size",
                str(args.batch_size),
                "--batches",
                str(args.batches),
                "--workers",
                str(args.workers),
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[library] = json.loads(output.strip().splitlines()[-1])
            print(
                f"{library:>13}: {results[library]['samples_per_second']:>8,.0f} samples/s "
                f"({results[library]['dataset']})"
            )
    stock, switched = results["megatron-core"], results["tokenmill"]
    if not switched["dataset"].startswith("tokenmill") or stock["dataset"].startswith("tokenmill"):
        print("FAIL: the switch did not take effect", file=sys.stderr)
        return 1
    if stock["digest"] != switched["digest"] or stock["samples"] != switched["samples"]:
        print("FAIL: the batches differ from megatron-core's", file=sys.stderr)
        return 1
    speedup = switched["samples_per_second"] / stock["samples_per_second"]
    print(
        f"all {stock['samples']:,} samples identical to megatron-core's; "
        f"tokenmill serves them {speedup:.1f}x as fast through Megatron's own loader"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
