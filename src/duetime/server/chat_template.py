"""The chat template for a base model.

Gemma 3 270M as shipped is the pre-trained model: it has no chat template and
was never taught one. We render messages as a plain transcript a base model
continues naturally, and end with the assistant's turn open::

    System: You are terse.
    User: What is 2 + 2?
    Assistant:

The answer is whatever the model writes next; clients usually pass
``stop=["\\nUser:"]`` so it does not go on to write the user's next turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from duetime.server.schemas import ChatMessage

_ROLE = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The prompt text for ``messages``, ending with an open ``Assistant:`` turn."""
    lines = [f"{_ROLE[m.role]}: {m.text()}" for m in messages]
    return "\n".join([*lines, "Assistant:"])
