"""tokenmill on Ray vs NeMo Curator's JsonlReader + MegatronTokenizerWriter, and vs single-machine
tokenize: the same corpus, the same two-node local Ray cluster shape.

Rows:

* ``tokenmill ray`` -- ``tokenmill tokenize --engine ray --ray-address`` on a two-node cluster
  on this machine (``ray start --head`` and a worker node joined with ``ray start --address``,
  1 CPU each, separate temporary directories), gigatoken backend, append EOD;
* ``curator ray`` -- NeMo Curator 1.4's ``Pipeline([JsonlReader, MegatronTokenizerWriter])`` on
  the Ray Data executor against a cluster of the same shape, started from Curator's own virtual
  environment (``--curator-python``; its workers must import nemo_curator), the same GPT-2
  tokenizer.json as a local directory (offline, ``append_eod=True``), one task per input file;
* ``tokenmill local`` -- single-machine ``tokenmill tokenize --threads 2``: the Ray engine's
  overhead is the ratio of the two tokenmill rows.

Time is the driver's wall time (cluster already up); peak memory is the highest sum of RSS over
the cluster's processes (the ``ray start`` groups and every descendant of their raylets, sampled
every 0.2 s) plus the driver's. tokens/s is the output tokens over the wall time. Outputs are
compared: tokenmill's Ray output must equal its single-machine output byte for byte, and
Curator's prefixes, merged in input-file order, must hold the same tokens and documents.

Corpus: bench_tokenize.py's linux-doc-6.1 jsonl (``apt-get install linux-doc-6.1``), split
round-robin into ``--files`` jsonl files so both engines get the same independent pieces.
Tokenizer: GPT-2 BPE from the openai-whisper sdist, as tokenizer.json (bench_tokenize.py).

Curator's environment: ``python -m venv /work/venvs/curator && /work/venvs/curator/bin/pip install
nemo-curator==1.4.0 'transformers<5'`` (Curator 1.4.0's writer calls ``batch_encode_plus``,
which transformers 5 removed: with transformers 5 every task fails, and its clean-up then calls
``fs.remove``, which fsspec's local file system does not have).

Usage: ``python benchmarks/bench_ray.py --curator-python /work/venvs/curator-35/bin/python
[--work-dir DIR] [--files 8]`` (raw results: benchmarks/results/ray.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from bench_tokenize import build_corpus, fetch_gpt2, gpt2_vocab_and_merges
from evidence import Evidence

CURATOR_DRIVER = r"""
import json, sys, time
from nemo_curator.pipeline import Pipeline
from nemo_curator.backends.ray_data import RayDataExecutor
from nemo_curator.stages.text.io.reader import JsonlReader
from nemo_curator.stages.text.io.writer.megatron_tokenizer import MegatronTokenizerWriter
inputs, output, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
started = time.perf_counter()
pipeline = Pipeline(name="tokenize", stages=[
    JsonlReader(inputs, files_per_partition=1, fields=["text"]),
    MegatronTokenizerWriter(path=output, model_identifier=tokenizer, append_eod=True),
])
tasks = pipeline.run(RayDataExecutor())
seconds = time.perf_counter() - started
parts = sorted((task._metadata["source_files"], task._metadata["file_prefix"]) for task in tasks)
print(json.dumps({"seconds": seconds, "prefixes": [prefix for _, prefix in parts],
                  "tokens": sum(task._metadata["num_tokens"] for task in tasks)}))
