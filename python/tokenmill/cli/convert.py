"""``tokenmill convert SRC DST --to megatron|nanogpt|npy|olmo``: lossless conversion between layouts.

Tokens are copied exactly (a token that does not fit the target dtype is an error, never a
wrap-around) in chunks of ``--chunk-tokens``, so memory stays constant whatever the size.
Documents survive when the source knows them: Megatron's index, a shard's ``.bos.idx`` or a
``--bos-token`` / ``--eos-token`` split (see ``tokenmill inspect``); otherwise every source shard
becomes one Megatron document. Every output file is written atomically.

Targets: ``megatron`` writes ``DST.bin`` / ``DST.idx`` (uint32 sources become int32, as Megatron
has no uint32 code); ``nanogpt`` writes ``DST/<shard>.bin`` (uint16 with modded-nanogpt's magic,
or uint32 with NeMo's) plus ``.bos.idx`` when BOS positions are known; ``npy`` writes
``DST/<shard>.npy`` in the source dtype; ``olmo`` writes OLMo-core's layout, ``DST/<shard>.npy``
holding headerless little-endian tokens (unsigned: int32 sources become uint32) plus the
``tokenmill.json`` sidecar naming the dtype (OLMo-core takes it from its config:
``NumpyDatasetConfig(dtype=...)``). A nanogpt shard holds at most ``--shard-tokens`` tokens
(default 10**8, as fineweb's shards; never more than modded-nanogpt's loader reads in its one
``readinto``, 2**31 - 4096 bytes); larger sources are split into ``<shard>_000000.bin``,
``<shard>_000001.bin``, ...

Dtypes: ``--input-dtype`` is the dtype of headerless sources (raw ``.bin``, OLMo-core's ``.npy``),
``--output-dtype`` the dtype written (Megatron, ``.npy``, OLMo-core; uint16 or uint32 for
nanogpt). ``--dtype`` sets both where each applies: the source's when it is headerless, and the
output's. ``--bos-token`` must fit the source dtype and occur in the data (a wrong id is refused,
not written as one giant document); it also rebuilds every ``.bos.idx`` from the tokens, so a
broken or foreign index (NeMo's ``nanogpt_data_processor.py`` stores byte offsets) is repaired
instead of refused.

SRC and DST may be ``s3://`` URLs: a source is fetched once into the local object cache (a
conversion reads every token anyway), an output is written to a local staging path and uploaded
(data first, indices last; see ``tokenmill.storage.staging``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokenmill.common.progress import Progress

EPILOG = """\
examples:
  tokenmill convert data/corpus_text_document out/nanogpt --to nanogpt --bos-token 50256
  tokenmill convert out/nanogpt out/corpus --to megatron
  tokenmill convert data/fineweb_train_000001.bin out/npy --to npy
  tokenmill convert data/corpus_text_document out/olmo --to olmo       # OLMo-core's token files
  tokenmill convert raw_tokens.bin out/corpus --to megatron --dtype uint16
  tokenmill convert nemo_out/ repaired/ --to nanogpt --bos-token 50256  # rebuilds .bos.idx
  tokenmill convert s3://bucket/corpus_text_document s3://bucket/nanogpt --to nanogpt \\
      --bos-token 50256
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert token shards between Megatron, modded-nanogpt, .npy and OLMo-core layouts",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="Megatron prefix, nanogpt .bin, .npy file, or a directory")
    parser.add_argument("dst", help="Megatron prefix (--to megatron) or an output directory")
    parser.add_argument("--to", required=True, choices=("megatron", "nanogpt", "npy", "olmo"))
    parser.add_argument(
        "--bos-token", type=int, help="BOS id: document starts, a .bos.idx rebuilt from the tokens"
    )
    parser.add_argument("--eos-token", type=int, help="EOS id: documents end after it")
    parser.add_argument(
        "--dtype",
        help="sets --input-dtype (headerless sources) and --output-dtype where each applies",
    )
    parser.add_argument(
        "--input-dtype", help="dtype of headerless sources (raw .bin, OLMo-core .npy)"
    )
    parser.add_argument("--output-dtype", help="dtype written (nanogpt: uint16 or uint32)")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        help="tokens per nanogpt shard [10**8; at most 2**31 - 4096 bytes of tokens]",
    )
    parser.add_argument("--chunk-tokens", type=int, default=1 << 24, help=argparse.SUPPRESS)
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or lines")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.errors import DataFormatError, ObjectStorageError

    try:
        if not args.dst.startswith("s3://"):
            return _convert(args)
        # write into a local staging path, then upload (tokenmill.storage.staging)
        from tokenmill.storage.staging import (
            remove_staged_prefix,
            staged_path,
            upload_directory,
            upload_prefix,
        )

        target = args.dst
        args.dst = staged_path(target)
        remove_staged_prefix(args.dst)  # leftovers of a killed run are not this run's output
        status = _convert(args)
        if status == 0:
            if args.to == "megatron":
                upload_prefix(args.dst, target)
            else:
                upload_directory(args.dst, target)
        remove_staged_prefix(args.dst)
        return status
    except (DataFormatError, ObjectStorageError, FileNotFoundError, ValueError) as error:
        print(f"tokenmill convert: error: {error}", file=sys.stderr)
        return 1


