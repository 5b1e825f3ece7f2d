"""Train a tiny GPT on tokenmill's packed rows, stop mid-epoch, resume on another topology.

What it shows, on a CPU in well under a minute at the default size:

1. The embedded demo corpus (the Jargon File, shipped in the package) is tokenized with the
   built-in byte tokenizer into a Megatron ``.bin/.idx`` by the tokenize pipeline.
2. ``PackedDataset`` packs whole documents into rows of ``--sequence-length`` tokens with
   ``doc_ids`` and labels masked at document ends; the model's attention is causal *within*
   each document only (a block-diagonal mask built from ``doc_ids``), as with varlen
   FlashAttention or FlexAttention's ``document_block_mask`` on a GPU.
3. A small pure-PyTorch GPT trains ``--steps`` steps with a global batch of ``--batch-size``
   rows, fetched by a ``ThreadedBatchLoader`` with no worker threads in one batch per step.
4. A second run stops at ``--stop-at``, saves a checkpoint (model, optimizer and the loader's
   position), and resumes from it in a fresh model with a *different loader topology*: two
   worker threads, and each global batch split into two loader batches of half the size. The
   resumed loss curve must equal the uninterrupted one step for step (bit for bit: the CPU run
   is deterministic and the loader position is exact).

Run: ``python examples/train_tiny_gpt.py --plot docs/img/train_tiny_gpt.png`` (matplotlib for
the plot). ``tests/test_examples.py`` runs it at a small size and checks the exit status, which
is non-zero when the curves differ.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import IndexedDataset, PackedDataset, PackingConfig
from tokenmill.cli.demo import load_corpus
from tokenmill.loading.threaded import ThreadedBatchLoader
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize
from tokenmill.tokenize.tokenizers import ByteTokenizer


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, length: int, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        doc_ids = batch["doc_ids"]
        length = doc_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        # attend only to earlier tokens of the same document: the document mask of packed rows
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
        x = self.tokens(batch["input_ids"]) + self.positions(batch["position_ids"])
        for block in self.blocks:
            x = block(x, mask[:, None])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def prepare_corpus(directory: Path, documents: int | None) -> str:
    """The demo corpus as a Megatron .bin/.idx (byte tokenizer, one EOD per document)."""
    source = directory / "jargon.jsonl"
    with source.open("w", encoding="utf-8") as stream:
        for entry in load_corpus(documents):
            stream.write(json.dumps({"text": entry["text"]}) + "\n")
    prefix = str(directory / "jargon")
    tokenize(TokenizeConfig(inputs=(str(source),), output_prefix=prefix, progress=False))
    return prefix


def global_batches(loader: ThreadedBatchLoader, rows: int) -> Iterator[dict[str, torch.Tensor]]:
    """Global batches of `rows` rows, concatenated from the loader's (smaller) batches."""
    pending: list[dict[str, torch.Tensor]] = []
    count = 0
    for batch in loader:
        pending.append(batch)
        count += batch["input_ids"].shape[0]
        if count == rows:
            yield {key: torch.cat([b[key] for b in pending]) for key in pending[0]}
            pending, count = [], 0


