"""The damaged-input cases of every on-disk format tokenmill reads (run by `tests/damage.py`).

Each function writes a small valid file of its format, reads it once for the reference, then
applies the generators of `damage.py` (plus swapped files and overlapping or misaligned entries
where the format has entries) and judges every case: a clean error naming the file (and a
field), or output identical to the undamaged file's.

Damage a format cannot see by construction is counted apart as ``undetectable`` and excluded:
token *contents* (no format tokenmill reads carries a checksum of its tokens; the data
fingerprint beside index caches catches such a change relative to a cache), and Megatron
document boundaries moved to another non-decreasing position (any such list is a valid index).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from damage import Field, Outcome, binary_damage, judge, text_damage

from conftest import write_megatron_shard

DOCUMENTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20]]


def _megatron_fields(sequences: int, documents: int) -> list[Field]:
    fields = [
        Field("magic", 0, 9),
        Field("version", 9, 8, "<Q"),
        Field("dtype code", 17, 1, "<B"),
        Field("sequence count", 18, 8, "<Q"),
        Field("document count", 26, 8, "<Q"),
    ]
    offset = 34
    fields += [Field(f"sequence_lengths[{i}]", offset + 4 * i, 4, "<i") for i in range(sequences)]
    offset += 4 * sequences
    fields += [Field(f"sequence_pointers[{i}]", offset + 8 * i, 8, "<q") for i in range(sequences)]
    offset += 8 * sequences
    fields += [Field(f"document_indices[{i}]", offset + 8 * i, 8, "<q") for i in range(documents)]
    return fields


def megatron(root: Path, outcome: Outcome) -> None:
    """Megatron .bin/.idx through every reader: IndexedDataset (mmap and pread), the megatron
    module's alias, inspect's open_source, and merge (builder.add_index): a merge of a damaged
    input must fail before any final-named output exists."""
    from tokenmill.formats.megatron import IndexedDataset, IndexedDatasetBuilder
    from tokenmill.formats.sources import open_source
    from tokenmill.megatron.indexed_dataset import IndexedDataset as MegatronAlias

    clean = write_megatron_shard(root / "clean", DOCUMENTS)
    idx = Path(clean + ".idx").read_bytes()
    data = Path(clean + ".bin").read_bytes()
    fields = _megatron_fields(len(DOCUMENTS), len(DOCUMENTS) + 1)
    words = (
        "sequence_lengths",
        "sequence_pointers",
        "document_indices",
        "magic",
        "version",
        "dtype code",
        "bytes",
        "header",
        "data file",
        "index",
    )

    def read(prefix: str, reader: Callable[..., Any], **options: Any) -> Any:
        dataset = reader(prefix, **options)
        return (
            np.dtype(dataset.index.dtype).name,
            [dataset[i].tolist() for i in range(len(dataset))],
            dataset.document_indices.tolist(),
        )

    reference = read(clean, IndexedDataset)
    cases: list[tuple[str, bytes, bytes]] = [(n, d, data) for n, d in binary_damage(idx, fields)]
    # overlapping and misaligned entries: pointer i moved back over i-1, or off the item grid
    pointer = 34 + 4 * len(DOCUMENTS)
    for i in range(1, len(DOCUMENTS)):
        for name, delta in (("overlapping", -2), ("misaligned", 1), ("gap", 2)):
            damaged = bytearray(idx)
            (value,) = struct.unpack_from("<q", damaged, pointer + 8 * i)
            struct.pack_into("<q", damaged, pointer + 8 * i, value + delta)
            cases.append((f"{name} sequence_pointers[{i}]", bytes(damaged), data))
    # the .bin truncated at every sequence boundary and extended
    for cut in sorted({len(data) - 1, len(data) // 2, 0, 2}):
        cases.append((f".bin truncated at byte {cut}", idx, data[:cut]))
    cases.append((".bin extended by 2 bytes", idx, data + b"\0\0"))
    # swapped files: another dataset's .idx
    other = write_megatron_shard(root / "other", [[1, 2], [3, 4, 5]])
    cases.append(("swapped .idx", Path(other + ".idx").read_bytes(), data))
    cases.append(("swapped .bin", idx, Path(other + ".bin").read_bytes()))

    merged_reference = root / "merged_reference"
    builder = IndexedDatasetBuilder(str(merged_reference) + ".bin", dtype=np.uint16)
    builder.add_index(clean)
    builder.finalize(str(merged_reference) + ".idx")

    for number, (label, damaged_idx, damaged_bin) in enumerate(cases):
        prefix = str(root / f"case{number}")
        Path(prefix + ".idx").write_bytes(damaged_idx)
        Path(prefix + ".bin").write_bytes(damaged_bin)
        names = (f"case{number}",)
        try:
            result = read(prefix, IndexedDataset)
        except Exception:
            result = None
        if result is not None and result != reference and _same_tokens(result, reference):
            outcome.undetectable += 1  # only document boundaries moved: still a valid index
            continue
        for reader, options in (
            (IndexedDataset, {}),
            (IndexedDataset, {"mmap": False}),
            (MegatronAlias, {}),
        ):
            judge(
                outcome,
                f"{label} [{reader.__module__} {options}]",
                lambda p=prefix, r=reader, o=options: read(p, r, **o),
                reference,
                names,
                words,
            )
        judge(
            outcome,
            f"{label} [inspect open_source]",
            lambda p=prefix: _source_tokens(open_source(p)),
            _flat(reference),
            names,
            words,
        )
        # merge: a damaged input fails before the output exists, or merges identically
        output = root / f"merged{number}"

        def merge(p: str = prefix, out: Path = output) -> bytes:
            merger = IndexedDatasetBuilder(str(out) + ".bin", dtype=np.uint16)
            merger.add_index(p)
            merger.finalize(str(out) + ".idx")
            return Path(str(out) + ".bin").read_bytes() + Path(str(out) + ".idx").read_bytes()

        expected = (
            Path(str(merged_reference) + ".bin").read_bytes()
            + Path(str(merged_reference) + ".idx").read_bytes()
        )
        judge(outcome, f"{label} [merge]", merge, expected, names, words)
        if not Path(str(output) + ".idx").exists() and Path(str(output) + ".bin").exists():
            outcome.bad.append(f"{label} [merge]: left a final-named .bin without .idx")


def _same_tokens(result: Any, reference: Any) -> bool:
    return bool(result[0] == reference[0] and _flat(result) == _flat(reference))


def _flat(result: Any) -> list[int]:
    return [token for sequence in result[1] for token in sequence]


def _source_tokens(source: Any) -> list[int]:
    return [int(t) for shard in source.shards for t in np.asarray(shard.tokens).tolist()]


def nanogpt(root: Path, outcome: Outcome) -> None:
    """modded-nanogpt shards: the 1024-byte header (magic, version, count) and the body length."""
    from tokenmill.formats.nanogpt import NanogptShard, write_nanogpt_shard

    tokens = np.arange(1, 41, dtype=np.uint16)
    clean = root / "clean.bin"
    write_nanogpt_shard(clean, tokens)
    raw = clean.read_bytes()
    fields = [Field(f"header[{i}]", 4 * i, 4, "<i") for i in range(4)]
    fields += [Field("tokens", 1024, len(raw) - 1024)]
    cases = [
        (label, damaged)
        for label, damaged in binary_damage(raw, fields)
        # token contents carry no checksum: flips inside the body are undetectable by design
        if not (label.startswith("bit") and "(tokens)" in label)
    ]
    cases.append(("body extended", raw + b"\0\0"))
    for number, (label, damaged) in enumerate(cases):
        path = root / f"case{number}.bin"
        path.write_bytes(damaged)
        judge(
            outcome,
            label,
            lambda p=path: NanogptShard(p).tokens.tolist(),
            tokens.tolist(),
            (path.name,),
            ("header", "token", "bytes", "magic", "version", "size"),
        )


def bos_index(root: Path, outcome: Outcome) -> None:
    """.bos.idx sidecars (int32 and int64 layouts) against their shard: read_bos_index plus the
    consistency check the nanogpt dataset runs (shifted, empty, partial, out of range)."""
    from tokenmill.formats.bos_index import check_bos_positions, read_bos_index, write_bos_index
    from tokenmill.formats.nanogpt import NanogptShard, write_nanogpt_shard

    bos = 1
    tokens = np.array([1, 5, 6, 1, 7, 1, 8, 9, 9, 1, 4], dtype=np.uint16)
    write_nanogpt_shard(root / "shard.bin", tokens)
    shard = NanogptShard(root / "shard.bin")
    positions = np.flatnonzero(tokens == bos)
    for wide in (False, True):
        clean = root / f"clean{int(wide)}.bos.idx"
        write_bos_index(clean, positions, token_count=len(tokens), bos_token=bos, wide=wide)
        raw = clean.read_bytes()
        if wide:
            fields = [
                Field("marker", 0, 4, "<i"),
                Field("magic", 4, 8),
                Field("version", 12, 4, "<I"),
                Field("count", 16, 8, "<q"),
                Field("bos token", 24, 8, "<q"),
            ]
            fields += [Field(f"position[{i}]", 32 + 8 * i, 8, "<q") for i in range(len(positions))]
        else:
            fields = [Field(f"position[{i}]", 4 * i, 4, "<i") for i in range(len(positions))]
        cases = list(binary_damage(raw, fields))
        # shifted by one token, by NeMo's 1024-byte header, and one entry dropped in the middle
        for label, moved in (
            ("shifted +1", positions + 1),
            ("byte offsets", positions + 1024),
            ("middle entry dropped", np.delete(positions, 2)),
        ):
            body = moved.astype("<i8" if wide else "<i4").tobytes()
            header = raw[:32] if wide else b""
            if wide:
                header = header[:16] + struct.pack("<q", len(moved)) + header[24:]
            cases.append((label, header + body))
        for number, (label, damaged) in enumerate(cases):
            path = root / f"case{int(wide)}_{number}.bos.idx"
            path.write_bytes(damaged)

            def read(p: Path = path) -> list[int]:
                found = read_bos_index(p, len(shard)).positions
                check_bos_positions(str(p), shard.tokens, found, bos)
                return [int(v) for v in found]

            if label == "middle entry dropped":
                # a missing middle entry is found only by a full scan: `inspect --bos-token`
                outcome.undetectable += 1
                continue
            judge(
                outcome,
                f"{'int64' if wide else 'int32'}: {label}",
                read,
                positions.tolist(),
                (path.name,),
                ("position", "bytes", "magic", "version", "header", "BOS", "count"),
            )


def npy_dir(root: Path, outcome: Outcome) -> None:
    """.npy token files (directories of them): header extent against the file size, dtype."""
    from tokenmill.formats.token_dir import open_token_file

    tokens = np.arange(3, 63, dtype=np.uint16)
    clean = root / "clean.npy"
    np.save(clean, tokens)
    raw = clean.read_bytes()
    (header_length,) = struct.unpack_from("<H", raw, 8)
    fields = [
        Field("magic", 0, 6),
        Field("version", 6, 2),
        Field("header length", 8, 2, "<H"),
        Field("header", 10, header_length),
        Field("tokens", 10 + header_length, 2 * 60),
    ]
    cases = [
        (label, damaged)
        for label, damaged in binary_damage(raw, fields)
        if not (label.startswith("bit") and "(tokens)" in label)
    ]
    header = raw[10 : 10 + header_length]
    for old, new in (
        (b"'<u2'", b"'<u4'"),
        (b"(60,)", b"(61,)"),
        (b"(60,)", b"(6000000000000,)"),
        (b"False", b"True "),
        (b"'<u2'", b"'|O' "),
    ):
        cases.append((f"header {old!r} -> {new!r}", raw.replace(header, header.replace(old, new))))
    for number, (label, damaged) in enumerate(cases):
        path = root / f"case{number}.npy"
        path.write_bytes(damaged)

        def read(p: Path = path) -> Any:
            array = open_token_file(p)
            return (array.dtype.name, array.tolist())

        judge(outcome, label, read, (tokens.dtype.name, tokens.tolist()), (path.name,), ())


def _gpt(prefix: str, cache: Path, builds: bool) -> Any:
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
    from tokenmill.datasets.utils import Split
    from tokenmill.formats.megatron import IndexedDataset

    from conftest import TinyTokenizer

    config = GPTDatasetConfig(
        random_seed=5,
        sequence_length=8,
        tokenizer=TinyTokenizer(),
        blend=([prefix], None),
        split="1",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(cache),
        create_attention_mask=False,
    )
    low_level = IndexedDataset(prefix)
    import tokenmill.datasets.gpt as gpt_module

    original = gpt_module.is_cache_builder
    gpt_module.is_cache_builder = lambda scope: builds  # type: ignore[assignment]
    try:
        dataset = GPTDataset(
            low_level, prefix, np.arange(len(low_level), dtype=np.int32), 40, Split.train, config
        )
        return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]
    finally:
        gpt_module.is_cache_builder = original


def _npy_fields(raw: bytes, name: str, fmt: str, entries: int) -> list[Field]:
    (header_length,) = struct.unpack_from("<H", raw, 8)
    start = 10 + header_length
    size = struct.calcsize(fmt)
    count = (len(raw) - start) // size
    picks = sorted({0, 1, count // 2, count - 2, count - 1} & set(range(count)))[:entries]
    return [Field("npy header", 0, start)] + [
        Field(f"{name}[{i}]", start + size * i, size, fmt) for i in picks
    ]


def index_cache(root: Path, outcome: Outcome) -> None:
    """GPTDataset index caches: every array's header, entries (boundary values, flips) and length;
    on a rank that does not build: CacheError naming the file, or identical samples."""
    documents = [list(range(1 + 10 * d, 1 + 10 * d + 3 + (d * 7) % 11)) for d in range(25)]
    prefix = write_megatron_shard(root / "data", documents)
    cache = root / "cache"
    reference = _gpt(prefix, cache, True)
    files = {p.name: p.read_bytes() for p in cache.iterdir() if p.suffix == ".npy"}
    for name, raw in sorted(files.items()):
        array = np.load(cache / name)
        field = name.rsplit("-", 1)[1][: -len(".npy")]
        fmt = {"int32": "<i", "int64": "<q", "uint32": "<I"}[array.dtype.name]
        cases = [
            (label, damaged)
            for label, damaged in binary_damage(raw, _npy_fields(raw, field, fmt, 5))
            if not label.startswith("bit")  # flips: covered by the boundary values below
        ]
        cases += [
            (label, damaged)
            for label, damaged in binary_damage(raw, _npy_fields(raw, field, fmt, 5))
            if label.startswith("bit") and "[" in label
        ]
        for _number, (label, damaged) in enumerate(cases):
            (cache / name).write_bytes(damaged)
            judge(
                outcome,
                f"{field}: {label}",
                lambda: _gpt(prefix, cache, False),
                reference,
                (name,),
                (field, "missing", "unreadable", "dtype", "shape", "description"),
            )
        (cache / name).write_bytes(raw)
    # swapped: another entry's arrays under this entry's names
    other_cache = root / "other_cache"
    other = write_megatron_shard(root / "other", [[*d[::-1], 3] for d in documents])
    _gpt(other, other_cache, True)
    for name in files:
        field = name.rsplit("-", 1)[1]
        (match,) = other_cache.glob(f"*-{field}")
        shutil.copy(match, cache / name)
        judge(
            outcome, f"swapped {field}", lambda: _gpt(prefix, cache, False), reference, (name,), ()
        )
        (cache / name).write_bytes(files[name])


def packing_plan(root: Path, outcome: Outcome) -> None:
    """Packing plans (PackedDataset cache): row offsets and order (entries are checked by the
    gather, tests/test_packed_gather_checks.py)."""
    from tokenmill.index.cache_checks import packing_checks

    checks = packing_checks()
    entries = np.array([[0, 0, 4], [1, 0, 4], [2, 0, 4], [3, 0, 4]], dtype=np.int64)
    offsets = np.array([0, 1, 3, 4], dtype=np.int64)
    order = np.array([2, 0, 1], dtype=np.int64)
    clean = {"entries": entries, "row_offsets": offsets, "row_order": order}
    for field in ("row_offsets", "row_order"):
        raw = clean[field].astype("<i8").tobytes()
        fields = [Field(f"{field}[{i}]", 8 * i, 8, "<q") for i in range(clean[field].shape[0])]
        for label, damaged in binary_damage(raw, fields):
            if len(damaged) % 8:
                continue  # a partial entry is refused by the .npy reader (npy_dir covers it)
            arrays = {**clean, field: np.frombuffer(damaged, dtype="<i8")}

            def check(a: dict[str, Any] = arrays, name: str = field) -> Any:
                problems = [p for c in checks.values() for p in c(a, True)]
                if problems:
                    raise ValueError(f"plan-{name}.npy: {problems[0]}")
                return [a["row_offsets"].tolist(), a["row_order"].tolist()]

            # a plan that passes the checks is a valid partition of the entries into rows
            judge(
                outcome,
                f"{field}: {label}",
                check,
                [offsets.tolist(), order.tolist()],
                (f"plan-{field}.npy",),
                (field,),
                variant=lambda result: True,
            )


def manifest(root: Path, outcome: Outcome) -> None:
    """manifest.json: every field truncated, flipped or given boundary values."""
    from tokenmill.storage.manifest import Manifest, ManifestObject

    clean = Manifest(
        (
            ManifestObject("a.bin", 12, "0" * 64, None, 1_700_000_000_000_000_000),
            ManifestObject("cache/b.npy", 3, "f" * 64),
        ),
        {"seq": 8},
    )
    text = clean.to_json().encode()
    for _number, (label, damaged) in enumerate(text_damage(text)):
        judge(
            outcome,
            label,
            lambda d=damaged: Manifest.from_json(d, "root/manifest.json"),
            clean,
            ("manifest.json",),
            (),
            variant=lambda m: Manifest.from_json(m.to_json(), "again") == m,
        )


def _mixture_text(prefixes: list[str]) -> bytes:
    return (
        'seed = 7\nchunk_tokens = 16\nexhaustion = "halt"\n'
        f'[sources.a]\npaths = ["{prefixes[0]}"]\nepochs = 1\n'
        f'[sources.b]\npaths = ["{prefixes[1]}"]\nepochs = 2\n'
        '[[phases]]\nname = "p0"\ntokens = 200\nweights = { a = 1.0, b = 3 }\n'
    ).encode()


def mixture_config(root: Path, outcome: Outcome) -> None:
    """Mixture configs (TOML and YAML): every line and number damaged; alias bombs, deep
    nesting."""
    from tokenmill.datasets.mixture_config import MixtureConfig

    a = write_megatron_shard(root / "a", DOCUMENTS)
    b = write_megatron_shard(root / "b", DOCUMENTS[::-1])
    text = _mixture_text([a, b])
    (root / "clean.toml").write_bytes(text)
    reference = MixtureConfig.from_file(root / "clean.toml")
    yaml_text = json.dumps(json.loads(json.dumps(reference.to_dict()))).encode()
    for suffix, source in ((".toml", text), (".yaml", yaml_text)):
        cases = list(text_damage(source))
        if suffix == ".yaml":
            bomb = b"x: &a [1,1,1,1,1,1,1,1,1]\n" + b"".join(
                f"x{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else '*a'] * 9)}]\n".encode()
                for i in range(9)
            )
            cases.append(("alias bomb", bomb))
            cases.append(("deep nesting", b"seed: " + b"[" * 50000 + b"]" * 50000))
        for number, (label, damaged) in enumerate(cases):
            path = root / f"case{number}{suffix}"
            path.write_bytes(damaged)
            judge(
                outcome,
                f"{suffix}: {label}",
                lambda p=path: MixtureConfig.from_file(p),
                reference,
                (path.name,),
                (),
                variant=lambda c: MixtureConfig.from_dict(c.to_dict()) == c,
            )


def build_cache_config(root: Path, outcome: Outcome) -> None:
    """build-cache run configs (YAML/JSON): every line and number damaged, alias bombs."""
    from tokenmill.runs.config_file import load_run_config

    prefix = write_megatron_shard(root / "data", DOCUMENTS)
    payload = {
        "tokenizer": {"vocab_size": 100, "eod": 0, "unique_identifiers": {"class": "Tiny"}},
        "blend": [[prefix], None],
        "split": "1",
        "random_seed": 3,
        "sequence_length": 8,
        "path_to_cache": str(root / "cache"),
        "sizes": [10, None, None],
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
    }
    text = json.dumps(payload, indent=1).encode()
    (root / "clean.json").write_bytes(text)
    reference = load_run_config(root / "clean.json")
    cases = list(text_damage(text))
    cases.append(("deep nesting", b'{"split": ' + b"[" * 100000 + b"]" * 100000 + b"}"))
    for number, (label, damaged) in enumerate(cases):
        path = root / f"case{number}.json"
        path.write_bytes(damaged)

        def load(p: Path = path) -> Any:
            return load_run_config(p).identity

        # accepted means every field passed the typed, bounded reader: a different valid config
        judge(
            outcome,
            label,
            load,
            reference.identity,
            (path.name,),
            (),
            variant=lambda identity: isinstance(identity, dict),
        )
    bomb = root / "bomb.yaml"
    bomb.write_bytes(
        b"a: &a [1,1,1,1,1,1,1,1,1]\n"
        + b"".join(
            f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i else '*a'] * 9)}]\n".encode()
            for i in range(9)
        )
    )
    judge(outcome, "alias bomb", lambda: load_run_config(bomb), None, ("bomb.yaml",), ())


def mixture_state(root: Path, outcome: Outcome) -> None:
    """Mixture resume states (a checkpoint's dict): every number damaged, fields retyped."""
    from tokenmill.datasets.mixture import Mixture

    a = write_megatron_shard(root / "a", DOCUMENTS)
    b = write_megatron_shard(root / "b", DOCUMENTS[::-1])
    (root / "m.toml").write_bytes(_mixture_text([a, b]))
    mixture = Mixture(str(root / "m.toml"))
    cursor = mixture.cursor()
    cursor.advance(48)
    state = mixture.state_of(cursor)
    text = json.dumps(state, indent=1).encode()

    def resume(damaged: bytes) -> Any:
        loaded = json.loads(damaged)
        return mixture.state_of(mixture.cursor(loaded))

    for label, damaged in text_damage(text):
        with contextlib.suppress(ValueError):
            json.loads(damaged)
            judge(
                outcome,
                label,
                lambda d=damaged: resume(d),
                state,
                ("mixture state",),
                (),
                variant=lambda st: mixture.state_of(mixture.cursor(st)) == st,
            )


CASES: dict[str, Callable[[Path, Outcome], None]] = {
    "megatron": megatron,
    "nanogpt": nanogpt,
    "bos_index": bos_index,
    "npy_dir": npy_dir,
    "index_cache": index_cache,
    "packing_plan": packing_plan,
    "manifest": manifest,
    "mixture_config": mixture_config,
    "build_cache_config": build_cache_config,
    "mixture_state": mixture_state,
}

os.environ.setdefault("OMP_NUM_THREADS", "1")
