"""A two-phase curriculum under torchdata's StatefulDataLoader, stopped and resumed elsewhere.

1. Two sources are tokenized from the embedded demo corpus (the Jargon File, byte tokenizer):
   ``prose`` (entries of the first half) and ``glossary`` (the second half).
2. A mixture config describes a curriculum: a ``main`` phase at 80/20 and an ``anneal`` phase at
   30/70, by tokens. ``tokenmill validate`` checks its demand against the sources (and with
   ``--plot`` draws the plan).
3. Two ranks (simulated in this process, each a ``World``) read the first ``--stop-at`` steps
   through ``torchdata.stateful_dataloader.StatefulDataLoader`` with 2 worker processes; each
   batch carries the global mixture state after its step.
4. The run stops, and resumes from that state on another topology: 1 rank, no workers, a
   different sequence length and batch size (``MixtureLoader``). The tokens of the stopped and
   the resumed runs, concatenated, must equal the tokens of one uninterrupted stream, and each
   phase's source shares are printed.

Run: ``python examples/mixture_curriculum.py --plot plan.png`` (torchdata; matplotlib for the
plot). ``tests/test_examples.py`` runs it at a small size; it exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenmill import Mixture, MixtureLoader, World
from tokenmill.cli.demo import load_corpus
from tokenmill.loading.mixture import MixtureDataset
from tokenmill.tokenize.pipeline import TokenizeConfig, tokenize

CURRICULUM = """
seed = 1234
chunk_tokens = 256
exhaustion = "halt"
[sources]
prose = "{directory}/prose"
glossary = "{directory}/glossary"
[[phases]]
name = "main"
tokens = {main_tokens}
weights = {{ prose = 0.8, glossary = 0.2 }}
[[phases]]
name = "anneal"
tokens = {anneal_tokens}
weights = {{ prose = 0.3, glossary = 0.7 }}
"""


def make_sources(directory: Path, documents: int | None) -> None:
    entries = load_corpus(documents)
    half = len(entries) // 2
    for name, part in (("prose", entries[:half]), ("glossary", entries[half:])):
        text = directory / f"{name}.jsonl"
        text.write_text("".join(json.dumps({"text": e["text"]}) + "\n" for e in part), "utf-8")
        tokenize(
            TokenizeConfig(inputs=(str(text),), output_prefix=str(directory / name), progress=False)
        )


def stream_tokens(loader: MixtureLoader, steps: int) -> list[torch.Tensor]:
    return [batch["tokens"].flatten() for _, batch in zip(range(steps), loader)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main-tokens", type=int, default=400_000)
    parser.add_argument("--anneal-tokens", type=int, default=200_000)
    parser.add_argument("--stop-at", type=int, default=40, help="steps before the stop")
    parser.add_argument("--documents", type=int, default=None, help="demo documents (all)")
    parser.add_argument("--plot", default=None, help="tokenmill validate --plot PNG")
    args = parser.parse_args(argv)
    from torchdata.stateful_dataloader import StatefulDataLoader

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        make_sources(directory, args.documents)
        config = directory / "curriculum.toml"
        config.write_text(
            CURRICULUM.format(
                directory=directory, main_tokens=args.main_tokens, anneal_tokens=args.anneal_tokens
            )
        )
        command = [sys.executable, "-m", "tokenmill.cli.main", "validate", str(config)]
        if args.plot:
            command += ["--plot", str(Path(args.plot).resolve())]
        validated = subprocess.run(command, capture_output=True, text=True)
        print(validated.stdout.rstrip())
        if validated.returncode != 0:
            print(validated.stderr, file=sys.stderr)
            return 1
        mixture = Mixture(str(config))

        # Before the stop: 2 ranks x 2 StatefulDataLoader workers, S=512, 8 samples per step.
        sequence, batch = 512, 8
        stopped: list[list[dict[str, torch.Tensor]]] = [[], []]
        state = None
        for rank in range(2):
            dataset = MixtureDataset(mixture, sequence, batch, world=World(rank=rank, world_size=2))
            loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
            for _, item in zip(range(args.stop_at), loader):
                stopped[rank].append(item)
                state = item["mixture_state"]  # the global state after this step (same on ranks)
        before = [
            {
                key: torch.cat([stopped[0][s][key], stopped[1][s][key]]).flatten()
                for key in ("tokens", "source_ids")
            }
            for s in range(args.stop_at)
        ]

        # After: 1 rank, no workers, S=300, 3 samples per step, until the curriculum ends.
        resumed = MixtureLoader(
            mixture, sequence_length=300, global_batch_size=3, num_workers=0, world=World()
        )
        resumed.load_state_dict(state)
        after = [{key: item[key].flatten() for key in ("tokens", "source_ids")} for item in resumed]

        # The reference: one uninterrupted stream of the same total length, another topology.
        combined = torch.cat([step["tokens"] for step in before + after])
        sources = torch.cat([step["source_ids"] for step in before + after])
        reference = MixtureLoader(
            mixture,
            sequence_length=len(combined),
            global_batch_size=1,
            num_workers=0,
            world=World(),
        )
        uninterrupted = next(iter(reference))["tokens"].flatten()
    print(
        f"stopped after {args.stop_at} steps (2 ranks x 2 workers, S={sequence}), resumed on "
        f"1 rank (S=300): {len(combined):,} tokens in all"
    )
    names = [source.name for source in mixture.sources]
    for phase, part in (
        ("main", sources[: args.main_tokens]),
        ("anneal", sources[args.main_tokens :]),
    ):
        counts = torch.bincount(part.long(), minlength=len(names))
        shares = ", ".join(
            f"{n} {c / max(len(part), 1):.0%}" for n, c in zip(names, counts.tolist())
        )
        print(f"  {phase}: {shares} of {len(part):,} tokens")
    if not torch.equal(combined, uninterrupted):
        mismatch = int(np.argmax((combined != uninterrupted).numpy()))
        print(
            f"FAIL: the resumed stream differs from the uninterrupted one at token {mismatch}",
            file=sys.stderr,
        )
        return 1
    print("the stopped + resumed stream equals the uninterrupted stream token for token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