class Trainer:
    """One training run: the model, its optimizer and the loader position, all checkpointable."""

    def __init__(self, dataset: PackedDataset, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.dataset = dataset
        self.args = args
        self.model = TinyGPT(ByteTokenizer().vocab_size, args.sequence_length)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.rows_consumed = 0
        self.loading_seconds = 0.0
        self.training_seconds = 0.0

    def train(self, steps: int, loader_batch: int, workers: int) -> list[float]:
        """Train `steps` steps from the current position with the given loader topology."""
        loader = ThreadedBatchLoader(
            self.dataset,
            loader_batch,
            num_workers=workers,
            shuffle=True,
            seed=self.args.seed,
            drop_last=True,
        )
        # The loader's position is counted in its own batches: convert the exact row count.
        loader.load_state_dict({"epoch": 0, "batches_yielded": self.rows_consumed // loader_batch})
        batches = global_batches(loader, self.args.batch_size)
        losses = []
        for _ in range(steps):
            start = time.perf_counter()
            batch = next(batches)
            loaded = time.perf_counter()
            loss = self.model(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.loading_seconds += loaded - start
            self.training_seconds += time.perf_counter() - loaded
            self.rows_consumed += self.args.batch_size
            losses.append(loss.item())
        return losses

    def checkpoint(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rows_consumed": self.rows_consumed,
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.rows_consumed = checkpoint["rows_consumed"]


def plot(path: str, uninterrupted: list[float], resumed: list[float], stop_at: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.plot(range(1, len(uninterrupted) + 1), uninterrupted, label="uninterrupted", lw=2.5)
    axes.plot(range(1, len(resumed) + 1), resumed, "--", label="stopped and resumed", lw=1.2)
    axes.axvline(stop_at, color="grey", lw=0.8, ls=":")
    axes.text(
        stop_at,
        max(uninterrupted),
        " checkpoint: resume with 2 workers, 2 x half batches",
        fontsize=8,
        va="top",
    )
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title("tiny GPT on tokenmill packed rows (CPU)")
    axes.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stop-at", type=int, default=None, help="default: steps / 2")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, in rows")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--documents", type=int, default=None, help="demo documents (all)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--plot", default=None, help="write the two loss curves to this PNG")
    args = parser.parse_args(argv)
    stop_at = args.stop_at if args.stop_at is not None else args.steps // 2
    if not 0 < stop_at < args.steps or args.batch_size % 2:
        parser.error("need 0 < --stop-at < --steps and an even --batch-size")

    # Bit-exact CPU training: one thread, deterministic kernels.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    with tempfile.TemporaryDirectory() as tmp:
        prefix = prepare_corpus(Path(tmp), args.documents)
        config = PackingConfig(
            sequence_length=args.sequence_length, seed=args.seed, max_documents_per_row=32
        )
        dataset = PackedDataset(IndexedDataset(prefix), config)
        needed = args.steps * args.batch_size
        if needed > len(dataset):
            parser.error(
                f"{needed} rows needed, the corpus packs into {len(dataset)}: "
                "fewer --steps or a shorter --batch-size"
            )
        print(
            f"{len(dataset):,} packed rows of {args.sequence_length} tokens; "
            f"padding {dataset.stats()['padding_fraction']:.2%}"
        )

        baseline = Trainer(dataset, args)
        uninterrupted = baseline.train(args.steps, loader_batch=args.batch_size, workers=0)

        first = Trainer(dataset, args)
        resumed = first.train(stop_at, loader_batch=args.batch_size, workers=0)
        checkpoint_path = Path(tmp) / "checkpoint.pt"
        torch.save(first.checkpoint(), checkpoint_path)
        second = Trainer(dataset, args)  # a fresh process would start here
        second.restore(torch.load(checkpoint_path))
        resumed += second.train(args.steps - stop_at, loader_batch=args.batch_size // 2, workers=2)

    tokens = needed * args.sequence_length
    print(f"loss: step 1 {uninterrupted[0]:.3f} -> step {args.steps} {uninterrupted[-1]:.3f}")
    print(
        f"tokens/s: training {tokens / baseline.training_seconds:,.0f}, "
        f"loading {tokens / max(baseline.loading_seconds, 1e-9):,.0f}"
    )
    if args.plot:
        plot(args.plot, uninterrupted, resumed, stop_at)
    mismatches = [i + 1 for i, (a, b) in enumerate(zip(uninterrupted, resumed)) if a != b]
    if mismatches or len(resumed) != len(uninterrupted) or not all(map(math.isfinite, resumed)):
        print(f"FAIL: the resumed curve differs at steps {mismatches[:10]}", file=sys.stderr)
        return 1
    print(
        f"resumed at step {stop_at} with 2 workers and half batches: "
        f"all {args.steps} losses identical to the uninterrupted run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
