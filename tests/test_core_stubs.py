"""The stubs of the compiled module (python/tokenmill/_core/*.pyi) against the built module.

`python -m mypy.stubtest tokenmill._core` (.ci/run) checks that every name exists on both sides,
but pybind11 functions carry no `__text_signature__`, so it cannot see their parameters. This
test reads them from the signature line pybind11 writes at the top of every docstring and
compares each function's and method's parameter names, order, keyword-only markers, defaults
and None returns with the stub's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import tokenmill
from tokenmill import _core
from tokenmill._core import _testing

STUBS = Path(tokenmill.__file__).parent / "_core"
NO_DEFAULT = object()
# (name, keyword-only, default)
Parameter = tuple[str, bool, Any]
Signature = tuple[list[Parameter], bool]  # parameters (self excluded), returns None


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def runtime_signature(function: Any) -> Signature:
    line = (function.__doc__ or "").splitlines()[0]
    match = re.fullmatch(r"\w+\((.*)\) -> (.+)", line)
    assert match, f"no pybind11 signature line in {function!r}: {line!r}"
    parameters: list[Parameter] = []
    keyword_only = False
    for part in split_top_level(match.group(1)):
        if part == "*":
            keyword_only = True
            continue
        if part == "/":  # positional-only marker (a hand-written METH_FASTCALL function's line)
            continue
        name, _, rest = part.partition(":")
        default_text = rest.partition(" = ")[2]
        default = ast.literal_eval(default_text) if default_text else NO_DEFAULT
        if name != "self":
            parameters.append((name, keyword_only, default))
    return parameters, match.group(2) == "None"


def stub_signature(node: ast.FunctionDef) -> Signature:
    arguments = node.args
    positional = arguments.posonlyargs + arguments.args
    defaults: list[Any] = [NO_DEFAULT] * (len(positional) - len(arguments.defaults))
    defaults += [ast.literal_eval(ast.unparse(d)) for d in arguments.defaults]
    parameters: list[Parameter] = [
        (a.arg, False, d) for a, d in zip(positional, defaults, strict=True) if a.arg != "self"
    ]
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
        value = NO_DEFAULT if default is None else ast.literal_eval(ast.unparse(default))
        parameters.append((argument.arg, True, value))
    returns_none = isinstance(node.returns, ast.Constant) and node.returns.value is None
    return parameters, returns_none


def stub_definitions(path: Path) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {
        node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


def runtime_names(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, type))
    }


@pytest.mark.parametrize(
    ("module", "stub"),
    [(_core, "__init__.pyi"), (_testing, "_testing.pyi")],
    ids=["core", "testing"],
)
def test_stub_signatures_match_the_module(module: ModuleType, stub: str) -> None:
    definitions = stub_definitions(STUBS / stub)
    assert set(definitions) == runtime_names(module)
    for name, node in definitions.items():
        runtime = getattr(module, name)
        if isinstance(node, ast.FunctionDef):
            assert stub_signature(node) == runtime_signature(runtime), name
            continue
        # __buffer__ is how a stub says "supports the buffer protocol" (a C slot, not a method,
        # before Python 3.12)
        methods = {
            n.name: n
            for n in node.body
            if isinstance(n, ast.FunctionDef) and n.name != "__buffer__"
        }
        declared = {m for m in vars(runtime) if not m.startswith("_")} | {
            m for m in ("__init__", "__len__") if m in vars(runtime)
        }
        if "__init__" in declared and not (runtime.__init__.__doc__ or "").startswith("__init__("):
            declared.remove("__init__")  # pybind11's stand-in for "no constructor defined"
        assert set(methods) == declared, name
        for method, method_node in methods.items():
            if any(
                isinstance(d, ast.Name) and d.id == "property" for d in method_node.decorator_list
            ):
                # pybind11 writes no signature line for a property: it must be one at run time
                assert isinstance(vars(runtime)[method], property), f"{name}.{method}"
                continue
            signature = runtime_signature(getattr(runtime, method))
            assert stub_signature(method_node) == signature, f"{name}.{method}"


def test_the_testing_submodule_is_importable_and_not_the_production_api() -> None:
    import importlib

    assert importlib.import_module("tokenmill._core._testing") is _core._testing
    assert _testing.__name__ == "tokenmill._core._testing"
    # Test-only entry points are not on the production module.
    for name in ("build_sample_index", "philox_block", "throw_in_worker", "fail_thread_creation"):
        assert not hasattr(_core, name), name
    ids, positions = np.empty(4, np.int32), np.empty(4, np.int64)
    _core.build_blending_indices(np.ones(2), ids, positions)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _core.build_blending_indices(np.ones(2), ids, positions, path="scan")  # type: ignore[call-arg]
