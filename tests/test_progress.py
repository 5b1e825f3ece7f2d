"""Progress reporting (`tokenmill.common.progress`): a tqdm bar on interactive streams, the stable
plain lines elsewhere, `--quiet` on every long command, and no tqdm at `import tokenmill`."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tokenmill.cli.main import main
from tokenmill.common.progress import Progress, format_duration, is_interactive, si
from tokenmill.tokenize.progress import Progress as TokenizeProgress

from conftest import write_megatron_shard

# The plain line formats log scrapers may rely on.
TOKENIZE_LINE = re.compile(
    r"^\[tokenize\] +\d+\.\d% [\d,]+ docs [\d.]+[kMG]? docs/s [\d.]+[kMG]? tok/s [\d.]+ MB/s "
    r"elapsed \d+:\d\d:\d\d ETA (\d+:\d\d:\d\d|\?)$"
)
COUNTED_LINE = re.compile(
    r"^\[(\w[\w-]*)\] +\d+\.\d% [\d,]+ / [\d,]+ \S+ [\d.]+[kMG]? \S+/s "
    r"elapsed \d+:\d\d:\d\d ETA (\d+:\d\d:\d\d|\?)$"
)
BUILD_CACHE_LINE = re.compile(
    r"^\[build-cache\] \d+ entries \(\d+ built\) elapsed \d+:\d\d:\d\d: (built|hit) \S+ "
    r"\(\d+\.\d\d s\)$"
)


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_helpers() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(-3) == "0:00:00"
    assert [si(v) for v in (999, 1000, 2_500_000, 3e9)] == ["999", "1.0k", "2.5M", "3.0G"]
    assert is_interactive(Terminal()) and not is_interactive(io.StringIO())


def test_notebook_stderr_is_interactive(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert not is_interactive(stream)
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # any module: "inside a kernel"
    assert is_interactive(stream)
    assert not is_interactive(io.StringIO())  # only stderr itself


def test_plain_lines_at_the_interval_and_at_the_end() -> None:
    stream = io.StringIO()
    progress = Progress("convert", total=1000, unit="tok", stream=stream, log_interval=3600)
    for _ in range(4):
        progress.update(250)
    assert stream.getvalue() == ""  # the interval has not passed
    progress.close()
    progress.close()  # idempotent
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and COUNTED_LINE.match(lines[0]), lines
    assert lines[0].startswith("[convert] 100.0% 1,000 / 1,000 tok ")

    stream = io.StringIO()
    progress = Progress("convert", total=10, unit="tok", stream=stream, log_interval=0.0)
    progress.update(3)
    progress.update(3)
    assert stream.getvalue().count("\n") == 2
    assert "[convert]  30.0% 3 / 10 tok" in stream.getvalue()


def test_open_ended_count_events_and_messages() -> None:
    stream = io.StringIO()
    with Progress("publish", unit="object", stream=stream, log_interval=float("inf")) as progress:
        progress.update()
        progress.event("uploaded a.bin")
        progress.write("a message")
        assert progress.count == 1
    assert stream.getvalue().splitlines()[:2] == ["[publish] uploaded a.bin", "a message"]
    assert re.match(
        r"\[publish\] 1 object elapsed \d:\d\d:\d\d$", stream.getvalue().splitlines()[2]
    )


def test_failure_prints_no_final_line_and_quiet_prints_nothing() -> None:
    stream = io.StringIO()
    progress = Progress("merge", total=4, stream=stream)
    with pytest.raises(RuntimeError), progress:
        raise RuntimeError("stop")
    assert stream.getvalue() == ""
    quiet = io.StringIO()
    with Progress("merge", total=4, stream=quiet, enabled=False, log_interval=0.0) as progress:
        progress.update(4)
        progress.event("x")
        progress.write("y")
    for terminal in (False, True):
        stream = Terminal() if terminal else io.StringIO()
        silent = Progress("tokenize", total=1, stream=stream, enabled=False)
        silent.update(1)
        silent.close()
        assert stream.getvalue() == ""
    assert quiet.getvalue() == ""


def test_terminal_gets_a_tqdm_bar() -> None:
    stream = Terminal()
    progress = Progress(
        "convert", total=100, unit="tok", stream=stream, postfix=lambda: "extra=1", log_interval=0.0
    )
    progress.update(40)
    progress.event("last item")
    progress.update(60)
    progress.close()
    text = stream.getvalue()
    assert "convert" in text and "100/100" in text and "tok" in text and "\r" in text
    assert "last item" in text and "extra=1" in text
    assert "[convert]" not in text  # no plain lines on a terminal


def test_updates_from_threads_are_all_counted() -> None:
    stream = io.StringIO()
    progress = Progress("download", unit="object", stream=stream, log_interval=0.0)

    def work() -> None:
        for _ in range(500):
            progress.update()

    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    progress.close()
    assert progress.count == 2000
    assert all(line.startswith("[download] ") for line in stream.getvalue().splitlines())


def test_tokenize_line_format_is_stable() -> None:
    stream = io.StringIO()
    progress = TokenizeProgress(total_bytes=1000, stream=stream, log_interval=0.0)
    progress.update(10, 2000, 4000, 250)
    progress.update(5, 1000, 2000, 250)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert all(TOKENIZE_LINE.match(line) for line in lines), lines
    assert " 50.0% 15 docs " in lines[-1]


def test_cli_commands_take_quiet_and_log_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documents = [[*range(1, 40), 0] for _ in range(30)]
    source = write_megatron_shard(tmp_path / "a", documents)
    other = write_megatron_shard(tmp_path / "b", documents)
    assert main(["convert", source, str(tmp_path / "npy"), "--to", "npy"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and COUNTED_LINE.match(err[0]), err
    assert err[0].startswith("[convert] 100.0% 1,200 / 1,200 tok ")
    assert main(["convert", source, str(tmp_path / "npy2"), "--to", "npy", "-q"]) == 0
    assert capsys.readouterr().err == ""

    merged = str(tmp_path / "merged")
    args = ["merge", source, other, "-o", merged, "--allow-missing-fingerprint"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.startswith("[merge] 2 dataset(s) -> ") and "2,400 tokens" in err
    assert main([*args[:4], merged + "2", args[-1], "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_import_tokenmill_does_not_import_tqdm() -> None:
    code = (
        "import sys, tokenmill, tokenmill.common.progress, tokenmill.tokenize.progress;"
        "assert 'tqdm' not in sys.modules, 'imported tqdm'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_build_cache_line_format(tmp_path: Path) -> None:
    from tokenmill.runs.cache_build import _EntryProgress

    class Entry:
        base = "0123-GPTDataset-train"

    class Event:
        cache = Entry()
        built = True
        seconds = 0.5

    stream = io.StringIO()
    line = _EntryProgress(True, stream)
    line(Event())  # type: ignore[arg-type]
    line(Event())  # type: ignore[arg-type]  (within the interval: no line)
    line.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(BUILD_CACHE_LINE.match(text) for text in lines), lines
    assert lines[-1].startswith("[build-cache] 2 entries (2 built) ")
    empty = io.StringIO()
    _EntryProgress(True, empty).close()
    assert empty.getvalue() == ""
