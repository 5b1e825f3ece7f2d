"""The test oracles (tests/oracles.py): a missing or broken one fails, naming the package and
its install command; only the developer's explicit opt-out turns that into a skip."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import oracles

MISSING = oracles.Oracle(
    "tokenmill-absent-oracle",
    "pip install tokenmill-absent-oracle",
    ("tokenmill_absent_oracle",),
    ("tokenmill_absent_oracle",),
)


@pytest.fixture
def absent_oracle(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(oracles.ORACLES, MISSING.name, MISSING)
    monkeypatch.delenv(oracles.ALLOW_VARIABLE, raising=False)
    monkeypatch.setattr(oracles, "MISSING", {})
    oracles.problem.cache_clear()
    return MISSING.name


def test_a_missing_oracle_fails_naming_it_and_its_install_command(absent_oracle: str) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        oracles.import_oracle("tokenmill_absent_oracle.sub")
    text = str(failed.value)
    assert "test oracle tokenmill-absent-oracle is missing or broken" in text
    assert "No module named 'tokenmill_absent_oracle'" in text
    assert "`pip install tokenmill-absent-oracle`" in text
    assert {absent_oracle: oracles.problem(absent_oracle)} == oracles.MISSING


@pytest.mark.parametrize(
    "allowed", ["tokenmill-absent-oracle", "moto,tokenmill-absent-oracle", "all"]
)
def test_the_opt_out_skips_instead(
    absent_oracle: str, monkeypatch: pytest.MonkeyPatch, allowed: str
) -> None:
    monkeypatch.setenv(oracles.ALLOW_VARIABLE, allowed)
    with pytest.raises(pytest.skip.Exception, match="skipped because"):
        oracles.require(absent_oracle)


def test_an_opt_out_for_another_oracle_still_fails(
    absent_oracle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(oracles.ALLOW_VARIABLE, "megatron-core")
    with pytest.raises(pytest.fail.Exception):
        oracles.require(absent_oracle)


def test_every_oracle_is_here() -> None:
    """This environment has every oracle (as CI does): none reports a problem."""
    assert {name: oracles.problem(name) for name in oracles.ORACLES} == dict.fromkeys(
        oracles.ORACLES
    )


def test_a_megatron_marked_test_fails_when_megatron_core_cannot_be_imported(tmp_path: Path) -> None:
    """The conftest's check runs before every megatron-marked test, whatever it imports: with
    megatron hidden from the child's imports, such a test fails and the summary names
    megatron-core; an unmarked test passes."""
    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            sys.path.insert(0, {str(tests)!r})
            sys.modules["megatron"] = None  # import megatron raises ImportError
            spec = importlib.util.spec_from_file_location("real_conftest", {str(tests / "conftest.py")!r})
            real = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(real)
            pytest_collection_modifyitems = real.pytest_collection_modifyitems
            pytest_runtest_setup = real.pytest_runtest_setup
            pytest_terminal_summary = real.pytest_terminal_summary
            """
        )
    )
    (tmp_path / "test_child.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.megatron
            def test_marked():
                pass

            def test_plain():
                pass
            """
        )
    )
    env_free = {k: v for k, v in os.environ.items() if k != oracles.ALLOW_VARIABLE}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "markers=megatron",
         "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env=env_free,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed, 1 error" in result.stdout
    assert "missing or broken test oracles" in result.stdout
    assert "test oracle megatron-core is missing or broken" in result.stdout