def _convert(args: argparse.Namespace) -> int:
    from tokenmill.common.ownership import OutputBusyError, own_output
    from tokenmill.errors import DataFormatError, ObjectStorageError
    from tokenmill.formats.sources import open_source

    try:
        if args.src.startswith("s3://"):
            from tokenmill.storage.staging import fetch_source

            args.src = fetch_source(args.src)  # a full pass reads everything: fetch it once
        input_dtype = args.input_dtype or args.dtype
        source = open_source(
            args.src,
            input_dtype,
            ignore_bos_index=args.bos_token is not None,
            check_header_dtype=args.input_dtype is not None,
        )
        _check_bos_token(source, args.bos_token)
        # one writer per output: a second convert (or tokenize) to the same DST gets a clear
        # "being written by another tokenmill (pid, host)" error instead of mixing outputs
        with (
            own_output(args.dst),
            Progress(
                "convert", total=source.token_count, unit="tok", unit_scale=True,
                enabled=not args.quiet,
            ) as progress,
        ):  # fmt: skip
            if args.to == "megatron":
                _to_megatron(source, args, progress)
            elif args.to == "nanogpt":
                _to_nanogpt(source, args, progress)
            elif args.to == "olmo":
                _to_olmo(source, args, progress)
            else:
                _to_npy(source, args, progress)
    except (
        OutputBusyError,
        DataFormatError,
        ObjectStorageError,
        OverflowError,
        FileNotFoundError,
        PermissionError,
        ValueError,
        TypeError,
    ) as error:
        hint = ""
        if isinstance(error, DataFormatError) and ".bos.idx" in str(error):
            hint = " (pass --bos-token ID to rebuild the .bos.idx from the tokens)"
        print(f"tokenmill convert: error: {error}{hint}", file=sys.stderr)
        return 1
    return 0


def _output_dtype(args: argparse.Namespace) -> Any:
    import numpy as np

    name = args.output_dtype or args.dtype
    return None if name is None else np.dtype(name)


def _check_bos_token(source: Any, bos_token: int | None) -> None:
    """Refuse a ``--bos-token`` that cannot be in the data: negative, beyond the source dtype, or
    absent from every token (a wrong id would make the whole source one document).

    Raises:
        ValueError: naming the value, the dtype or the source.
    """
    if bos_token is None:
        return
    import numpy as np

    from tokenmill.formats.token_scan import count_token

    dtype = source.dtype
    info = np.iinfo(dtype)
    if not info.min <= bos_token <= info.max or bos_token < 0:
        raise ValueError(
            f"--bos-token {bos_token} cannot occur in {source.path}: its tokens are {dtype.name} "
            f"(ids 0..{info.max})"
        )
    if source.token_count and not any(
        count_token(shard.tokens, bos_token) for shard in source.shards
    ):
        raise ValueError(
            f"--bos-token {bos_token} does not occur in {source.path} ({source.token_count} "
            "tokens): the data has no BOS token with that id; check the id (tokenmill inspect "
            "shows the first tokens)"
        )


def _chunks(total: int, size: int) -> Any:
    for start in range(0, total, size):
        yield start, min(total, start + size)


def _to_megatron(source: Any, args: argparse.Namespace, progress: Progress) -> None:
    import numpy as np

    from tokenmill.formats.megatron import DType, IndexedDatasetBuilder
    from tokenmill.formats.sources import document_lengths

    dtype = _output_dtype(args) or source.dtype
    if dtype == np.dtype(np.uint32) and args.output_dtype is None:
        dtype = np.dtype(np.int32)  # Megatron has no uint32 code; values are range-checked
    DType.code_from_dtype(dtype)
    prefix = args.dst
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    try:
        for shard in source.shards:
            lengths, _ = document_lengths(shard, args.bos_token, args.eos_token)
            count = int(shard.tokens.shape[0])
            if lengths is None:
                lengths = np.array([count] if count else [], dtype=np.int64)
            ends = np.cumsum(lengths)
            first = 0  # first document not yet written
            while first < lengths.shape[0]:
                start = int(ends[first] - lengths[first])
                # documents up to chunk_tokens (at least one)
                last = max(
                    first + 1, int(np.searchsorted(ends, start + args.chunk_tokens, "right"))
                )
                end = int(ends[last - 1])
                builder.add_documents(shard.tokens[start:end], lengths[first:last])
                progress.update(end - start)
                first = last
        builder.finalize(prefix + ".idx")
    except BaseException:
        del builder  # removes its temporary file
        raise


