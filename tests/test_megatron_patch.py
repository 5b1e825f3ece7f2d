"""`patch_megatron()` and `python -m tokenmill.megatron`: Megatron's own code on tokenmill.

Patching is process-global, so every check runs in a fresh subprocess. The two big ones run
tests/megatron_driver.py (megatron-core's MockGPTDataset and multimodal subclass, Megatron-LM's
FIM dataset and data loader, BERT, an in-house subclass, the offline cache build of
tools/prepare_cache.py followed by a fast_cache_load + defer_npy_index_mmap run) once on stock
megatron-core and once through `python -m tokenmill.megatron`, side by side, and compare every
sample, batch, length and cache file. The others are small: patching without megatron-core,
refusing after megatron's modules were used, the runner's command line.

Cost: the two driver processes import megatron-core and megatron.training (about 10-20 s each on
the 2-core dev VM, run concurrently), one more imports megatron-core (~5 s); the rest are cheap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import random_documents, write_megatron_shard
from oracles import import_oracle

pytestmark = pytest.mark.megatron

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import_oracle("megatron.core.datasets.gpt_dataset")
    pytest.importorskip("typing_extensions")

from tokenmill.formats.megatron import IndexedDatasetBuilder

TESTS = Path(__file__).parent
DRIVER = TESTS / "megatron_driver.py"


def _environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment["PYTHONWARNINGS"] = "ignore"
    environment["OMP_NUM_THREADS"] = "1"
    return environment


def _prepare(workdir: Path) -> None:
    """The corpora the driver reads (token ids below 256: its byte tokenizer's range)."""
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(17)
    prefixes = {}
    for name, count in (("a", 70), ("b", 90)):
        prefixes[name] = write_megatron_shard(
            workdir / name, random_documents(rng, count, 80, vocab_size=256)
        )
    text = []
    for _ in range(60):
        words = [
            bytes(rng.integers(97, 123, int(rng.integers(2, 8)))).decode()
            for _ in range(int(rng.integers(3, 20)))
        ]
        text.append([*" ".join(words).encode(), 0])
    prefixes["text"] = write_megatron_shard(workdir / "text", text)
    builder = IndexedDatasetBuilder(str(workdir / "sentences.bin"), dtype=np.uint16)
    for _ in range(80):  # documents of 2-5 sentences, for BERT's sentence pairs
        lengths = rng.integers(3, 12, int(rng.integers(2, 6)))
        builder.add_document(rng.integers(1, 256, int(lengths.sum())), lengths.tolist())
    builder.finalize(str(workdir / "sentences.idx"))
    prefixes["sentences"] = str(workdir / "sentences")
    (workdir / "prefixes.json").write_text(json.dumps(prefixes))


@pytest.fixture(scope="module")
def driver_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Stock megatron-core and the runner, concurrently, over the same corpora."""
    workdir = tmp_path_factory.mktemp("megatron-driver")
    _prepare(workdir)
    commands = {
        "stock": [sys.executable, str(DRIVER), "stock"],
        "runner": [sys.executable, "-m", "tokenmill.megatron", str(DRIVER), "runner"],
    }
    processes = {}
    for mode, command in commands.items():
        out = workdir / f"{mode}.pt"
        processes[mode] = (
            subprocess.Popen(
                [*command, str(workdir), str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_environment(),
            ),
            out,
        )
    results = {}
    try:
        for mode, (process, out) in processes.items():
            _, stderr = process.communicate(timeout=900)
            assert process.returncode == 0, f"{mode} driver failed:\n{stderr[-4000:]}"
            results[mode] = torch.load(out, weights_only=False)
    finally:
        for process, _ in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Deep equality: same structure, and tensors / arrays of the same dtype, shape, values."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {type(ours)}"
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, (np.ndarray, np.generic)):
        assert np.asarray(ours).dtype == np.asarray(theirs).dtype, where
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{where}: keys"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{where}: length"
        for number, (mine, reference) in enumerate(zip(ours, theirs)):
            assert_same(mine, reference, f"{where}[{number}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


COMPARED = (
    "spawn_batches",  # a DataLoader worker started with "spawn" (the patch travels with it)
    "mock",
    "mock_lengths",
    "multimodal",
    "multimodal_batch",
    "fim",
    "fim_batch",
    "reversed",
    "reversed_loader",
    "loader",
    "bert",
    "prepared_lengths",
    "prepared_files",
    "fast_lengths",
    "fast",
    "fast_files",
)


@pytest.mark.parametrize("name", COMPARED)
def test_megatron_code_on_tokenmill_matches_stock(
    driver_runs: dict[str, dict[str, Any]], name: str
) -> None:
    assert_same(driver_runs["runner"][name], driver_runs["stock"][name], name)


def test_megatron_modules_subclass_tokenmills_classes(
    driver_runs: dict[str, dict[str, Any]],
) -> None:
    stock, runner = driver_runs["stock"], driver_runs["runner"]
    assert stock["gpt_dataset_class"] == "megatron.core.datasets.gpt_dataset.GPTDataset"
    assert runner["gpt_dataset_class"] == "tokenmill.datasets.gpt.GPTDataset"
    assert runner["multimodal_mro"][:3] == [
        "megatron.core.datasets.multimodal_dataset.MockMultimodalDataset",
        "tokenmill.datasets.gpt.MockGPTDataset",
        "tokenmill.datasets.gpt.GPTDataset",
    ]
    assert runner["fim_mro"][:2] == [
        "megatron.training.datasets.fim_dataset.GPTFIMDataset",
        "tokenmill.datasets.gpt.GPTDataset",
    ]
    assert runner["bert_mro"][:3] == [
        "megatron.core.datasets.bert_dataset.BERTMaskedWordPieceDataset",
        "megatron.core.datasets.masked_dataset.MaskedWordPieceDataset",
        "tokenmill.datasets.megatron_dataset.MegatronDataset",
    ]
    assert runner["patched"] is True
    assert runner["prepared_files"], "the offline build wrote no cache"


def _run(code: str, tmp_path: Path, *args: str, hide_megatron: bool = False) -> str:
    """Run `code` in a fresh interpreter (optionally with megatron made unfindable, as if it
    were not installed) and return its stdout."""
    prelude = ""
    if hide_megatron:
        prelude = textwrap.dedent(
            """
            import importlib.machinery, sys

            class _Hidden(importlib.machinery.PathFinder):
                @classmethod
                def find_spec(cls, name, path=None, target=None):
                    if name == "megatron" or name.startswith("megatron."):
                        return None
                    return super().find_spec(name, path, target)

            sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = _Hidden
            """
        )
    script = tmp_path / "script.py"
    script.write_text(prelude + textwrap.dedent(code))
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=_environment(),
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_patch_works_without_megatron(tmp_path: Path) -> None:
    output = _run(
        """
        import importlib, sys
        try:
            import megatron
        except ImportError:
            print("megatron hidden")
        import tokenmill
        tokenmill.patch_megatron()
        tokenmill.patch_megatron()  # idempotent
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets import indexed_dataset, helpers, utils
        import megatron.core.datasets.blended_megatron_dataset_builder as builder
        assert GPTDataset is tokenmill.GPTDataset
        assert indexed_dataset.IndexedDataset is tokenmill.IndexedDataset
        assert builder.BlendedMegatronDatasetBuilder is tokenmill.BlendedMegatronDatasetBuilder
        assert utils.compile_helpers() is None
        assert sys.modules["megatron.core.datasets.gpt_dataset"] is sys.modules[
            "tokenmill.megatron.gpt_dataset"]
        assert sys.modules["tokenmill.megatron.gpt_dataset"].__spec__.name == (
            "tokenmill.megatron.gpt_dataset")
        try:
            helpers.build_mapping()
        except NotImplementedError as error:
            print("build_mapping:", error)
        try:
            import megatron.core.datasets.bert_dataset
        except ModuleNotFoundError:
            print("bert is megatron's, absent")
        print("torch" in sys.modules)
        """,
        tmp_path,
        hide_megatron=True,
    )
    assert "megatron hidden" in output
    assert "install megatron-core" in output
    assert "bert is megatron's, absent" in output
    assert output.strip().endswith("False")  # patching imported no torch


def test_patch_refuses_after_megatron_modules_are_used(tmp_path: Path) -> None:
    output = _run(
        """
        import gc, sys
        import megatron.core.datasets.gpt_dataset as megatron_gpt

        class InHouse(megatron_gpt.GPTDataset):
            pass

        import tokenmill
        from tokenmill.megatron import MegatronImportOrderError
        try:
            tokenmill.patch_megatron()
        except MegatronImportOrderError as error:
            print("refused:", error)
        assert not tokenmill.megatron.is_patched()
        del InHouse, megatron_gpt
        gc.collect()
        tokenmill.patch_megatron()  # imported but unused now: replaced
        from megatron.core.datasets.gpt_dataset import GPTDataset
        from megatron.core.datasets import gpt_dataset
        assert GPTDataset is tokenmill.GPTDataset and gpt_dataset.GPTDataset is GPTDataset
        print("replaced")
        """,
        tmp_path,
    )
    assert "refused: tokenmill.patch_megatron() must run before" in output
    assert "megatron.core.datasets.gpt_dataset" in output
    assert "class __main__.InHouse" in output
    assert "python -m tokenmill.megatron" in output
    assert output.strip().endswith("replaced")


def test_runner_runs_scripts_and_modules(tmp_path: Path) -> None:
    (tmp_path / "train_script.py").write_text(
        textwrap.dedent(
            """
            import sys
            import tokenmill.megatron as tm
            finder = sys.meta_path[0]
            spec = finder.find_spec("megatron.core.datasets.gpt_dataset", None)
            print(tm.is_patched(), type(spec.loader).__name__, __name__, sys.argv)
            """
        )
    )
    environment = _environment()
    script = subprocess.run(
        [sys.executable, "-m", "tokenmill.megatron", "train_script.py", "--lr", "3"],
        capture_output=True, text=True, cwd=tmp_path, env=environment, check=True,
    )  # fmt: skip
    assert script.stdout.split() == [
        "True", "_AliasLoader", "__main__", "['train_script.py',", "'--lr',", "'3']",
    ]  # fmt: skip
    module = subprocess.run(
        [sys.executable, "-m", "tokenmill.megatron", "-m", "train_script", "x"],
        capture_output=True, text=True, cwd=tmp_path, env=environment, check=True,
    )  # fmt: skip
    assert module.stdout.startswith("True _AliasLoader __main__")
    assert module.stdout.strip().endswith("'x']")
    for arguments, expected in (
        ([], "usage: python -m tokenmill.megatron"),
        (["nope.py"], "nope.py"),
    ):
        failed = subprocess.run(
            [sys.executable, "-m", "tokenmill.megatron", *arguments],
            capture_output=True, text=True, cwd=tmp_path, env=environment, check=False,
        )  # fmt: skip
        assert failed.returncode == 2 and expected in failed.stderr
