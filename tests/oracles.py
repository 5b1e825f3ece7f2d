"""The test oracles: what tokenmill's tests compare against or need to prove anything.

A missing or broken oracle fails the tests that need it, naming the package and the command that
installs it; it never skips them (a run without its oracle would pass while proving nothing).
`import_oracle` replaces `pytest.importorskip` for them, and tests marked `megatron` check
megatron-core before they run (tests/conftest.py).

A developer with a partial environment can opt out, per oracle or for all of them:

    TOKENMILL_ALLOW_MISSING_ORACLES=megatron-core,moto python -m pytest tests
    TOKENMILL_ALLOW_MISSING_ORACLES=all python -m pytest tests

Their tests are then skipped, with the reason naming the variable; `.ci/run` never sets it, and it
fails when any test is skipped for a reason that is not one of the machine's (.ci/allowed-skips).
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from types import ModuleType

import pytest

ALLOW_VARIABLE = "TOKENMILL_ALLOW_MISSING_ORACLES"
MISSING: dict[str, str] = {}
"""Oracle name -> what is wrong with it, for each oracle a test needed and did not find (the
session's summary lists them: tests/conftest.py)."""


@dataclass(frozen=True)
class Oracle:
    name: str  # the package (or tool) name a user installs
    install: str  # the command that installs it
    modules: tuple[str, ...]  # top-level modules it provides (what import_oracle maps back)
    probes: tuple[str, ...]  # what must import for it to count as working


ORACLES: dict[str, Oracle] = {
    oracle.name: oracle
    for oracle in (
        Oracle(
            "megatron-core",
            "pip install --no-deps --ignore-requires-python megatron-core==0.19.2",
            ("megatron",),
            (
                "megatron.core.datasets.gpt_dataset",
                "megatron.core.datasets.indexed_dataset",
                "megatron.core.datasets.blended_megatron_dataset_builder",
                "megatron.core.datasets.helpers",
            ),
        ),
        Oracle("moto", "pip install 'moto[server]>=5' 'boto3>=1.34'", ("moto", "boto3"),
               ("moto.server", "boto3")),
        Oracle(
            "gigatoken",
            "pip install 'gigatoken>=0.10' 'tokenizers>=0.15' 'tiktoken>=0.7'",
            ("gigatoken", "tokenizers", "tiktoken"),
            ("gigatoken", "tokenizers", "tiktoken"),
        ),
        # Megatron's --tokenizer-type HuggingFaceTokenizer is transformers' AutoTokenizer
        Oracle("transformers", "pip install 'transformers>=4.40'", ("transformers",),
               ("transformers",)),
        Oracle("strace", "apt-get install strace", (), ()),
    )
}  # fmt: skip


def _allowed(name: str) -> bool:
    allowed = {part.strip() for part in os.environ.get(ALLOW_VARIABLE, "").split(",")}
    return "all" in allowed or name in allowed


@functools.cache
def problem(name: str) -> str | None:
    """Why the oracle `name` cannot be used here (None when it can)."""
    oracle = ORACLES[name]
    if name == "strace":
        if shutil.which("strace") is None:
            return "strace is not installed"
        result = subprocess.run(
            ["strace", "-f", "-o", os.devnull, "true"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if result.returncode != 0:
            return f"strace cannot trace here: {result.stderr.strip()[:300]}"
        return None
    for module in oracle.probes:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron-core warns about optional packages
                importlib.import_module(module)
        except Exception as error:  # a broken install raises anything
            return f"import {module} failed: {type(error).__name__}: {error}"
    return None


def message(name: str, reason: str) -> str:
    return (
        f"test oracle {name} is missing or broken ({reason}). Install it: "
        f"`{ORACLES[name].install}`; or, in a partial development environment only, set "
        f"{ALLOW_VARIABLE}={name} (or =all) to skip the tests that need it."
    )


def require(name: str) -> None:
    """Fail the calling test (or module, at collection) when oracle `name` is missing or
    broken; skip instead when the developer opted out for it."""
    reason = problem(name)
    if reason is None:
        return
    MISSING[name] = reason
    if _allowed(name):
        pytest.skip(f"{name} unavailable ({reason}); skipped because {ALLOW_VARIABLE} allows it",
                    allow_module_level=True)  # fmt: skip
    pytest.fail(message(name, reason), pytrace=False)


def oracle_of(module: str) -> str:
    top = module.split(".")[0]
    for oracle in ORACLES.values():
        if top in oracle.modules:
            return oracle.name
    raise ValueError(f"{module} belongs to no test oracle")


def import_oracle(module: str) -> ModuleType:
    """`pytest.importorskip` for an oracle's module: the module, or the oracle's failure."""
    require(oracle_of(module))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)
