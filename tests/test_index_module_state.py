"""No module-level mutable state in `tokenmill.index`: the cache protocol's per-build state
lives in its BuildContext (carried by a context variable), never in a module's dict, list or
set, which every thread and every build of a process would share."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill.index

INDEX = Path(tokenmill.index.__file__).parent
_MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        function = value.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
        return name in _MUTABLE_CALLS
    return False


def module_level_mutables(source: str) -> list[str]:
    """Names bound at module level to a mutable container (``__all__`` aside)."""
    found = []
    for node in ast.parse(source).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not _mutable(value):
            continue
        found += [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
    return found


def test_the_scan_sees_module_level_containers() -> None:
    source = (
        "A: dict[str, int] = {}\nB = set()\n__all__ = ['A']\nC = (1, 2)\ndef f():\n    d = {}\n"
    )
    assert module_level_mutables(source) == ["A", "B"]


def test_no_module_level_mutable_state_in_index() -> None:
    found = {
        (path.name, name)
        for path in sorted(INDEX.glob("*.py"))
        for name in module_level_mutables(path.read_text(encoding="utf-8"))
    }
    assert found == set()
