"""The longest JSON text a schema lets structured outputs write, in UTF-8 bytes.

Why: a length prediction should never exceed what the answer can be. A robot's
command schema (an action from an enum, a target from another, a boolean) allows
answers of a few dozen bytes, while the length predictor, reading only the
prompt, may expect hundreds of tokens; scheduling and admission by that
prediction would treat a quick answer as a long one. Every token of a
byte-fallback vocabulary holds at least one byte, so a byte bound is a token
bound too.

Only what is bounded for sure is bounded; anything else is None (unbounded or
not worked out): a number, a string without ``maxLength``, an array without
``maxItems``, an object that allows properties beyond its own
(``additionalProperties`` not false), ``allOf`` / ``not`` / conditionals, a
``$ref`` outside the schema. The text is as the engine writes it
(:data:`duetime.engine.grammar.JSON_OPTIONS`): ", " between items, ": " after a
key, no other whitespace; an ``enum`` or ``const`` value as ``json.dumps``
writes it (the grammar allows no other spelling); a string character at most 6
bytes (a ``\\uXXXX`` escape); an integer between its ``minimum`` and ``maximum``.
The bound is checked against the grammar library by sampling
(``tests/test_json_bound.py``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["max_json_bytes"]

_ITEM_SEP = len(", ")
_KEY_SEP = len(": ")
_MAX_DEPTH = 32
#: The most bytes one character of a JSON string takes: a ``\uXXXX`` escape.
_CHAR_BYTES = 6
#: Keywords that only describe: they change nothing the grammar allows.
_NOTES = frozenset({"title", "description", "$comment", "examples", "default", "deprecated"})


def max_json_bytes(schema: Any) -> int | None:
    """The most UTF-8 bytes of JSON ``schema`` allows; None where it is unbounded (or
    this does not work it out)."""
    return _bound(schema, schema, 0)


def _bound(s: Any, root: Any, depth: int) -> int | None:
    if depth > _MAX_DEPTH or not isinstance(s, dict):
        return None
    if "$ref" in s:
        return _ref(s, root, depth)
    if "const" in s:
        return _literal(s["const"])
    if "enum" in s:
        values = s["enum"]
        if not isinstance(values, list) or not values:
            return None
        return max(_literal(v) for v in values)
    if any(k in s for k in ("allOf", "not", "if", "then", "else")):
        return None
    for key in ("anyOf", "oneOf"):
        if key in s:
            rest = {k: v for k, v in s.items() if k not in (key, *_NOTES)}
            if rest or not isinstance(s[key], list) or not s[key]:
                return None  # branches merged with siblings: not worked out
            return _most(_bound(b, root, depth + 1) for b in s[key])
    kind = s.get("type")
    if isinstance(kind, list):
        return _most(_bound({**s, "type": k}, root, depth + 1) for k in kind) if kind else None
    if kind == "boolean":
        return len("false")
    if kind == "null":
        return len("null")
    if kind == "integer":
        return _integer(s)
    if kind == "string":
        n = s.get("maxLength")
        return 2 + _CHAR_BYTES * n if isinstance(n, int) and n >= 0 else None
    if kind == "array":
        return _array(s, root, depth)
    if kind == "object":
        return _object(s, root, depth)
    return None  # a number, no type at all, or an unknown one


def _most(bounds: Any) -> int | None:
    values = list(bounds)
    return None if any(b is None for b in values) else max(values)


def _literal(value: Any) -> int:
    """Bytes of an ``enum`` / ``const`` value as written (both spellings of non-ASCII)."""
    text = json.dumps(value, ensure_ascii=False)
    return max(len(text.encode("utf-8")), len(json.dumps(value)))


def _ref(s: dict[str, Any], root: Any, depth: int) -> int | None:
    ref = s["$ref"]
    if set(s) - {"$ref", *_NOTES} or not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target = root
    for part in filter(None, ref[1:].split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or key not in target:
            return None
        target = target[key]
    return _bound(target, root, depth + 1)


def _integer(s: dict[str, Any]) -> int | None:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    ends = [v for v in (lo, hi) if isinstance(v, int | float) and not isinstance(v, bool)]
    return max(len(str(int(v))) for v in ends) if len(ends) == 2 else None


def _array(s: dict[str, Any], root: Any, depth: int) -> int | None:
    n = s.get("maxItems")
    if not isinstance(n, int) or n < 0 or "prefixItems" in s:
        return None
    if n == 0:
        return 2
    item = _bound(s.get("items"), root, depth + 1)
    return None if item is None else 2 + n * item + (n - 1) * _ITEM_SEP


def _object(s: dict[str, Any], root: Any, depth: int) -> int | None:
    if s.get("additionalProperties", True) is not False or "patternProperties" in s:
        return None
    props = s.get("properties", {})
    if not isinstance(props, dict):
        return None
    total = 2  # {}
    for key, sub in props.items():
        value = _bound(sub, root, depth + 1)
        if value is None:
            return None
        total += len(json.dumps(key, ensure_ascii=False).encode("utf-8")) + _KEY_SEP + value
    return total + max(0, len(props) - 1) * _ITEM_SEP
