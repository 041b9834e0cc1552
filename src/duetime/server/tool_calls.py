"""Forced tool calls: the answer *is* the call, its JSON held to the tools' schemas.

OpenAI's ``tool_choice`` ``"required"`` or ``{"type": "function", "function":
{"name": f}}`` needs no tool-call parser: the answer's form is known before its
first token, so structured outputs (``engine/grammar.py``) hold it there, as
vLLM does. ``"auto"`` (the model decides whether to call) would need a parser
for the model's own call syntax, which a base model does not have; it is refused.

* Named ``f``: the answer is ``f``'s arguments, JSON under its ``parameters``
  schema; it comes back as one call, finish reason "stop" (as OpenAI answers a
  forced function).
* ``"required"``: the answer is a JSON array of ``{"name": ..., "parameters":
  {...}}``, each item held to one tool's name and schema (vLLM's form); it comes
  back as that many calls, finish reason "tool_calls". With
  ``parallel_tool_calls: false`` the array holds exactly one (a base model, free
  to, tends to go on adding calls until ``max_tokens``).

An answer ``max_tokens`` cut short is not a whole call: it comes back as text,
finish reason "length".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ForcedTools"]


@dataclass(frozen=True, slots=True)
class ForcedTools:
    """A forced call: to the function ``name``, or (None) to one or more of the tools."""

    name: str | None
    #: ``parallel_tool_calls``: with False, "required" makes exactly one call.
    parallel: bool = True

    def schema(self, tools: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """The JSON schema the answer is held to, from the tools' (name, parameters)."""
        if self.name is not None:
            return dict(tools)[self.name]
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in tools
        ]
        one = items[0] if len(items) == 1 else {"anyOf": items}
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": one}
        if not self.parallel:
            calls["maxItems"] = 1
        return calls

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` for a whole answer; None where ``text`` is not one
        (cut short by ``max_tokens``)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [_call(self.name, text)]
        if not isinstance(value, list):
            return None
        return [_call(item["name"], json.dumps(item["parameters"])) for item in value]

    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
