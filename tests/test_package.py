"""The package surface: lazy public API, no torch at import, the console script."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import tokenmill


def test_import_is_lazy_and_does_not_import_torch() -> None:
    code = (
        "import sys, tokenmill;"
        "assert 'torch' not in sys.modules, 'import tokenmill imported torch';"
        "assert 'tokenmill._core' not in sys.modules;"
        "assert 'numpy' not in sys.modules, 'import tokenmill imported numpy';"
        "print(tokenmill.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == tokenmill.__version__


def test_every_public_name_resolves() -> None:
    for name in tokenmill.__all__:
        assert getattr(tokenmill, name) is not None, name
    assert set(tokenmill.__all__) >= {
        "IndexedDataset",
        "IndexedDatasetBuilder",
        "DType",
        "GPTDataset",
        "GPTDatasetConfig",
        "MockGPTDataset",
        "BlendedDataset",
        "BlendedMegatronDatasetBuilder",
    }
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = tokenmill.Nope  # type: ignore[attr-defined]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli.main", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_cli_version_and_help() -> None:
    version = _cli("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"tokenmill {tokenmill.__version__}"
    usage = _cli("--help")
    assert usage.returncode == 0
    assert "demo" in usage.stdout
    assert _cli().returncode == 0  # no command: prints help
    bad = _cli("no-such-command")
    assert bad.returncode == 2
    assert "invalid choice" in bad.stderr


def test_demo_runs_end_to_end(tmp_path: object) -> None:
    result = _cli("demo", "--documents", "300", "--train-samples", "500")
    assert result.returncode == 0, result.stderr
    assert "built the blend" in result.stdout
    assert "again from the cache" in result.stdout
    assert "done:" in result.stdout
    assert "the Jargon File" in result.stdout
    assert "decodes back exactly: True" in result.stdout
    assert "trained on raw text" in result.stdout
    assert "same samples as the tokenized blend: True" in result.stdout
    # the fastest backend installed (the test extra has gigatoken), with its throughput
    assert re.search(r"backend: gigatoken [0-9.]+ .*; encoding [0-9.]+ MB/s", result.stdout)
    assert "own data" in _cli("demo", "--help").stdout


def test_demo_corpus_ships_inside_the_package() -> None:
    import gzip
    import json
    from importlib.resources import files

    corpus = files("tokenmill").joinpath("data/jargon.jsonl.gz")
    with corpus.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as stream:
        entries = [json.loads(line) for line in stream]
    assert len(entries) == 2307
    assert entries[0]["term"] == "(TM)" and entries[-1]["term"] == "zorkmid"
    assert all(entry["text"].startswith(f":{entry['term']}:") for entry in entries)


def test_type_stub_names_the_same_modules_as_the_lazy_exports() -> None:
    """`__init__.pyi` (what type checkers read) and `_EXPORTS` (what `tokenmill.X` imports)
    agree name by name, and both list exactly `__all__`."""
    import ast
    from pathlib import Path

    stub = ast.parse((Path(tokenmill.__file__).parent / "__init__.pyi").read_text())
    imported: dict[str, str] = {}
    stub_all: list[str] = []
    for node in stub.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname == alias.name, alias.name  # an explicit re-export
                imported[alias.name] = str(node.module)
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            stub_all = list(ast.literal_eval(node.value))
    assert imported == tokenmill._EXPORTS
    assert sorted(stub_all) == sorted(tokenmill.__all__)
    assert set(tokenmill.__all__) == set(tokenmill._EXPORTS) | {"__version__"}


def test_version_is_written_once() -> None:
    """pyproject.toml takes the version from `__version__` (scikit-build-core's regex provider),
    so the installed metadata and the module agree."""
    from importlib.metadata import version
    from pathlib import Path

    assert version("tokenmill") == tokenmill.__version__
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not run from a source checkout")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    assert "version" not in config["project"] and config["project"]["dynamic"] == ["version"]
    provider = config["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    source = pyproject.parent / provider["input"]
    assert f'__version__ = "{tokenmill.__version__}"' in source.read_text(encoding="utf-8")


def test_the_core_does_not_declare_free_threading_support() -> None:
    """No free-threaded wheel is built or tested and the package assumes a GIL, so `_core` must
    not declare that it runs without one (pybind11's `py::mod_gil_not_used()`): a free-threaded
    interpreter then turns the GIL back on when it imports the module. On such an interpreter
    that is checked on the binary; on a GIL build, where the declaration leaves no trace in the
    module, on the source of the module definition."""
    import sysconfig
    from pathlib import Path

    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        code = "import sys, tokenmill._core; print(sys._is_gil_enabled())"
        result = subprocess.run(
            [sys.executable, "-W", "ignore", "-X", "gil=0", "-c", code],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "True"
        return
    module = Path(__file__).resolve().parents[1] / "csrc" / "bindings" / "module.cpp"
    if not module.is_file():
        pytest.skip("a GIL build not run from a source checkout: nothing to read the flag from")
    source = module.read_text(encoding="utf-8")
    definition = re.search(r"PYBIND11_MODULE\(([^)]*)\)", source)
    assert definition is not None
    assert definition.group(1).replace(" ", "") == "_core,m"
    code_lines = [line for line in source.splitlines() if not line.lstrip().startswith("//")]
    assert not any("mod_gil_not_used" in line for line in code_lines)


def test_bench_removes_the_working_directory_it_created(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokenmill bench` without --workdir generates its corpus in a temporary directory and
    removes it at the end (hundreds of MB at the default size)."""
    import argparse
    import os
    import tempfile

    from tokenmill.cli import bench

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = "--tokens 200000 --seq-length 64 --batch-sizes 2 --workers 0 --seconds 0.01"
    arguments = parser.parse_args([*small.split(), "--no-megatron"])
    assert bench.run(arguments) == 0
    assert os.listdir(str(tmp_path)) == []
