"""The parts of a chat request: its messages (with earlier turns' tool calls) and the
tools an answer may be forced to call (:mod:`duetime.server.tool_calls`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from duetime.server.answer_constraints import MAX_GRAMMAR_CHARS
from duetime.server.body_fields import Text, _Body


class ContentPart(_Body):
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """A part that is no text (an image, audio, a file) named for what it is: the
        model reads text only, and pydantic said "text: Field required"."""
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"{kind!r} content parts are not supported: this model reads text")
        return data


class FunctionCall(_Body):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore")

    name: Text = Field(min_length=1, max_length=64)
    arguments: Text = Field(max_length=MAX_GRAMMAR_CHARS)


class ToolCall(_Body):
    model_config = ConfigDict(extra="ignore")

    id: Text | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: Text | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(_Body):
    """OpenAI's ``tools[].function``: a function the answer may call."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=_FUNCTION_NAME)
    description: Text | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments (absent: no arguments)."
    )
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else _NO_ARGUMENTS


_NO_ARGUMENTS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


class ToolDef(_Body):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=_FUNCTION_NAME)


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


def _forces_call(tools: list[ToolDef] | None, choice: Any) -> bool:
    """Whether ``tool_choice`` makes the answer a call to one of ``tools``."""
    return bool(tools) and (choice == "required" or isinstance(choice, NamedToolChoice))


def _shown_tools(tools: list[ToolDef] | None, choice: Any) -> list[ToolDef]:
    """The tools a chat prompt shows the model: all of them where the answer must call
    one, none otherwise (with "none" they are ignored)."""
    return list(tools or ()) if _forces_call(tools, choice) else []
