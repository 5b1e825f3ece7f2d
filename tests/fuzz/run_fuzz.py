"""Run one fuzz harness under atheris (coverage-guided, libFuzzer engine).

    pip install -e ".[fuzz]"
    python tests/fuzz/run_fuzz.py megatron_idx -runs=1000000 -max_len=4096 -timeout=10

The harness names are the keys of ``harnesses.HARNESSES``. The seed corpus (valid files written
by tokenmill's own writers) goes to ``$TOKENMILL_FUZZ_DIR/<name>/corpus`` (a temporary directory
if unset) and is passed to libFuzzer, which also writes new interesting inputs there; a crashing
input is saved as ``crash-*`` in the current directory. Every libFuzzer flag is passed through.
Exit status 0 means every execution ended normally or with a documented exception type.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

# Coverage feedback comes from these modules' Python functions (the parsers, the harness, numpy's
# .npy header parser, json). atheris.instrument_imports() would miss tokenmill when it is
# installed editable (scikit-build-core's editable finder bypasses atheris's import hook), and
# atheris.instrument_all() also instruments torch, which makes executions 10x slower.
INSTRUMENTED = ("tokenmill", "fuzz", "numpy.lib._format_impl", "numpy.lib.format", "json")


def instrument(atheris: Any) -> None:
    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and str(obj.__module__).startswith(INSTRUMENTED):
            atheris.instrument_func(obj)
            count += 1
    print(f"INFO: instrumented {count} functions of {', '.join(INSTRUMENTED)}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(f"usage: {sys.argv[0]} HARNESS [libFuzzer flags...]")
    name = sys.argv.pop(1)
    import atheris

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fuzz import harnesses

    if name not in harnesses.HARNESSES:
        raise SystemExit(f"unknown harness {name!r}; known: {', '.join(harnesses.HARNESSES)}")
    root = Path(os.environ.get("TOKENMILL_FUZZ_DIR") or tempfile.mkdtemp(prefix="tokenmill-fuzz-"))
    harnesses.set_workdir(root / name / "work")
    corpus = root / name / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for number, seed in enumerate(harnesses.seeds(name)):
        (corpus / f"seed-{number}").write_bytes(seed)
    harness = harnesses.HARNESSES[name]
    # Import everything the harness uses lazily, then instrument it. The seeds go through too:
    # an empty input is refused before serving, so the first valid input used to import torch
    # inside libFuzzer's per-input timeout (12 s under nice 19 on a loaded machine: a false
    # "timeout" in the packing_plan campaign of 2026-11-28).
    for warm_up in (b"", *harnesses.seeds(name)):
        harness(warm_up)
    instrument(atheris)

    def one_input(data: bytes) -> None:
        harness(data)

    atheris.Setup([sys.argv[0], *sys.argv[1:], str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