def _to_nanogpt(source: Any, args: argparse.Namespace, progress: Progress) -> None:
    import numpy as np

    from tokenmill.formats.bos_index import bos_index_path, write_bos_index
    from tokenmill.formats.nanogpt import NanogptShardWriter, shard_token_cap

    os.makedirs(args.dst, exist_ok=True)
    allowed = (np.dtype(np.uint16), np.dtype(np.uint32))
    dtype = _output_dtype(args)
    if dtype is not None and dtype not in allowed and args.output_dtype is None:
        dtype = None  # --dtype named the source's dtype, which a nanogpt shard cannot hold
    if dtype is None:
        # uint16 when the source's tokens are 2 bytes or fewer; wider ones are range-checked
        dtype = allowed[0] if source.dtype.itemsize <= 2 else allowed[1]
    if dtype not in allowed:
        raise ValueError(f"--output-dtype for nanogpt shards is uint16 or uint32, got {dtype}")
    cap = shard_token_cap(dtype, args.shard_tokens)
    for shard in source.shards:
        count = int(shard.tokens.shape[0])
        pieces = list(_chunks(count, cap)) or [(0, 0)]
        for number, (low, high) in enumerate(pieces):
            name = shard.name if len(pieces) == 1 else f"{shard.name}_{number:06d}"
            path = os.path.join(args.dst, name + ".bin")
            writer = NanogptShardWriter(path, dtype, bos_token=args.bos_token)
            try:
                for start, end in _chunks(high - low, args.chunk_tokens):
                    writer.write(shard.tokens[low + start : low + end])
                    progress.update(end - start)
                writer.finalize()
            except BaseException:
                writer.abort()
                raise
            if args.bos_token is None and shard.bos_positions is not None:
                positions = np.asarray(shard.bos_positions, dtype=np.int64)
                inside = positions[(positions >= low) & (positions < high)] - low
                write_bos_index(bos_index_path(path), inside, token_count=high - low)


def _to_olmo(source: Any, args: argparse.Namespace, progress: Progress) -> None:
    import numpy as np

    from tokenmill.formats.token_dir import RawTokenWriter, write_raw_metadata

    dtype = _output_dtype(args) or source.dtype
    if dtype.kind == "i" and args.output_dtype is None:
        # OLMo-core reads unsigned tokens: int32 (Megatron's code 4) -> uint32, range-checked
        dtype = np.dtype(f"uint{dtype.itemsize * 8}")
    if dtype.kind != "u" or dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"OLMo-core reads uint8/16/32/64 tokens, --output-dtype is {dtype}")
    os.makedirs(args.dst, exist_ok=True)
    for shard in source.shards:
        count = int(shard.tokens.shape[0])
        writer = RawTokenWriter(os.path.join(args.dst, shard.name + ".npy"), dtype)
        try:
            for start, end in _chunks(count, args.chunk_tokens):
                writer.write(shard.tokens[start:end])
                progress.update(end - start)
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
    write_raw_metadata(args.dst, dtype)  # last: the directory is complete when it appears


def _to_npy(source: Any, args: argparse.Namespace, progress: Progress) -> None:
    from tokenmill.formats.bos_index import bos_index_path, write_bos_index
    from tokenmill.formats.token_dir import NpyShardWriter

    os.makedirs(args.dst, exist_ok=True)
    for shard in source.shards:
        count = int(shard.tokens.shape[0])
        path = os.path.join(args.dst, shard.name + ".npy")
        dtype = _output_dtype(args) or shard.tokens.dtype.newbyteorder("=")
        writer = NpyShardWriter(path, dtype, count)
        try:
            for start, end in _chunks(count, args.chunk_tokens):
                writer.write(shard.tokens[start:end])
                progress.update(end - start)
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
        if args.bos_token is not None:  # rebuilt from the tokens
            from tokenmill.formats.token_scan import find_token_positions

            positions = find_token_positions(shard.tokens, args.bos_token)
            write_bos_index(bos_index_path(path), positions, token_count=count)
        elif shard.bos_positions is not None:  # keep the BOS index beside the .npy
            write_bos_index(bos_index_path(path), shard.bos_positions, token_count=count)