"""


def rss_of(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as stream:
                total += int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def descendants(roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        groups[int(entry)] = int(fields[2])
    # the nodes' process groups, and the roots themselves (the driver is in the bench's group)
    found = {pid for pid, group in groups.items() if group in roots or pid in roots}
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


class PeakMemory:
    """The highest RSS sum of the cluster's process groups (and descendants) plus the driver."""

    def __init__(self, groups: set[int]) -> None:
        self.groups = groups
        self.driver: int | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            roots = set(self.groups) | ({self.driver} if self.driver else set())
            self.peak = max(self.peak, rss_of(descendants(roots)))
            # the worker processes of a raylet run in sessions of their own: descendants() finds
            # them through their parent

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TwoNodes:
    """A head and a worker node of 1 CPU each on 127.0.0.1, started with `python`'s ray."""

    def __init__(self, python: str) -> None:
        self.ray = str(Path(python).parent / "ray")
        self.work = Path(tempfile.mkdtemp(prefix="tmb-", dir="/tmp"))
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: list[subprocess.Popen[bytes]] = []

    def start(self, *arguments: str) -> None:
        with (self.work / f"node{len(self.nodes)}.log").open("wb") as log:
            self.nodes.append(
            subprocess.Popen(
                [self.ray, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                 "--disable-usage-stats", *arguments],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip

    def wait(self, count: int) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.poll() is not None:
                    raise SystemExit(f"`ray start` exited; see {self.work}")
            try:
                status = subprocess.run(
                    [self.ray, "status", "--address", self.address],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                continue
            active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if active.count("node_") == count:
                return
            time.sleep(1)
        raise SystemExit(f"cluster {self.address} did not reach {count} nodes")

    def __enter__(self) -> TwoNodes:
        port = self.address.rsplit(":", 1)[1]
        self.start("--head", "--port", port, "--temp-dir", str(self.work / "h"),
                   "--include-dashboard", "false")  # fmt: skip
        self.wait(1)
        self.start("--address", self.address, "--temp-dir", str(self.work / "w"))
        self.wait(2)
        return self

    def __exit__(self, *exc: object) -> None:
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(30)
        time.sleep(2)
        shutil.rmtree(self.work, ignore_errors=True)


def split_corpus(corpus: Path, work: Path, count: int) -> Path:
    directory = work / f"linux-doc-{count}"
    if directory.is_dir():
        return directory
    temporary = work / f".linux-doc-{count}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    streams = [(temporary / f"part-{i:02d}.jsonl").open("w") for i in range(count)]
    with corpus.open() as source:
        for number, line in enumerate(source):
            streams[number % count].write(line)
    for stream in streams:
        stream.close()
    temporary.rename(directory)
    return directory


def timed(command: list[str], environment: dict[str, str], memory: PeakMemory) -> tuple[float, str]:
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    memory.driver = process.pid
    out, err = process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{err[-3000:]}")
    return seconds, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curator-python", required=True)
    parser.add_argument("--work-dir", default="/tmp/tokenmill-bench-ray")
    parser.add_argument("--files", type=int, default=8)
    args = parser.parse_args()
    evidence = Evidence("ray")
    # throwaway clusters on 127.0.0.1: no token authentication (~/.ray/auth_token), no telemetry
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(work)
    ranks = fetch_gpt2(work)
    _, _, tokenizer_json = gpt2_vocab_and_merges(ranks, work)
    hf_dir = work / "gpt2-hf"
    hf_dir.mkdir(exist_ok=True)
    shutil.copy(tokenizer_json, hf_dir / "tokenizer.json")
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                    "bos_token": "<|endoftext|>", "model_max_length": 1 << 30})
    )  # fmt: skip
    inputs = split_corpus(corpus, work, args.files)
    text_bytes = sum(path.stat().st_size for path in inputs.iterdir())
    environment = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    environment["HF_HUB_OFFLINE"] = "1"
    environment["TRANSFORMERS_OFFLINE"] = "1"
    tokenmill = [sys.executable, "-m", "tokenmill.cli.main", "tokenize", str(inputs),
                 "--tokenizer", str(tokenizer_json), "-q"]  # fmt: skip
    rows = []
    outputs = work / "out"
    shutil.rmtree(outputs, ignore_errors=True)
    outputs.mkdir()

    with PeakMemory(set()) as memory:
        seconds, _ = timed([*tokenmill, "--threads", "2", "-o", str(outputs / "local")],
                           environment, memory)  # fmt: skip
    rows.append({"row": "tokenmill local (2 threads)", "seconds": seconds, "peak_rss": memory.peak})

    with TwoNodes(sys.executable) as cluster:
        with PeakMemory({node.pid for node in cluster.nodes}) as memory:
            seconds, _ = timed(
                [*tokenmill, "--engine", "ray", "--ray-address", cluster.address,
                 "-o", str(outputs / "ray")],
                environment, memory,
            )  # fmt: skip
        rows.append({"row": "tokenmill ray (2 nodes x 1 CPU)", "seconds": seconds,
                     "peak_rss": memory.peak})  # fmt: skip

    curator_environment = {**environment, "PYTHONPATH": ""}
    with TwoNodes(args.curator_python) as cluster:
        curator_environment["RAY_ADDRESS"] = cluster.address
        script = work / "curator_driver.py"
        script.write_text(CURATOR_DRIVER)
        with PeakMemory({node.pid for node in cluster.nodes}) as memory:
            seconds, out = timed(
                [args.curator_python, str(script), str(inputs), str(outputs / "curator"),
                 str(hf_dir)],
                curator_environment, memory,
            )  # fmt: skip
        report = json.loads(out.strip().splitlines()[-1])
        rows.append({"row": "NeMo Curator ray (2 nodes x 1 CPU)", "seconds": seconds,
                     "pipeline_seconds": report["seconds"], "peak_rss": memory.peak})  # fmt: skip

    # outputs
    for suffix in (".bin", ".idx"):
        same = (outputs / f"local{suffix}").read_bytes() == (outputs / f"ray{suffix}").read_bytes()
        if not same:
            raise SystemExit(f"tokenmill ray {suffix} differs from single-machine tokenize")
    from tokenmill.tokenize.merge import merge_datasets

    merge_datasets(report["prefixes"], str(outputs / "curator-merged"),
                   allow_missing_fingerprint=True)  # fmt: skip
    from tokenmill.formats.megatron import IndexedDataset

    ours, theirs = (
        IndexedDataset(str(outputs / "ray")),
        IndexedDataset(str(outputs / "curator-merged")),
    )
    same_tokens = bool(
        (ours.sequence_lengths == theirs.sequence_lengths).all()
        and all((ours[i] == theirs[i]).all() for i in range(len(ours)))
    )
    tokens = int(ours.sequence_lengths.sum())
    for row in rows:
        row["tokens_per_s"] = tokens / row["seconds"]
        row["mb_per_s"] = text_bytes / row["seconds"] / 1e6
    ray_row, curator_row, local_row = rows[1], rows[2], rows[0]
    curator_version = subprocess.run(
        [args.curator_python, "-c", "import nemo_curator, ray; print(nemo_curator.__version__, ray.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    import ray

    result = {
        "versions_extra": {
            "nemo_curator": curator_version[0],
            "ray_curator": curator_version[1],
            "ray": ray.__version__,
        },
        "corpus": {
            "files": args.files,
            "bytes": text_bytes,
            "tokens": tokens,
            "documents": len(ours),
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "tokenmill_ray_vs_curator": curator_row["seconds"] / ray_row["seconds"],
        "ray_engine_overhead": ray_row["seconds"] / local_row["seconds"],
        "ray_output_identical_to_local": True,
        "curator_tokens_identical": same_tokens,
    }
    for row in rows:
        print(f"{row['row']:40s} {row['seconds']:7.2f} s {row['tokens_per_s'] / 1e6:6.2f} "
              f"Mtok/s  peak {row['peak_rss'] / 2**20:7.0f} MiB")  # fmt: skip
    print(f"tokenmill ray / curator tokens/s: {result['tokenmill_ray_vs_curator']:.2f}x; "
          f"ray / local time: {result['ray_engine_overhead']:.2f}; curator tokens identical: "
          f"{same_tokens}")  # fmt: skip
    evidence.write(runs=rows, summary=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
