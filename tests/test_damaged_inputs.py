"""Damaged and hostile inputs (issue 19): every on-disk format, concurrent writers, killed
parents, hostile manifests, compressed inputs that end early, config bombs, one-line CLI errors.

The corruption suite runs `tests/damage.py` once per format in a fresh process under a timeout
(a hang fails) and reads back its peak RSS (a budget); each damaged case must be a clean error
naming the file and a field, or give output identical to the undamaged file's (see
`tests/damage_cases.py` for what counts as undetectable by construction).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import write_megatron_shard

HERE = Path(__file__).parent
RSS_BUDGET_MIB = {"index_cache": 1024}  # imports torch; the others stay far below 512
DEFAULT_RSS_MIB = 512


@pytest.mark.parametrize(
    "kind",
    [
        "megatron",
        "bos_index",
        "nanogpt",
        "npy_dir",
        "index_cache",
        "packing_plan",
        "manifest",
        "mixture_config",
        "build_cache_config",
        "mixture_state",
    ],
)
def test_damaged_files_are_refused_by_name_or_read_identically(kind: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / "damage.py"), kind, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,  # a hang in any case fails here
        cwd=HERE,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["cases"] >= 25, report
    assert report["bad_count"] == 0, "\n".join(report["bad"])
    assert report["errors"] > 0
    assert report["peak_rss_mib"] < RSS_BUDGET_MIB.get(kind, DEFAULT_RSS_MIB), report


# -- structural checks shared by every reader ----------------------------------------------------


def test_every_megatron_reader_refuses_overlapping_pointers(tmp_path: Path) -> None:
    import struct

    from tokenmill.cli.main import main
    from tokenmill.errors import DataFormatError
    from tokenmill.formats.megatron import IndexedDataset
    from tokenmill.megatron.indexed_dataset import IndexedDataset as MegatronModule

    prefix = write_megatron_shard(tmp_path / "shard", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    data = bytearray(Path(prefix + ".idx").read_bytes())
    struct.pack_into("<q", data, 34 + 4 * 3 + 8 * 1, 4)  # sequence 1 overlaps sequence 0
    Path(prefix + ".idx").write_bytes(bytes(data))
    for reader in (IndexedDataset, MegatronModule):
        with pytest.raises(DataFormatError, match=r"shard\.idx: sequence_pointers\[1\] = 4"):
            reader(prefix)
    assert main(["inspect", prefix]) == 1  # inspect reports it instead of "all checks passed"
    assert (
        main(
            [
                "merge",
                prefix,
                "--output",
                str(tmp_path / "m"),
                "--quiet",
                "--allow-missing-fingerprint",
            ]
        )
        == 1
    )
    assert not list(tmp_path.glob("m.*")), "a corrupt input left final-named merge output"


def test_partial_bos_index_is_refused(tmp_path: Path) -> None:
    from tokenmill.errors import DataFormatError
    from tokenmill.formats.bos_index import check_bos_positions, write_bos_index

    tokens = np.array([1, 4, 1, 5, 6, 1, 7], dtype=np.uint16)
    write_bos_index(tmp_path / "x.bos.idx", [0, 2], token_count=7)
    with pytest.raises(DataFormatError, match=r"x\.bos\.idx: .* position 5 also holds the BOS"):
        check_bos_positions(str(tmp_path / "x.bos.idx"), tokens, np.array([0, 2]), 1)
    with pytest.raises(DataFormatError, match="positions is empty"):
        check_bos_positions("x.bos.idx", tokens, np.array([], dtype=np.int64), 1)


def test_inspect_and_convert_refuse_a_partial_bos_index(tmp_path: Path) -> None:
    from tokenmill.cli.main import main
    from tokenmill.errors import DataFormatError
    from tokenmill.formats.bos_index import write_bos_index
    from tokenmill.formats.nanogpt import write_nanogpt_shard
    from tokenmill.formats.sources import open_source

    tokens = np.array([1, 4, 1, 5, 6, 1, 7], dtype=np.uint16)
    write_nanogpt_shard(tmp_path / "s.bin", tokens)
    write_bos_index(tmp_path / "s.bos.idx", [0, 2], token_count=7)  # the BOS at 5 is missing
    with pytest.raises(DataFormatError, match=r"s\.bos\.idx: .*truncated"):
        open_source(str(tmp_path / "s.bin"))
    assert main(["inspect", str(tmp_path / "s.bin")]) == 1
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "s.bin"), str(out), "--to", "megatron"]) == 1
    assert not list(tmp_path.glob("out*"))


def test_cache_with_impossible_values_fails_build_cache_check(tmp_path: Path) -> None:
    """Right dtype and shape, impossible values: `build-cache --check` names the file and field."""
    from tokenmill.cli.main import main

    documents = [list(range(1 + 10 * d, 5 + 10 * d + d % 7)) for d in range(30)]
    prefix = write_megatron_shard(tmp_path / "data", documents)
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "tokenizer": {"vocab_size": 500, "eod": 0, "unique_identifiers": {"class": "T"}},
                "blend": [[prefix], None],
                "split": "1",
                "random_seed": 3,
                "sequence_length": 8,
                "path_to_cache": str(tmp_path / "cache"),
                "sizes": [20, None, None],
                "reset_position_ids": False,
                "reset_attention_mask": False,
                "eod_mask_loss": False,
            }
        )
    )
    assert main(["build-cache", str(config), "--quiet"]) == 0
    (shuffle,) = (tmp_path / "cache").rglob("*-shuffle_index.npy")
    array = np.load(shuffle)
    array[3] = array[4]  # a repeated sample: same dtype, same shape
    np.save(shuffle, array)
    assert main(["build-cache", str(config), "--check", "--quiet"]) == 1


# -- compressed inputs ---------------------------------------------------------------------------


def test_truncated_zstd_and_gzip_inputs_name_the_byte(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    from tokenmill.errors import DataFormatError
    from tokenmill.tokenize.readers import read_documents

    text = b"".join(json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(3000))
    compressor = zstandard.ZstdCompressor()
    whole = compressor.compress(text[:40000]) + compressor.compress(text[40000:])
    (tmp_path / "ok.jsonl.zst").write_bytes(whole)
    assert len(list(read_documents(tmp_path / "ok.jsonl.zst"))) == 3000
    for cut in (len(whole) - 1, len(whole) // 2, 20):
        (tmp_path / "cut.jsonl.zst").write_bytes(whole[:cut])
        with pytest.raises(DataFormatError, match=rf"cut\.jsonl\.zst: .*ends at byte {cut} inside"):
            list(read_documents(tmp_path / "cut.jsonl.zst"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(text)[:-10])
    with pytest.raises(DataFormatError, match=r"cut\.jsonl\.gz: cannot decompress .* at byte \d+"):
        list(read_documents(tmp_path / "cut.jsonl.gz"))


# -- configs -------------------------------------------------------------------------------------

BOMB = "a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i else '*a'] * 9)}]\n" for i in range(9)
)


def test_yaml_alias_bomb_and_deep_nesting_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    from tokenmill.common.config_text import ConfigTextError, parse_config_text, typed
    from tokenmill.datasets.mixture_config import MixtureConfig, MixtureConfigError

    with pytest.raises(ConfigTextError, match=r"c\.yaml: more than 64 YAML aliases"):
        parse_config_text(BOMB, "c.yaml", "yaml")
    six_levels = "\n".join(BOMB.splitlines()[:7])  # 54 aliases, 9**6 values once expanded
    with pytest.raises(ConfigTextError, match=r"c\.yaml: .*more than 200000 values"):
        parse_config_text(six_levels, "c.yaml", "yaml")
    with pytest.raises(ConfigTextError, match="nested deeper than 32"):
        parse_config_text("a: " + "[" * 10000 + "]" * 10000, "c.yaml", "yaml")
    with pytest.raises(ConfigTextError, match="nested too deeply"):
        parse_config_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "c.json", "json")
    (tmp_path / "m.yaml").write_text(BOMB)
    with pytest.raises(MixtureConfigError, match=r"m\.yaml"):
        MixtureConfig.from_file(tmp_path / "m.yaml")
    with pytest.raises(
        ConfigTextError, match=r"c\.yaml: field 'sequence_length' must be int, got str"
    ):
        typed({"sequence_length": "2048"}, "sequence_length", int, "c.yaml")
    with pytest.raises(ConfigTextError, match="must be int, got bool"):
        typed({"n": True}, "n", int, "c.yaml")


def test_mistyped_build_cache_field_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli.main import main

    prefix = write_megatron_shard(tmp_path / "data", [[1, 2, 3]])
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "tokenizer": {"vocab_size": 500, "eod": 0, "unique_identifiers": {"class": "T"}},
                "blend": [[prefix], None],
                "split": "1",
                "sequence_length": "8",
                "random_seed": 1,
            }
        )
    )
    assert main(["build-cache", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json: field 'sequence_length' must be int, got str" in err


# -- CLI errors ----------------------------------------------------------------------------------


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "dir.bin").mkdir()  # a directory where a file belongs
    command = [sys.executable, "-m", "tokenmill.cli.main"]
    quiet = subprocess.run(
        [*command, "validate", str(tmp_path / "dir.bin"), "--state", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert quiet.returncode != 0
    assert "Traceback" not in quiet.stderr and quiet.stderr.count("\n") == 1, quiet.stderr
    from tokenmill.cli import inspect_cmd
    from tokenmill.cli._errors import one_line, report_error
    from tokenmill.cli.main import main

    def unexpected(args: object) -> int:
        raise RuntimeError("boom\nsecond line " + "v" * 5000)

    original = inspect_cmd.run
    inspect_cmd.run = unexpected  # type: ignore[assignment]
    try:
        assert main(["inspect", "x"]) == 1
        with pytest.raises(RuntimeError, match="boom"):
            main(["--debug", "inspect", "x"])
    finally:
        inspect_cmd.run = original  # type: ignore[assignment]

    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "tokenmill inspect: error: RuntimeError: boom second line" in err
    )
    assert len(err) < 2100 and "--debug" in err
    assert report_error("x", KeyboardInterrupt()) == 130
    assert len(one_line("v" * 10**6)) <= 2000


def test_incompatible_core_arguments_name_the_argument() -> None:
    from tokenmill import _core
    from tokenmill.common.core_call import core_call

    tokens = np.zeros(3, dtype=np.uint16)
    with pytest.raises(TypeError, match="count_token: argument 'token' must be int, got str 'x'"):
        core_call(_core.count_token, tokens, "x", 1)
    with pytest.raises(TypeError, match="count_token: takes 2 to 3 arguments, got 1"):
        core_call(_core.count_token, tokens)


# -- ownership -----------------------------------------------------------------------------------


def test_second_writer_gets_a_clear_error_and_stale_owners_are_taken_over(tmp_path: Path) -> None:
    import socket

    from tokenmill.common.ownership import OutputBusyError, own_output, owner_path

    prefix = str(tmp_path / "out")
    script = (
        "import sys, time; from tokenmill.common.ownership import own_output\n"
        "with own_output(sys.argv[1]):\n    print('owned', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, prefix], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "owned"
        busy = rf"out is being written by another tokenmill \(pid {holder.pid}, host {socket.gethostname()}\)"
        with pytest.raises(OutputBusyError, match=busy), own_output(prefix):
            pass
    finally:
        holder.kill()
        holder.communicate()
    # the holder died without cleaning up: its owner file is stale and is taken over
    assert json.loads(Path(owner_path(prefix)).read_text())["pid"] == holder.pid
    with own_output(prefix) as run_id:
        assert json.loads(Path(owner_path(prefix)).read_text())["run_id"] == run_id
    assert not Path(owner_path(prefix)).exists()


def _pausing(resume: Path, after_parts: int) -> dict[str, str]:
    """An environment in which `tokenize` stops after `after_parts` finished parts, creates
    `<resume>.paused` and goes on once `resume` exists (tokenize's test hooks)."""
    return {
        **os.environ,
        "TOKENMILL_TEST_PAUSE_AFTER_PARTS": str(after_parts),
        "TOKENMILL_TEST_RESUME_FILE": str(resume),
    }


def _wait_until_paused(process: subprocess.Popen[str], resume: Path) -> None:
    """Until the run reaches its pause (the deadline only turns a hang into a failure)."""
    deadline = time.monotonic() + 600
    while not Path(f"{resume}.paused").exists():
        assert process.poll() is None, "the run ended before its pause"
        assert time.monotonic() < deadline, "the run did not reach its pause"
        time.sleep(0.02)


@pytest.mark.parametrize("same_inputs", [False, True], ids=["different", "identical"])
def test_two_tokenize_jobs_into_one_output(tmp_path: Path, same_inputs: bool) -> None:
    """One wins, the other fails with the clear error, the result equals a single run."""
    corpora = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": f"{name} doc {i} " * 30}) + "\n" for i in range(60))
        )
        corpora.append(path)
    second_input = corpora[0] if same_inputs else corpora[1]
    command = [sys.executable, "-m", "tokenmill.cli.main", "tokenize"]
    output = tmp_path / "out"
    options = ["--output", str(output), "--workers", "0", "--chunk-mb", "0.001", "--quiet"]
    # the first job stops after its part is written (a test hook) and goes on only once the
    # second has run: they overlap whatever the load, no timer decides it
    resume = tmp_path / "resume-first"
    paused = _pausing(resume, after_parts=1)
    first = subprocess.Popen(
        [*command, str(corpora[0]), *options], env=paused, text=True, stderr=subprocess.PIPE
    )
    try:
        _wait_until_paused(first, resume)
        assert list(tmp_path.glob(".out.tokenmill-owner"))
        second = subprocess.run(
            [*command, str(second_input), *options],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        resume.touch()
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err
    assert second.returncode == 1
    assert f"out is being written by another tokenmill (pid {first.pid}," in second.stderr
    single = tmp_path / "single"
    subprocess.run(
        [*command, str(corpora[0]), *options[:1], str(single), *options[2:]],
        check=True,
        timeout=120,
    )
    for suffix in (".bin", ".idx"):
        assert Path(str(output) + suffix).read_bytes() == Path(str(single) + suffix).read_bytes()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_killing_tokenize_leaves_no_live_worker(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(400)))
    command = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "tokenize",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--workers",
        "2",
        "--chunk-mb",
        "0.001",
        "--quiet",
    ]
    # the run stops after its part is written, its worker pool still up (a test hook): it is
    # killed there, not after a timer that a loaded machine may outlast
    resume = tmp_path / "never"
    process = subprocess.Popen(command, env=_pausing(resume, after_parts=1), text=True)
    try:
        _wait_until_paused(process, resume)
        workers = _descendants(process.pid)
    finally:
        process.send_signal(signal.SIGKILL)
    assert len(workers) >= 2, "no workers started"
    process.wait(timeout=30)
    deadline = time.monotonic() + 60  # a hang guard: the loop ends when the workers are gone
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)], "workers outlived their parent"


