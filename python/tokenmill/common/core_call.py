"""Calls into the C++ core whose argument errors name the argument.

pybind11 reports a wrong argument type as "f(): incompatible function arguments. The following
argument types are supported: 1. (sizes: numpy.ndarray, seed: typing.SupportsInt, ...) Invoked
with: array([...]), ..." : the whole signature and every value, without saying which argument is
wrong (and with arbitrarily long reprs). :func:`core_call` calls the function and, on that
error only, compares each argument with the first overload's parameter types and raises a
TypeError naming the first argument that does not fit ("build_gpt_indices: argument 'seed' must
be an int, got float 1.5").

Why our own: pybind11 has no hook to customise that message; the signature it prints is parsed
here only on the error path, so calls cost one Python frame more.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["core_call"]

R = TypeVar("R")

_SIGNATURE = re.compile(r"1\. \((.*)\) ->")


def _fits(value: Any, annotation: str) -> bool:
    if "numpy.ndarray" in annotation:
        return isinstance(value, np.ndarray)
    if annotation.startswith("bool"):
        return isinstance(value, (bool, np.bool_))
    if "SupportsInt" in annotation or annotation.startswith("int"):
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if annotation.startswith("float") or "SupportsFloat" in annotation:
        return isinstance(value, (int, float, np.integer, np.floating))
    if annotation.startswith("bytes"):
        return isinstance(value, (bytes, bytearray, memoryview))
    if annotation.startswith("str"):
        return isinstance(value, str)
    return True  # a type this check does not know: not the culprit it names


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def core_call(function: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``function(*args, **kwargs)``; pybind's "incompatible function arguments" becomes a
    TypeError naming the first argument that does not fit the signature.

    Raises:
        TypeError: naming the function, the argument and what was passed.
    """
    try:
        return function(*args, **kwargs)
    except TypeError as error:
        message = str(error)
        if "incompatible function arguments" not in message:
            raise
        name = getattr(function, "__name__", "core function")
        found = _SIGNATURE.search(message)
        if found is None:
            raise TypeError(f"{name}: incompatible arguments ({len(args)} given)") from None
        parameters = [p.strip() for p in re.split(r",\s*(?![^\[]*\])", found.group(1))]
        annotations = {}
        for parameter in parameters:
            argument, _, annotation = parameter.partition(":")
            annotations[argument.strip()] = annotation.split("=")[0].strip()
        names = list(annotations)
        required = [p for p in parameters if "=" not in p]
        given = len(args) + len(kwargs)
        unknown = [key for key in kwargs if key not in annotations]
        if unknown:
            raise TypeError(f"{name}: no argument named {unknown[0]!r}") from None
        if given < len(required) or len(args) > len(parameters):
            raise TypeError(
                f"{name}: takes {len(required)} to {len(parameters)} arguments, got {given}"
            ) from None
        passed = [*zip(names, args), *kwargs.items()]
        for argument, value in passed:
            if not _fits(value, annotations[argument]):
                raise TypeError(
                    f"{name}: argument {argument!r} must be {annotations[argument]}, got "
                    f"{_describe(value)}"
                ) from None
        raise TypeError(f"{name}: incompatible arguments: {message[:300]}") from None
