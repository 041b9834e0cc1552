"""The chat template for a base model.

Gemma 3 270M as shipped is the pre-trained model: it has no chat template and
was never taught one. We render messages as a plain transcript a base model
continues naturally, and end with the assistant's turn open::

    System: You are terse.
    User: What is 2 + 2?
    Assistant:

The answer is whatever the model writes next; clients usually pass
``stop=["\\nUser:"]`` so it does not go on to write the user's next turn.

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
