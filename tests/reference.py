"""Slow, obviously-correct pure-Python references for every C++ kernel.

Tests demand exact equality between a kernel and its reference on random inputs. Nothing here
is fast; nothing here is imported by the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# --- GPTDataset indices ------------------------------------------------------------------------


def shuffle_reference(values: np.ndarray, random_state: np.random.RandomState) -> None:
    """Fisher-Yates exactly as RandomState.shuffle draws it (masked rejection per step)."""
    for i in range(len(values) - 1, 0, -1):
        mask = (1 << i.bit_length()) - 1
        while True:
            if i <= 0xFFFFFFFF:
                word = int(random_state.randint(0, 2**32, dtype=np.uint32))
            else:  # pragma: no cover - arrays of 2^32 elements are not tested here
                high = int(random_state.randint(0, 2**32, dtype=np.uint32))
                word = (high << 32) | int(random_state.randint(0, 2**32, dtype=np.uint32))
            j = word & mask
            if j <= i:
                break
        values[i], values[j] = values[j], values[i]


def sample_index_reference(
    sizes: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_samples: int,
    extra_token: int,
) -> np.ndarray:
    """The sample-index walk, one token budget at a time (megatron-core's build_sample_idx)."""
    rows = [(0, 0)]
    position, offset = 0, 0
    last = len(document_index) - 1
    while len(rows) <= num_samples:
        remaining = sequence_length + extra_token
        while remaining != 0:
            available = int(sizes[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - extra_token
                remaining = 0
            else:
                if position == last:
                    offset = int(sizes[document_index[position]]) - extra_token
                    break
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def gpt_indices_reference(
    sizes: np.ndarray,
    indices: np.ndarray,
    num_samples: int | None,
    sequence_length: int,
    seed: int,
    extra_token: int = 1,
    drop_last: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All three GPTDataset indices from the spec, with numpy's own RandomState."""
    tokens_per_epoch = int(sum(int(sizes[i]) for i in indices))
    num_epochs = 1
    if num_samples is not None:
        while num_epochs * tokens_per_epoch < num_samples * sequence_length + extra_token:
            num_epochs += 1
    separate = False
    before_final = 0
    if num_epochs > 1:
        assert num_samples is not None
        before_final = ((num_epochs - 1) * tokens_per_epoch - extra_token) // sequence_length
        per_epoch = (tokens_per_epoch - extra_token) // sequence_length
        separate = num_samples - before_final < int(0.80 * per_epoch)
    random_state = np.random.RandomState(seed)
    if separate:
        head = np.tile(np.asarray(indices, dtype=np.int32), num_epochs - 1)
        tail = np.asarray(indices, dtype=np.int32).copy()
        shuffle_reference(head, random_state)
        shuffle_reference(tail, random_state)
        document_index = np.concatenate([head, tail])
    else:
        document_index = np.tile(np.asarray(indices, dtype=np.int32), num_epochs)
        shuffle_reference(document_index, random_state)
    total = num_epochs * tokens_per_epoch - extra_token
    if drop_last:
        count = max(total, 0) // sequence_length
    else:
        count = max(int(np.ceil(np.float32(total) / np.float32(sequence_length))), 0)
    sample_index = sample_index_reference(
        sizes, document_index, sequence_length, count, extra_token
    )
    split = before_final if separate else count
    first = np.arange(split, dtype=np.int64)
    second = np.arange(split, count, dtype=np.int64)
    shuffle_reference(first, random_state)
    if split < count:
        shuffle_reference(second, random_state)
    return document_index, sample_index, np.concatenate([first, second])


def blending_indices_reference(weights: Sequence[float], size: int) -> tuple[list[int], list[int]]:
    """megatron-core's greedy blending, one dataset at a time (O(size x datasets)).

    Python floats are IEEE doubles and CPython never fuses ``w * t - c``, so the errors are the
    same floating-point values as megatron's C++.
    """
    counts = [0] * len(weights)
    dataset_index: list[int] = []
    dataset_sample_index: list[int] = []
    for i in range(size):
        t = float(max(i, 1))
        best = 0
        best_error = weights[0] * t - float(counts[0])
        for d in range(1, len(weights)):
            error = weights[d] * t - float(counts[d])
            if error > best_error:  # strictly: the first maximum wins ties
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices_reference(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """megatron-core's exhaustive blending: weights sizes[d] / total, spent datasets drop out."""
    total = sum(sizes)
    weights = [size / float(total) for size in sizes]
    counts = [0] * len(sizes)
    dataset_index: list[int] = []
    dataset_sample_index: list[int] = []
    for i in range(total):
        t = float(max(i, 1))
        best = -1
        best_error = 0.0
        for d, weight in enumerate(weights):
            if counts[d] == sizes[d]:
                continue
            error = weight * t - float(counts[d])
            if best < 0 or error > best_error:
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index


# --- packing plans -----------------------------------------------------------------------------


def pieces_reference(
    lengths: Sequence[int], row_length: int, overlap: int, windows: bool = True
) -> list[list[int]]:
    """[document, offset, length, masked, flags] for every piece, documents in order."""
    pieces = []
    for document, length in enumerate(lengths):
        if length == 0:
            continue
        if not windows:
            pieces.append([document, 0, length, 0, 0])
            continue
        start = 0
        while True:
            size = min(row_length, length - start)
            pieces.append([document, start, size, overlap if start > 0 else 0, 0])
            if start + row_length >= length:
                break
            start += row_length - overlap
    return pieces


def best_fit_reference(
    pieces: list[list[int]], row_length: int, max_pieces: int, window: int, max_open: int
) -> list[list[list[int]]]:
    """Best-fit decreasing over blocks of `window` pieces; rows in the order they close."""
    rows: list[list[list[int]]] = []
    rooms: list[int] = []
    open_rows: list[tuple[int, int]] = []  # sorted (room, row id)
    closed: list[list[list[int]]] = []
    for begin in range(0, len(pieces), window):
        block = sorted(range(begin, min(len(pieces), begin + window)), key=lambda i: -pieces[i][2])
        for index in block:
            piece = pieces[index]
            fit = next((entry for entry in open_rows if entry[0] >= piece[2]), None)
            if fit is None:
                row_id = len(rows)
                rows.append([])
                rooms.append(row_length)
            else:
                open_rows.remove(fit)
                row_id = fit[1]
            rows[row_id].append(piece)
            rooms[row_id] -= piece[2]
            if rooms[row_id] == 0 or len(rows[row_id]) >= max_pieces:
                closed.append(rows[row_id])
            else:
                open_rows.append((rooms[row_id], row_id))
                open_rows.sort()
                if len(open_rows) > max_open:
                    closed.append(rows[open_rows.pop(0)[1]])
    closed.extend(rows[row_id] for _, row_id in sorted(open_rows, key=lambda entry: entry[1]))
    return closed


def bos_aligned_reference(
    pieces: list[list[int]], row_length: int, max_pieces: int, window: int
) -> list[list[list[int]]]:
    """Full rows: the longest piece that fits, else crop the shortest too-long piece."""
    store = [list(piece) for piece in pieces]
    buffer: list[tuple[int, int]] = []  # sorted (effective length, store index)
    next_piece = 0

    def effective(piece: list[int]) -> int:
        return piece[2] + (piece[4] & 1)

    def refill() -> None:
        nonlocal next_piece
        while len(buffer) < window and next_piece < len(pieces):
            buffer.append((effective(store[next_piece]), next_piece))
            next_piece += 1
        buffer.sort()

    refill()
    rows = []
    while buffer:
        row: list[list[int]] = []
        room = row_length
        while room > 0 and buffer:
            last_slot = len(row) + 1 >= max_pieces
            fitting = [entry for entry in buffer if entry[0] <= room]
            if fitting and not last_slot:
                entry = fitting[-1]
                buffer.remove(entry)
                row.append(store[entry[1]])
                room -= entry[0]
                refill()
                continue
            too_long = [entry for entry in buffer if entry[0] > room]
            if not too_long:
                entry = fitting[-1]
                buffer.remove(entry)
                row.append(store[entry[1]])
                room -= entry[0]
                refill()
                break
            entry = too_long[0]
            piece = store[entry[1]]
            take = room - (piece[4] & 1)
            if take <= 0:
                break
            buffer.remove(entry)
            row.append([piece[0], piece[1], take, min(piece[3], take), piece[4]])
            rest = [piece[0], piece[1] + take, piece[2] - take, max(0, piece[3] - take), 1]
            store.append(rest)
            buffer.append((effective(rest), len(store) - 1))
            buffer.sort()
            room = 0
        rows.append(row)
    return rows


# --- token scan ----------------------------------------------------------------------------------


def token_positions_reference(tokens: Sequence[int], token: int) -> list[int]:
    """Positions of ``token`` in ``tokens``, one comparison at a time."""
    return [i for i, value in enumerate(tokens) if int(value) == token]


# --- mixtures ----------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def philox4x64_10_reference(counter: Sequence[int], key: Sequence[int]) -> tuple[int, ...]:
    """Philox4x64-10 from the paper's definition, in Python integers."""
    c0, c1, c2, c3 = (int(v) for v in counter)
    k0, k1 = (int(v) for v in key)
    for round_number in range(10):
        if round_number:
            k0 = (k0 + 0x9E3779B97F4A7C15) & _MASK64
            k1 = (k1 + 0xBB67AE8584CAA73B) & _MASK64
        product0 = 0xD2E7470EE14C6C93 * c0
        product1 = 0xCA5A826395121157 * c2
        c0, c1, c2, c3 = (
            (product1 >> 64) ^ c1 ^ k0,
            product1 & _MASK64,
            (product0 >> 64) ^ c3 ^ k1,
            product0 & _MASK64,
        )
    return c0, c1, c2, c3


def chunk_source_reference(
    weights: Sequence[float], key: Sequence[int], stream: int, draw: int, chunk: int
) -> int:
    """The source of one chunk: exact rational comparison u / 2^53 < cumulative weight share."""
    from fractions import Fraction

    u = Fraction(philox4x64_10_reference((chunk, stream, draw, 0), key)[0] >> 11, 1 << 53)
    total = sum(Fraction(w) for w in weights)
    cumulative = Fraction(0)
    for source, weight in enumerate(weights):
        cumulative += Fraction(weight)
        if weight > 0 and u < cumulative / total:
            return source
    return max(s for s, w in enumerate(weights) if w > 0)


def source_stream_reference(
    documents: Sequence[Sequence[int]], seed: int, name: str, epochs: int
) -> list[int]:
    """A mixture source's token stream: each epoch's documents in RandomState order."""
    import zlib

    stream: list[int] = []
    for epoch in range(epochs):
        order = np.random.RandomState(zlib.crc32(f"{seed}/{name}/{epoch}".encode())).permutation(
            len(documents)
        )
        for document in order:
            stream.extend(int(t) for t in documents[document])
    return stream


def mixture_stream_reference(
    streams: Sequence[Sequence[int]],
    phases: Sequence[tuple[int, Sequence[float]]],
    seed: int,
    chunk_tokens: int,
    exhaustion: str,
    tokens: int,
    position: int = 0,
    segment_start: int = 0,
    ledger: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, sources, ledger after) of ``tokens`` stream positions, one position at a time.

    Raises RuntimeError where a source runs dry under "halt" (or a phase has nothing left).
    """
    used = [0] * len(streams) if ledger is None else list(ledger)
    ends, total = [], 0
    for budget, _ in phases:
        total += budget
        ends.append(total)
    out_tokens, out_sources = [], []
    for p in range(position, position + tokens):
        phase = next(i for i, end in enumerate(ends) if p < end)
        start = max(segment_start, ends[phase] - phases[phase][0])
        chunk = (p - start) // chunk_tokens
        while True:
            excluded = (
                {s for s in range(len(streams)) if used[s] >= len(streams[s])}
                if exhaustion == "drop"
                else set()
            )
            weights = [0.0 if s in excluded else w for s, w in enumerate(phases[phase][1])]
            if not any(w > 0 for w in weights):
                raise RuntimeError(f"phase {phase} exhausted at {p}")
            source = chunk_source_reference(
                weights, (seed, phase), segment_start, len(excluded), chunk
            )
            if used[source] < len(streams[source]):
                break
            if exhaustion == "halt":
                raise RuntimeError(f"source {source} exhausted at {p}")
        out_tokens.append(streams[source][used[source]])
        out_sources.append(source)
        used[source] += 1
    return out_tokens, out_sources, used


def index_violation_reference(
    lengths: Sequence[int], pointers: Sequence[int], boundaries: Sequence[int], itemsize: int
) -> tuple[int, int, int, int]:
    """The .idx structural check (csrc/index_check.cpp), one Python int at a time:
    (code, index, expected pointer, end byte offset), codes as in index_check.hpp."""
    if len(pointers) != len(lengths):
        return (1, 0, 0, 0)
    for i, length in enumerate(lengths):
        if length < 0:
            return (2, i, 0, 0)
    end = 0
    for i, length in enumerate(lengths):
        if pointers[i] != end:
            return (3, i, end, 0)
        end += length * itemsize
        if end > 2**63 - 1:
            return (4, i, 0, 0)
    if not boundaries:
        return (5, 0, 0, end)
    if boundaries[0] != 0:
        return (6, 0, 0, end)
    if boundaries[-1] != len(lengths):
        return (7, len(boundaries) - 1, 0, end)
    for i in range(len(boundaries) - 1):
        if boundaries[i] > boundaries[i + 1]:
            return (8, i, 0, end)
    return (0, 0, 0, end)