def test_sigterm_ends_tokenize_with_one_line_and_exit_130(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(400)))
    command = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "tokenize",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--workers",
        "0",
        "--chunk-mb",
        "0.001",
        "--quiet",
    ]
    # SIGTERM lands while the run is paused mid-way (a test hook), never after it finished
    resume = tmp_path / "never"
    process = subprocess.Popen(
        command, env=_pausing(resume, after_parts=1), stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_until_paused(process, resume)
        assert (tmp_path / "out.parts").exists()
    finally:
        process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip().count("\n") == 0 and "interrupted" in err
    assert not Path(str(tmp_path / "out") + ".idx").exists()


# -- manifests -----------------------------------------------------------------------------------


def _manifest(root: Path, objects: list[dict[str, object]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "manifest.json"
    path.write_text(
        json.dumps(
            {"format": "tokenmill.manifest", "version": 1, "objects": objects, "config": None}
        )
    )
    return path


def _entry(key: str, data: bytes, url: str | None = None) -> dict[str, object]:
    import hashlib

    entry: dict[str, object] = {
        "key": key,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    if url is not None:
        entry["url"] = url
    return entry


@pytest.mark.parametrize(
    "where",
    ["local file", "file url", "proc", "other host", "symlink out of the manifest directory"],
)
def test_hostile_manifest_entries_are_refused(tmp_path: Path, where: str) -> None:
    from tokenmill.storage.download import download

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private")
    published = tmp_path / "published"
    published.mkdir()
    url = {
        "local file": str(secret),
        "file url": f"file://{secret}",
        "proc": "/proc/self/environ",
        "other host": "https://elsewhere.example/secret.txt",
        "symlink out of the manifest directory": None,
    }[where]
    if url is None:
        (published / "link.txt").symlink_to(secret)
        manifest = _manifest(published, [_entry("link.txt", b"private")])
    else:
        manifest = _manifest(published, [_entry("secret.txt", b"private", url)])
    destination = tmp_path / "destination"
    with pytest.raises(ValueError, match="refusing"):
        download(str(manifest), str(destination))
    written = [p for p in tmp_path.rglob("*") if p.is_file() and destination in p.parents]
    assert written == []
    # an explicit allow-list lets the local cases through
    if where in ("local file", "symlink out of the manifest directory"):
        download(str(manifest), str(destination), allow=[str(tmp_path)])
        assert (destination / ("link.txt" if url is None else "secret.txt")).read_bytes() == (
            b"private"
        )


def test_download_never_writes_through_a_symlink_in_the_destination(tmp_path: Path) -> None:
    from tokenmill.storage.download import download

    published = tmp_path / "published"
    (published / "sub").mkdir(parents=True)
    (published / "sub" / "a.bin").write_bytes(b"data")
    manifest = _manifest(published, [_entry("sub/a.bin", b"data")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    destination = tmp_path / "destination"
    destination.mkdir()
    (destination / "sub").symlink_to(elsewhere)  # planted: sub/ points outside
    with pytest.raises(ValueError, match="symlink"):
        download(str(manifest), str(destination))
    assert list(elsewhere.iterdir()) == []
    (destination / "sub").unlink()
    download(str(manifest), str(destination))
    assert (destination / "sub" / "a.bin").read_bytes() == b"data"


def test_manifest_numbers_are_bounded_and_typed() -> None:
    from tokenmill.storage.manifest import Manifest

    for size in (-1, 1 << 60, "12", 1.5, True):
        text = json.dumps(
            {
                "format": "tokenmill.manifest",
                "version": 1,
                "config": None,
                "objects": [{"key": "a", "size": size, "sha256": "0" * 64}],
            }
        )
        with pytest.raises(ValueError, match=r"m\.json: objects\[0\] \(a\): size"):
            Manifest.from_json(text, "m.json")


# -- check before allocating or looping ----------------------------------------------------------


def test_absurd_sizes_are_refused_before_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.index.blending import build_blending_indices

    monkeypatch.setenv("TOKENMILL_MEMORY_BUDGET", str(1 << 30))
    with pytest.raises(MemoryError, match=r"blending indices of 1,000,000,000,000 samples needs"):
        build_blending_indices([0.5, 0.5], 10**12)


def test_absurd_token_budget_makes_validate_fail_fast(tmp_path: Path) -> None:
    prefix = write_megatron_shard(tmp_path / "a", [[1, 2, 3], [4, 5]])
    config = tmp_path / "m.toml"
    config.write_text(
        f'seed = 7\nchunk_tokens = 1\nexhaustion = "drop"\n[sources.a]\npaths = ["{prefix}"]\n'
        '[[phases]]\nname = "p0"\ntokens = 9007199254740992\nweights = { a = 1.0 }\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", "validate", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "raise chunk_tokens or lower the phases' tokens" in result.stderr
    config.write_text(config.read_text().replace("9007199254740992", "9007199254740993"))
    from tokenmill.datasets.mixture_config import MixtureConfig, MixtureConfigError

    with pytest.raises(MixtureConfigError, match=r"m\.toml: phases\.p0\.tokens must be <= 2\*\*53"):
        MixtureConfig.from_file(config)


def test_convert_refuses_an_output_another_tokenmill_is_writing(tmp_path: Path) -> None:
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    source = str(tmp_path / "src")
    builder = IndexedDatasetBuilder(source + ".bin", dtype=np.uint16)
    builder.add_document(np.arange(1, 50), lengths=[49])
    builder.finalize(source + ".idx")
    destination = str(tmp_path / "dst")
    script = (
        "import sys, time; from tokenmill.common.ownership import own_output\n"
        "with own_output(sys.argv[1]):\n    print('owned', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, destination], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "owned"
        result = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli.main", "convert", source, destination,
             "--to", "npy", "--dtype", "uint16", "--quiet"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.communicate()
    assert result.returncode == 1
    assert f"dst is being written by another tokenmill (pid {holder.pid}," in result.stderr
    assert not Path(destination).exists()  # nothing written
