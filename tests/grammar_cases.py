"""What the structured-output tests share: the grammars of each kind and their checks.

The grammars of each kind (choice, regex, JSON schema, Lark, a schema with long keys)
as :class:`GrammarSpec` cases, the ``response_format`` of the schema, a check of
whether a text is a whole answer of a grammar, made without the grammar library.
The ``model`` and ``compiler`` fixtures are in :mod:`tests.grammar_fixtures`.
"""

from __future__ import annotations

import json
import re

from duetime.core.grammar import GrammarSpec
from duetime.server.codec import ByteCodec

CODEC = ByteCodec()
CHOICES = ["hello", "help", "world"]
DIGITS = r"[0-9]{3}-[a-c]{2,5}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
LARK = 'start: "x" ("y" | "zz") ("y" | "zz")? "!"'
#: long keys: runs of forced tokens longer than the tiny model's window and a cache block
LONG_KEYS = {
    "type": "object",
    "properties": {
        "the_first_rather_long_property_name": {"enum": ["yes", "no"]},
        "and_a_second_one_that_is_long_as_well": {"type": "boolean"},
    },
    "required": ["the_first_rather_long_property_name", "and_a_second_one_that_is_long_as_well"],
    "additionalProperties": False,
}
SPECS = [
    GrammarSpec.choice(CHOICES, "choice"),
    GrammarSpec("regex", DIGITS, "regex"),
    GrammarSpec.json_schema(SCHEMA, "schema"),
    GrammarSpec("grammar", LARK, "lark"),
    GrammarSpec.json_schema(LONG_KEYS, "long keys"),
]
RESPONSE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}


def answer_text(ids: list[int]) -> str:
    return CODEC.decode(ids)


def fits(spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is a whole answer of ``spec``, checked without the grammar library."""
    if spec.kind == "choice":
        return text in CHOICES
    if spec.kind == "regex":
        return re.fullmatch(DIGITS, text) is not None
    if spec.kind == "grammar":
        return re.fullmatch(r"x(y|zz){1,2}!", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if spec.field == "long keys":
        first, second = LONG_KEYS["properties"]  # type: ignore[misc]
        return set(value) == {first, second} and value[first] in ("yes", "no")
    return (
        set(value) == {"ok", "color"}
        and isinstance(value["ok"], bool)
        and value["color"] in SCHEMA["properties"]["color"]["enum"]  # type: ignore[index]
    )
