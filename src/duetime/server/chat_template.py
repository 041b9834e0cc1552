"""The chat template for a base model.

Gemma 3 270M as shipped is the pre-trained model: it has no chat template and
was never taught one. We render messages as a plain transcript a base model
continues naturally, and end with the assistant's turn open::

    System: You are terse.
    User: What is 2 + 2?
    Assistant:

The answer is what the model writes next, up to the point where it starts a next
turn of the transcript (:data:`TURN_ENDS`: a ``User:``, ``System:``, ``Assistant:`` or
``Tool:`` line): the server ends a chat answer there, as a chat template's end-of-turn
token would, unless the answer must run to its length
(``ignore_eos``) or a grammar decides where it ends (:func:`chat_stops`).

Where the answer is a forced tool call, the tools come first, one ``Tool
available:`` line each (name, description, parameters' schema); an earlier
assistant turn that called tools shows its calls as JSON, and a ``tool`` message
(a call's result) is a ``Tool:`` turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from duetime.server.chat_messages import ChatMessage, ToolDef

_ROLE = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}

#: Where an assistant's turn ends in the transcript: the model starting a next turn, of
#: any role the template writes (a 270M model writes ``User:`` most, but also
#: ``System:`` and ``Assistant:``).
TURN_ENDS = tuple(f"\n{label}:" for label in dict.fromkeys(_ROLE.values()))


def render_chat(messages: Sequence[ChatMessage], tools: Sequence[ToolDef] = ()) -> str:
    """The prompt text for ``messages`` (after ``tools``, where the answer calls one),
    ending with an open ``Assistant:`` turn."""
    lines = [f"Tool available: {_describe(t)}" for t in tools]
    lines += [f"{_ROLE[m.role]}: {_turn(m)}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def _describe(tool: ToolDef) -> str:
    f = tool.function
    about = {"name": f.name, "description": f.description, "parameters": f.parameters}
    return json.dumps({k: v for k, v in about.items() if v is not None})


def _turn(m: ChatMessage) -> str:
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or ()
    ]
    return " ".join(part for part in (m.text(), json.dumps(calls) if calls else "") if part)


def chat_stops(stops: Sequence[str], *, ignore_eos: bool, grammar: bool) -> list[str]:
    """A chat answer's stop strings: the client's, and the end of the assistant's turn.

    The base model has no end-of-turn token, so without this a chat answer runs on
    into a turn it wrote itself (a 270M model does, within a dozen tokens).
    Not added where the answer must reach its length (``ignore_eos``: benchmarks that
    fix output lengths, as with vLLM) or where a grammar bounds the answer (a
    structured output or a tool call: cutting it would break its form).
    """
    if ignore_eos or grammar:
        return list(stops)
    return [*stops, *(end for end in TURN_ENDS if end not in stops)]
