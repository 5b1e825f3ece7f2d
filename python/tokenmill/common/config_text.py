"""Parsing config text (YAML, JSON, TOML) with bounds, and type-checked field access.

``yaml.safe_load`` refuses to build arbitrary objects but not to *expand*: a "billion laughs"
document (anchors whose aliases reference anchors, nine levels deep) parses into a small graph of
shared lists that becomes 10^9 values as soon as anything walks it: a JSON dump, a config hash,
or an error message that formats the value. Deep nesting (``[[[[...]]]]``) ends in a
RecursionError inside the parser. So every config is read by :func:`parse_config_text`:

* YAML through a loader that counts aliases (at most :data:`MAX_ALIASES`) and nesting depth
  (at most :data:`MAX_DEPTH`) while composing;
* then one walk of the result that counts values *with aliases expanded* and stops at
  :data:`MAX_VALUES` (so the cost of the check is bounded too), and checks the depth;
* JSON and TOML get the same walk; a RecursionError of any parser becomes the same error.

Field access (:func:`typed`): a value of the wrong type is an error naming the file and the field
("a string where an int belongs"), never a coercion or a traceback; bools are not integers.
Messages format values with a length cap (:func:`shown`).

Why our own: PyYAML (the YAML dependency tokenmill already has) offers no alias or depth limit,
and the expanded-size walk must apply to JSON and TOML configs too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = [
    "MAX_ALIASES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "ConfigTextError",
    "check_size",
    "parse_config_text",
    "shown",
    "typed",
]

MAX_ALIASES = 64
MAX_DEPTH = 32
MAX_VALUES = 200_000
_SHOWN = 80

T = TypeVar("T")


class ConfigTextError(ValueError):
    """A config that is too large, too deep or mistyped."""


def shown(value: object, limit: int = _SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters (never expands a huge value in full)."""
    if isinstance(value, (list, dict, tuple, set)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = reprlib_repr(value)
    except RecursionError:
        return f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reprlib_repr(value: object) -> str:
    import reprlib

    formatter = reprlib.Repr()
    formatter.maxlevel = 3
    formatter.maxstring = _SHOWN
    formatter.maxother = _SHOWN
    return formatter.repr(value)


def check_size(data: object, where: str) -> None:
    """ConfigTextError if ``data`` holds more than MAX_VALUES values (aliases expanded) or is
    nested deeper than MAX_DEPTH. Stops counting at the limit, so it costs at most that much."""
    count = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigTextError(
                f"{where}: the config expands to more than {MAX_VALUES} values (YAML aliases "
                "expand in full); refusing it"
            )
        if depth > MAX_DEPTH:
            raise ConfigTextError(f"{where}: the config is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            for key, item in value.items():
                stack.append((key, depth + 1))
                stack.append((item, depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, depth + 1) for item in value)


def _yaml_loader() -> Any:
    import yaml

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]
        """SafeLoader that counts aliases and depth while composing."""

        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._aliases = 0
            self._depth = 0

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            # a key written twice in one mapping is refused (PyYAML keeps the last silently);
            # merge keys (<<) may still be overridden, as YAML means them to be
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeConstructor reports it
                    continue
                if first is not None:
                    raise ConfigTextError(
                        f"duplicate key {shown(key)} at line {line} (first at line {first})"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > MAX_ALIASES:
                    raise ConfigTextError(f"more than {MAX_ALIASES} YAML aliases")
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH:
                    raise ConfigTextError(f"nested deeper than {MAX_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return BoundedLoader


def _unique_pairs(pairs: list[tuple[str, Any]], text: str, where: str) -> dict[str, Any]:
    """A JSON object's members as a dict; ConfigTextError naming the key and its line if one is
    written twice (json keeps the last silently)."""
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ConfigTextError(f"{where}: duplicate key {shown(key)}{_json_key_line(text, key)}")
        seen.add(key)
    return result  # pragma: no cover - a shorter dict has a repeated key


def _json_key_line(text: str, key: str) -> str:
    """' at line N' for the second place `key` is written as a member name, if found."""
    import re

    pattern = re.compile(re.escape(json.dumps(key)) + r"\s*:")
    places = [match.start() for match in pattern.finditer(text)]
    if len(places) < 2:
        return ""
    return f" at line {text.count(chr(10), 0, places[1]) + 1}"


def parse_config_text(text: str, where: str, kind: str) -> Any:
    """Parse ``text`` as ``kind`` ("yaml", "json" or "toml") within the bounds above.

    Raises:
        ConfigTextError: too many aliases or values, too deep.
        ValueError: not valid text of that kind (the parser's message, naming ``where``).
        ImportError: YAML without PyYAML.
    """
    try:
        if kind == "yaml":
            import yaml

            try:
                data = yaml.load(text, Loader=_yaml_loader())
            except ConfigTextError as error:
                raise ConfigTextError(f"{where}: {error}") from None
            except yaml.YAMLError as error:
                raise ValueError(f"{where}: not valid YAML: {error}") from None
        elif kind == "json":
            data = json.loads(
                text, object_pairs_hook=lambda pairs: _unique_pairs(pairs, text, where)
            )
        elif kind == "toml":
            import sys

            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            raise ValueError(f"{where}: unknown config kind {kind!r}")
    except RecursionError:
        raise ConfigTextError(f"{where}: the config is nested too deeply") from None
    check_size(data, where)
    return data


def typed(
    mapping: Mapping[str, Any],
    key: str,
    kind: type[T] | tuple[type, ...],
    where: str,
    default: Any = ...,
) -> Any:
    """``mapping[key]`` if it has type ``kind``, else ConfigTextError naming the field.

    An int field refuses bools and strings ("12" is not 12); a float field takes ints. A missing
    key returns ``default``, or is an error when there is none.
    """
    if key not in mapping:
        if default is ...:
            raise ConfigTextError(f"{where}: field {key!r} is missing")
        return default
    value = mapping[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    wants_int = int in kinds and bool not in kinds
    if isinstance(value, kinds) and not (wants_int and isinstance(value, bool)):
        return value
    names = " or ".join(k.__name__ for k in kinds)
    raise ConfigTextError(
        f"{where}: field {key!r} must be {names}, got {type(value).__name__} {shown(value)}"
    )
