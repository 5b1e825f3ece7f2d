"""The header every tokenmill JSON file starts with: a `format` name and a `version` number.

Tokenizer fingerprints, data fingerprints and download manifests each name their format and
version, so a reader can tell "not this kind of file" from "a newer version of it" and say which.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_header"]


def check_header(
    payload: Any,
    where: str,
    expected_format: str,
    expected_version: int,
    what: str,
    error: type[Exception],
) -> dict[str, Any]:
    """`payload` as a dict if it is a JSON object of `expected_format` at `expected_version`.

    Args:
        payload: the parsed JSON.
        where: the file or URL, for messages.
        expected_format: the value of its "format" field.
        expected_version: the value of its "version" field.
        what: what the file is ("fingerprint", "manifest", ...), for messages.
        error: the exception type to raise (the caller's documented one).

    Raises:
        error: not an object, another format, or another version (the message names the file,
            the field and the value found).
    """
    if not isinstance(payload, dict) or payload.get("format") != expected_format:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise error(f"{where}: format is {found!r}, expected {expected_format!r}")
    if payload.get("version") != expected_version:
        raise error(
            f"{where}: unsupported {what} version {payload.get('version')!r}, "
            f"expected {expected_version}"
        )
    return payload
