"""The cache's own `.npy` header writer (index/cache_writes.npy_header) against numpy's: the
cache's arrays must hold the bytes ``numpy.save`` writes (megatron-core reads and writes the
same files), so the fast path is proven byte-identical over dtypes and shapes."""

from __future__ import annotations

import io
import math
import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

from tokenmill.index import cache_writes
from tokenmill.index.cache_writes import npy_header


def _numpy_save_header(array: np.ndarray) -> bytes:
    """What numpy.save writes before the data (everything but the array's bytes)."""
    stream = io.BytesIO()
    np.save(stream, array, allow_pickle=False)
    written = stream.getvalue()
    return written[: len(written) - array.nbytes]


_DTYPES = st.one_of(
    npst.scalar_dtypes(),  # bool, ints, uints, floats, complex, datetime64, timedelta64
    npst.byte_string_dtypes(),
    npst.unicode_string_dtypes(),
    npst.integer_dtypes(endianness="<"),
    npst.integer_dtypes(endianness=">"),
    npst.floating_dtypes(endianness=">"),
    st.integers(1, 64).map(lambda size: np.dtype(f"V{size}")),
)


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Shapes of up to 8 axes with at most 4,096 elements, or empty ones whose first axis has up
    to 13 digits (the first axis's digits change the header's padding)."""
    if draw(st.booleans()):
        small = draw(st.lists(st.integers(0, 4), max_size=3))
        return (draw(st.integers(0, 10**12)), 0, *small)
    shape = draw(st.lists(st.integers(0, 16), max_size=8))
    return tuple(shape if math.prod(shape) <= 4096 else shape[:3])


@settings(max_examples=400, deadline=None)
@given(dtype=_DTYPES, shape=_shapes())
def test_the_cache_writes_the_header_numpy_save_writes(
    dtype: np.dtype, shape: tuple[int, ...]
) -> None:
    array = np.zeros(shape, dtype=dtype)
    expected = _numpy_save_header(array)
    # written by the fast path, not handed to numpy's writer
    with mock.patch.object(cache_writes, "_numpy_header", side_effect=AssertionError):
        assert npy_header(array) == expected


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(3, dtype=[("a", "<i4"), ("b", ">f8")]),  # fields: numpy's writer
        np.zeros(2, dtype=np.dtype("<i8", metadata={"k": 1})),  # metadata: numpy's writer
        np.zeros(4, dtype=[(f"field{n:05d}", "<i4") for n in range(4000)]),  # format 2.0
        np.array(7, dtype=np.int16),  # no axes: no growth padding
        np.zeros((10**15, 0), dtype=np.int64),
    ],
    ids=["fields", "metadata", "format-2.0", "scalar", "wide-first-axis"],
)
def test_dtypes_the_fast_path_leaves_to_numpy_still_match(array: np.ndarray) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy warns that it drops the metadata
        assert npy_header(array) == _numpy_save_header(array)
