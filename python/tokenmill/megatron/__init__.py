"""megatron-core's ``megatron.core.datasets`` module layout over tokenmill's classes.

`tokenmill.megatron.<module>` mirrors ``megatron.core.datasets.<module>`` (megatron-core 0.19)
for the nine modules tokenmill implements (`MODULES`): each exports every public name of its
counterpart and the private names Megatron-LM's code imports, with megatron's signatures, and
its classes *are* tokenmill's (``tokenmill.megatron.gpt_dataset.GPTDataset is
tokenmill.GPTDataset``). megatron-core need not be installed.

:func:`patch_megatron` makes unchanged Megatron code run on tokenmill: it puts an import hook in
front of ``sys.meta_path`` so that ``import megatron.core.datasets.<module>`` (and ``from
megatron.core.datasets import <module>``) returns tokenmill's module for those nine names. Every
other module stays megatron's: BERT/T5/multimodal datasets, ``megatron.training``'s FIM and SFT
datasets, data samplers... and the ones that subclass ``GPTDataset`` or ``MegatronDataset``
subclass tokenmill's, since they import those names through the hook. Without megatron-core the
packages ``megatron``, ``megatron.core`` and ``megatron.core.datasets`` are provided as empty
packages, so the nine modules import under megatron's names anyway.

Order matters: a module that imported megatron's own ``GPTDataset`` before the patch keeps it.
``patch_megatron()`` therefore refuses (:class:`MegatronImportOrderError`, naming them) when
megatron's implementations of the nine modules are already imported *and used*: some other
module holds one of their classes or functions, or a class derives from one. Imported but
unused ones are dropped from ``sys.modules`` and replaced. ``python -m tokenmill.megatron
SCRIPT ARGS...`` (see ``__main__``) patches before the script runs, and composes with
``torchrun --module``.

Processes started with the ``spawn`` or ``forkserver`` method (DataLoader workers on some
platforms, ``torch.multiprocessing.spawn``) re-import the main module before anything else: the
patch travels with them, as an object in multiprocessing's preparation data whose unpickling
patches the child before its main module runs. ``fork`` children inherit the patched
``sys.modules``.

Cost: the hook is one dict lookup per import; patching imports nothing heavy (the nine modules
load when first imported, like megatron's).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

from tokenmill.common.megatron_version import follow_installed
from tokenmill.errors import TokenmillError

__all__ = ["MODULES", "MegatronImportOrderError", "is_patched", "patch_megatron"]

logger = logging.getLogger(__name__)

MODULES: tuple[str, ...] = (
    "indexed_dataset",
    "gpt_dataset",
    "blended_dataset",
    "blended_megatron_dataset_builder",
    "blended_megatron_dataset_config",
    "megatron_dataset",
    "utils",
    "helpers",
    "object_storage_utils",
)
"""The ``megatron.core.datasets`` modules tokenmill implements (and `patch_megatron` swaps)."""

_PACKAGE = "megatron.core.datasets"
_PARENTS = ("megatron", "megatron.core", _PACKAGE)
_ALIASES = {f"{_PACKAGE}.{name}": f"{__name__}.{name}" for name in MODULES}
_LOCK = threading.Lock()


class MegatronImportOrderError(TokenmillError, ImportError):
    """`patch_megatron()` was called after megatron's own dataset modules were imported and
    used: code already holds megatron's classes, which a patch can no longer replace."""


