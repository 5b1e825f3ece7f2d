"""Positions of one token id in a token array: BOS/EOS scans and document boundaries.

``find_token_positions(tokens, token)`` equals ``numpy.flatnonzero(tokens == token)`` (int64,
ascending) for every integer token dtype, but runs in C++ with the GIL released on up to
``num_threads`` threads (contiguous chunks whose results are concatenated in order, so the output
never depends on the thread count). numpy's version materialises a boolean array of the input's
length first; the kernel writes only the matches: a single read of the array, about 1 ns per
token per thread on a memory-mapped shard that is already in the page cache.

A token id the dtype cannot hold (negative for an unsigned dtype, too large) matches nothing,
exactly as numpy's comparison with a Python int does.

The scan lives with the formats because formats need it: a modded-nanogpt shard's documents are
where its BOS tokens are (`formats.nanogpt`, `formats.bos_index`), and `formats.sources` finds
document lengths of any token source with it.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.core_call import core_call
from tokenmill.common.threads import default_scan_threads

__all__ = ["count_token", "find_token_positions"]


def _as_tokens(tokens: npt.ArrayLike) -> npt.NDArray[np.integer]:
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"tokens must have an integer dtype, got {array.dtype}")
    # the builtin native dtype object: the kernel dispatches on dtype identity
    native = np.dtype(f"{array.dtype.kind}{array.dtype.itemsize}")
    return np.ascontiguousarray(array, dtype=native)


def find_token_positions(
    tokens: npt.ArrayLike, token: int, num_threads: int | None = None
) -> npt.NDArray[np.int64]:
    """Where ``tokens == token``, as ``numpy.flatnonzero`` would say.

    Args:
        tokens: a 1-D integer array (a memory-mapped shard is scanned in place; a non-contiguous
            view is copied first).
        token: the token id.
        num_threads: scan threads; None uses :func:`tokenmill.common.threads.default_scan_threads`.

    Returns:
        The ascending int64 positions.

    Raises:
        ValueError: tokens is not 1-D, or num_threads < 1.
        TypeError: tokens is not an integer array.
    """
    threads = _threads(num_threads)
    return core_call(_core.find_token_positions, _as_tokens(tokens), operator.index(token), threads)


def count_token(tokens: npt.ArrayLike, token: int, num_threads: int | None = None) -> int:
    """How many elements of ``tokens`` equal ``token`` (the scan without its output).

    Args:
        tokens: a 1-D integer array.
        token: the token id.
        num_threads: scan threads; None uses :func:`tokenmill.common.threads.default_scan_threads`.

    Returns:
        The count.
    """
    threads = _threads(num_threads)
    return core_call(_core.count_token, _as_tokens(tokens), operator.index(token), threads)


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return default_scan_threads()
    threads = operator.index(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}")
    return threads
