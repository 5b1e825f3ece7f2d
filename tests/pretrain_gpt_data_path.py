"""Megatron-LM pretrain_gpt.py's data path, one rank of a torchrun job, stock or under
patch_megatron.

Run by tests/test_raw_text.py and tests/test_megatron_logs.py as::

    python -m torch.distributed.run --nproc-per-node N tests/pretrain_gpt_data_path.py OUT \
        [--offline-data-path 30 PREFIX0 70 PREFIX1] <pretrain_gpt.py's arguments>

with ``TOKENMILL_STOCK=1`` in the environment for stock megatron-core (no patch).

The arguments are pretrain_gpt.py's own, parsed and validated by megatron.training's
``parse_args``/``validate_args``; the tokenizer is megatron-core's ``build_tokenizer(args)``
(``--tokenizer-type HuggingFaceTokenizer`` loads transformers' AutoTokenizer from the local
directory). Then what pretrain_gpt.py's ``train_valid_test_datasets_provider`` does (the blend from
``get_blend_and_blend_per_split``, a GPTDatasetConfig from the arguments,
``BlendedMegatronDatasetBuilder(GPTDataset, ...)``), called through megatron.training's
``build_train_valid_test_datasets`` (the sample counts from --train-iters/--eval-iters), and
each split's ``build_pretraining_data_loader``. (megatron.training's
``build_train_valid_test_data_loaders`` is not used: it broadcasts flags on a CUDA tensor.)

It runs over the command line's ``--data-path`` and, when given, again over
``--offline-data-path`` (e.g. raw jsonl files, then the same files preprocessed by ``tokenmill
tokenize``), in the one process group, and writes to ``OUT/<rank>.json`` each run's batches
(hashed), the records of megatron-core's dataset loggers (``megatron.core.datasets.*``: logger,
level, message) and every warning raised (category, message, file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import typing
import warnings
from typing import Any

if not hasattr(typing, "override"):  # megatron.training needs Python 3.12's typing.override
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]


def extra_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tokenmill test")
    group.add_argument("--offline-data-path", nargs="*", default=None)
    return parser


def main() -> None:
    out = sys.argv.pop(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if os.environ.get("TOKENMILL_STOCK") != "1":
        import tokenmill

        tokenmill.patch_megatron()

    import torch
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.global_vars import get_args, set_global_variables
    from megatron.training.training import build_train_valid_test_datasets
    from megatron.training.utils import get_blend_and_blend_per_split

    torch.distributed.init_process_group("gloo")
    args = parse_args(extra_arguments)
    args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel()

    def provider(samples: list[int]) -> Any:
        args = get_args()
        blend, blend_per_split = get_blend_and_blend_per_split(args)
        config = GPTDatasetConfig(
            random_seed=args.seed,
            sequence_length=args.seq_length,
            blend=blend,
            blend_per_split=blend_per_split,
            split=args.split,
            path_to_cache=args.data_cache_path,
            mmap_bin_files=args.mmap_bin_files,
            tokenizer=build_tokenizer(args),
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss,
            create_attention_mask=args.create_attention_mask_in_dataloader,
        )
        return BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()

    class Recorder(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: list[tuple[str, int, str]] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append((record.name, record.levelno, record.getMessage()))

    def batches() -> dict[str, Any]:
        recorder = Recorder()
        datasets_logger = logging.getLogger("megatron.core.datasets")
        datasets_logger.addHandler(recorder)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train, valid, _ = build_train_valid_test_datasets(provider)
                hashed: list[str] = []
                for dataset in (train, valid):
                    for batch in build_pretraining_data_loader(dataset, 0):
                        digest = hashlib.sha256()
                        for name in sorted(batch):
                            digest.update(name.encode())
                            digest.update(batch[name].numpy().tobytes())
                        hashed.append(digest.hexdigest())
        finally:
            datasets_logger.removeHandler(recorder)
        return {
            "batches": hashed,
            "dataset_paths": [d.dataset_path for d in train.datasets],
            "log": recorder.lines,
            "warnings": [
                (w.category.__name__, str(w.message), os.path.basename(w.filename)) for w in caught
            ],
        }

    runs = {"raw": batches()}
    if args.offline_data_path is not None:
        args.data_path = args.offline_data_path
        args.data_cache_path = args.data_cache_path + "-offline"
        runs["offline"] = batches()
    with open(os.path.join(out, f"{args.rank}.json"), "w") as stream:
        json.dump(runs, stream)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
