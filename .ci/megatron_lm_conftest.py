"""Root conftest for Megatron-LM's own tests/unit_tests/data, run by .ci/megatron-lm-tests.

Copied next to the extracted tests of one Megatron-LM branch (a scratch folder outside the repo),
it runs them on a CPU machine as a single gloo rank, on stock megatron-core (TOKENMILL_STOCK=1)
or under tokenmill.patch_megatron(). Nothing here changes what a test asserts.
"""

import inspect
import json
import os
import re
import typing

import typing_extensions

if not hasattr(typing, "override"):  # megatron.training uses Python 3.12's typing.override
    typing.override = typing_extensions.override  # type: ignore[attr-defined]

if os.environ.get("TOKENMILL_STOCK") != "1":
    import tokenmill

    tokenmill.patch_megatron()

import torch
import torch.distributed

# the tests place one rank on a GPU; here it is one CPU rank over gloo
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *args, **kwargs: None
_init_process_group = torch.distributed.init_process_group


def _gloo_process_group(*args, **kwargs):  # type: ignore[no-untyped-def]
    kwargs["backend"] = "gloo"
    kwargs.pop("device_id", None)
    return _init_process_group(*args, **kwargs)


torch.distributed.init_process_group = _gloo_process_group
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")

# without transformer-engine, megatron-core 0.16's get_te_version() is None, which
# tests/unit_tests/conftest.py's autouse is_te_min_version("1.3") cannot compare: 0.0.0, as
# later releases report a missing transformer-engine
import megatron.core.utils as _core_utils  # noqa: E402
from packaging.version import Version  # noqa: E402

if _core_utils.get_te_version() is None:
    _core_utils._te_version = Version("0.0.0")

if os.environ.get("TOKENMILL_STOCK") == "1":
    # a wheel ships the compiled helpers and no Makefile; megatron's compile_helpers would run make
    import megatron.core.datasets.utils as _megatron_utils

    _megatron_utils.compile_helpers = lambda: None


_CI_DATA = re.compile(r"/opt/data/[\w./-]+")


def _missing_ci_data(item) -> list[str]:  # type: ignore[no-untyped-def]
    """The files of Megatron-LM's CI machines (/opt/data/...) a test reads and this machine lacks."""
    function = getattr(item, "function", None)
    if function is None:
        return []
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return []
    return sorted({path for path in _CI_DATA.findall(source) if not os.path.exists(path)})


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    # A test that reads Megatron-LM CI's tokenizer or data files cannot pass here on stock either:
    # deselected, by name and with its reason in the report (TOKENMILL_DESELECTED, a JSON file).
    # Run, the preprocess tests hang: their multiprocessing.Pool's workers fail in the
    # initializer (no tokenizer) and the Pool starts new ones forever.
    kept, deselected = [], {}
    for item in items:
        missing = _missing_ci_data(item)
        if missing:
            deselected[item.nodeid] = (
                "reads Megatron-LM CI's " + ", ".join(missing) + " (absent here)"
            )
        else:
            kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in deselected])
        items[:] = kept
    if os.environ.get("TOKENMILL_DESELECTED"):
        with open(os.environ["TOKENMILL_DESELECTED"], "w") as listing:
            json.dump(deselected, listing, indent=1, sort_keys=True)