class _AliasLoader(importlib.abc.Loader):
    """Loads ``megatron.core.datasets.<name>`` as tokenmill's module object itself."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias spec on tokenmill's module; give it back its own
        # (importlib.reload, pickling by module name and `python -m` read it).
        module.__spec__ = self._spec


class _EmptyPackageLoader(importlib.abc.Loader):
    """An empty package standing in for ``megatron`` / ``megatron.core`` /
    ``megatron.core.datasets`` when megatron-core is not installed."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = (
            "Provided by tokenmill.patch_megatron(): megatron-core is not installed, so only "
            f"{_PACKAGE}.{{{', '.join(MODULES)}}} (tokenmill's) can be imported here."
        )


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """The import hook `patch_megatron` installs at the front of ``sys.meta_path``."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        alias = _ALIASES.get(fullname)
        if alias is not None:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(alias))
        if fullname in _PARENTS and not self._found_elsewhere(fullname, path, target):
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackageLoader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None

    def _found_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None
    ) -> bool:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            if finder.find_spec(fullname, path, target) is not None:
                return True
        return False


_FINDER = _MegatronFinder()


def is_patched() -> bool:
    """Whether `patch_megatron` is active in this process."""
    return _FINDER in sys.meta_path


def patch_megatron() -> None:
    """Make ``megatron.core.datasets.<module>`` import tokenmill's module, for every module in
    `MODULES` (idempotent; works whether megatron-core is installed or not).

    Call it first thing, before anything imports megatron's datasets (Megatron-LM's training
    scripts do at their top), or run the script with ``python -m tokenmill.megatron``.

    Raises:
        MegatronImportOrderError: megatron's own versions of those modules were imported and are
            used already (the message names the modules and what uses them).
    """
    with _LOCK:
        if is_patched():
            return
        _drop_unused_megatron_modules()
        follow_installed()
        sys.meta_path.insert(0, _FINDER)
        _patch_spawned_children()
    logger.debug("megatron.core.datasets.{%s} now import tokenmill's", ", ".join(MODULES))


def _drop_unused_megatron_modules() -> None:
    """Remove megatron's already-imported versions of the nine modules when nothing uses them.

    Raises:
        MegatronImportOrderError: something uses them.
    """
    theirs = {
        name: module
        for name, module in sys.modules.items()
        if name in _ALIASES and module is not None and module.__name__ == name
    }
    if not theirs:
        return
    users = _users_of(theirs)
    if users:
        raise MegatronImportOrderError(
            "tokenmill.patch_megatron() must run before megatron's dataset modules are used, "
            f"but {', '.join(sorted(theirs))} (megatron-core's) were imported and are used by "
            f"{', '.join(users[:10])}{' ...' if len(users) > 10 else ''}. Call "
            "tokenmill.patch_megatron() before any megatron import, or run the script as "
            "`python -m tokenmill.megatron SCRIPT ARGS...`."
        )
    parent = sys.modules.get(_PACKAGE)
    for name in theirs:
        del sys.modules[name]
        child = name.rpartition(".")[2]
        if parent is not None and getattr(parent, child, None) is theirs[name]:
            delattr(parent, child)
    logger.info("replaced megatron's unused %s with tokenmill's", ", ".join(sorted(theirs)))


def _users_of(modules: dict[str, types.ModuleType]) -> list[str]:
    """Modules outside `modules` that hold one of their classes or functions, and classes that
    derive from one of their classes."""
    defined: dict[int, str] = {}
    classes: list[type] = []
    for name, module in modules.items():
        for value in vars(module).values():
            if getattr(value, "__module__", None) == name and (
                isinstance(value, type) or callable(value)
            ):
                defined[id(value)] = f"{name}.{getattr(value, '__qualname__', '?')}"
                if isinstance(value, type):
                    classes.append(value)
    users: list[str] = []
    for name, module in list(sys.modules.items()):
        if module is None or name in modules:
            continue
        try:
            values = list(vars(module).values())
        except TypeError:
            continue
        held = sorted({defined[id(value)] for value in values if id(value) in defined})
        if held:
            users.append(f"{name} ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})")
    seen: set[int] = set()
    while classes:
        cls = classes.pop()
        subclass: type
        for subclass in type.__subclasses__(cls):
            if id(subclass) in seen:
                continue
            seen.add(id(subclass))
            classes.append(subclass)
            if subclass.__module__ not in modules:
                users.append(f"class {subclass.__module__}.{subclass.__qualname__}")
    return users


class _PatchOnUnpickle:
    """Carried in multiprocessing's preparation data: unpickling it in a spawned child patches
    the child before the child imports the parent's main module."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (patch_megatron, ())


def _patch_spawned_children() -> None:
    """Add a `_PatchOnUnpickle` to the preparation data multiprocessing sends to every child it
    spawns (``spawn`` and ``forkserver`` start methods), so children import tokenmill's modules
    too. Preparation data is a dict its consumer reads by known keys; an extra key is unpickled
    (patching the child) and otherwise ignored."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "_tokenmill_patch", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        data["tokenmill_patch_megatron"] = _PatchOnUnpickle()
        return data

    get_preparation_data._tokenmill_patch = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data
