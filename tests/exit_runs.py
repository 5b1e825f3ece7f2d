"""Build a blend under torch.distributed (gloo, 2 ranks) and exit without
``destroy_process_group()``, many times; print the exit status of every rank as JSON.

Used by tests/test_clean_exit.py. Each rank is a fresh interpreter that initialises its process
group, builds, and simply ends: the interpreter finalizes as at the end of a user's script (the
abort this guards against, SIGABRT from a tensor that gloo's worker thread freed during
finalization, happened there; forked ranks, which leave through os._exit, never showed it).

Usage: python tests/exit_runs.py DIRECTORY RUNS [CONCURRENT]
       python tests/exit_runs.py --rank DIRECTORY RUN RANK PORT
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def shards(directory: Path) -> list[str]:
    return [str(directory / f"shard{i}") for i in range(3)]


def rank(directory: Path, run: int, number: int, port: int) -> None:
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig

    from conftest import TinyTokenizer

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=number, world_size=2
    )
    config = GPTDatasetConfig(
        random_seed=run, sequence_length=32, tokenizer=TinyTokenizer(),
        blend=(shards(directory), [0.5, 0.3, 0.2]), split="90,10,0", reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        path_to_cache=str(directory / "cache"),
    )  # fmt: skip
    BlendedMegatronDatasetBuilder(GPTDataset, [300, 30, 0], lambda: True, config).build()
    # no destroy_process_group(): the interpreter finalizes with gloo's threads alive


def main() -> None:
    directory, runs = Path(sys.argv[1]), int(sys.argv[2])
    concurrent = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    import numpy as np

    sys.path.insert(0, HERE)
    from conftest import random_documents, write_megatron_shard

    rng = np.random.default_rng(11)
    for prefix in shards(directory):
        write_megatron_shard(prefix, random_documents(rng, 80, 150))
    statuses: list[int] = []
    pending = list(range(runs))
    running: list[subprocess.Popen[bytes]] = []
    while pending or running:
        while pending and len(running) < 2 * concurrent:
            run, port = pending.pop(0), free_port()
            for number in range(2):
                command = [sys.executable, __file__, "--rank", str(directory), str(run)]
                running.append(
                    subprocess.Popen([*command, str(number), str(port)], stderr=subprocess.DEVNULL)
                )
        statuses.append(running.pop(0).wait())
    print(json.dumps(statuses))


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
