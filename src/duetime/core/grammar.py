"""What an answer must look like: plain data the API builds and the engine's grammar reads.

A request may constrain its answer to a JSON schema (OpenAI's ``response_format``),
a regular expression, one of a list of strings or a context-free grammar (vLLM's
``structured_outputs``). It lives in ``core`` (no torch, no grammar library)
because the API schemas build it and the gateway imports those schemas without
the engine; :mod:`duetime.engine.grammar` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from duetime.core.json_bound import max_json_bytes

__all__ = ["AnswerWork", "GrammarKind", "GrammarSpec"]

#: ``json_schema``: a JSON schema (``{"type": "object"}`` for any object); ``regex``: the
#: whole answer matches it; ``choice``: the answer is one of a JSON list of strings;
#: ``grammar``: Lark or GBNF (llama.cpp's) text.
GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class AnswerWork:
    """What one answer under a grammar costs the engine when its forced runs jump:
    ``steps`` engine steps (a token each from the model), and ``rows`` forced tokens
    that ride along in them, computed as extra rows (the answer's last forced run
    needs none). Admission forecasts a structured answer as this work, not as a step
    a token (``server/grammar_steps.py``)."""

    steps: int
    rows: int = 0


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: its kind, its text, and the request field it came from (errors
    name it)."""

    kind: GrammarKind
    text: str
    field: str

    @classmethod
    def json_schema(cls, schema: object, field: str) -> GrammarSpec:
        """A JSON schema given as parsed JSON (or already as its text)."""
        # (keys in the client's order: the answer's properties come in the schema's order)
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, field)

    @classmethod
    def choice(cls, options: list[str], field: str) -> GrammarSpec:
        return cls("choice", json.dumps(options), field)

    def max_answer_tokens(self) -> int | None:
        """The most tokens an answer under this grammar can take, where that is known
        (a choice; a JSON schema whose every part is bounded, :mod:`.json_bound`); None
        where it is unbounded or not worked out (a regex, a grammar). A token of a
        byte-fallback vocabulary holds at least one byte, and the grammar allows at
        most the end-of-sequence after the longest answer."""
        try:
            value = json.loads(self.text)
        except ValueError:  # not JSON: compiling it refuses it
            return None
        if self.kind == "choice" and isinstance(value, list) and value:
            return max(len(str(o).encode("utf-8")) for o in value) + 1
        if self.kind == "json_schema":
            most = max_json_bytes(value)
            return None if most is None else most + 1
        return None
