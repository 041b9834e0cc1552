"""Request and response bodies of the OpenAI-compatible API, with duetime's time fields.

The four endpoint bodies live here; their parts each have a module, re-exported
here: the bounds, strict text and time fields (:mod:`~duetime.server.body_fields`),
the answer's constraints (:mod:`~duetime.server.answer_constraints`), the sampling
fields both generation endpoints share (:mod:`~duetime.server.sampling_fields`),
chat messages and tools (:mod:`~duetime.server.chat_messages`) and the response
shapes (:mod:`~duetime.server.response_shapes`).

Standard OpenAI fields keep their names and meaning; fields duetime does not
implement (``user``, ``metadata``, ...) are accepted and ignored, as vLLM does,
so existing clients work unchanged. The time-aware extensions
arrive through the client's ``extra_body`` and are documented here, in the
OpenAPI schema FastAPI serves at ``/docs`` and ``/openapi.json``.

Decoding is greedy unless a request asks otherwise: ``temperature`` defaults
to 0, not OpenAI's 1, so the same request gets the same answer (every benchmark
in duetime compares policies on identical outputs). ``temperature`` > 0 samples,
cut by ``top_p`` and vLLM's ``top_k`` and ``min_p``, reproducibly with a
``seed``; the presence, frequency and (vLLM's) repetition penalties apply
greedy or not. ``n`` > 1 runs that many sequences of the prompt (choice ``i``
samples with ``seed + i``; greedy choices are the same answer). ``logprobs``
with ``echo`` scores the prompt too (its first token has none), as
evaluation harnesses ask. ``response_format`` (OpenAI's JSON modes) or vLLM's
``structured_outputs`` / ``guided_*`` hold the answer to a JSON schema, a regex,
a choice of strings or a grammar (:meth:`_Common.grammar`). Fields that would
change the response's shape (``best_of`` > 1) or
that a client relies on for what the text is (``suffix``, ``tool_choice``
"auto", which needs a tool-call parser) are refused rather than silently
dropped: an answer that ignored them would look right and be wrong. A forced
tool call (``tool_choice`` "required" or a named function) needs no parser: the
answer is the call, held to the tools' schemas (:mod:`duetime.server.tool_calls`).

Types are strict (``"max_tokens": "3"`` or ``true`` is a 400, not 3 or 1), and
text must be valid Unicode: JSON's ``\ud800`` escapes can smuggle a lone
surrogate into a Python string that no tokenizer can encode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from duetime.core.grammar import GrammarSpec
from duetime.server.answer_constraints import (
    MAX_GRAMMAR_CHARS,
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
)
from duetime.server.body_fields import (
    MAX_CHOICES,
    MAX_MS,
    MAX_PROMPTS,
    MAX_TOKENS_LIMIT,
    StreamOptions,
    Text,
    TimeFields,
    TUFSpec,
    _Body,
)
from duetime.server.chat_messages import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDef,
    _forces_call,
    _shown_tools,
)
from duetime.server.response_shapes import ErrorBody, ErrorResponse, TimingInfo, Usage
from duetime.server.sampling_fields import _Common
from duetime.server.tool_calls import ForcedTools

__all__ = [
    "MAX_CHOICES",
    "MAX_GRAMMAR_CHARS",
    "MAX_MS",
    "MAX_PROMPTS",
    "MAX_TOKENS_LIMIT",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "ErrorBody",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDef",
    "JsonSchemaFormat",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "TUFSpec",
    "Text",
    "TimeFields",
    "TimingInfo",
    "TokenizeRequest",
    "ToolCall",
    "ToolDef",
    "Usage",
]


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: (
        Text
        | list[Annotated[int, Field(ge=0)]]
        | list[Text]
        | list[list[Annotated[int, Field(ge=0)]]]
    ) = Field(
        description=f"Text or a list of token ids; or up to {MAX_PROMPTS} of either, in a list "
        "(each gets n choices, numbered prompt by prompt)."
    )
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    suffix: str | None = Field(None, description="Not supported: null or empty.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="Log-probability of each answer token and of its N likeliest alternatives "
        "(0 to 5); with echo, of each prompt token after the first too.",
    )
    best_of: int | None = Field(None, description="Only 1 (or null).")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str | list):  # a list of prompts
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            for k, one in enumerate(v):
                if not one:
                    raise ValueError(f"prompt {k} must not be empty")
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: text, or token ids, one per entry."""
        p = self.prompt  # (validated: not empty)
        if isinstance(p, str) or not isinstance(p[0], str | list):
            return [cast(str | list[int], p)]
        return list(cast(list[str | list[int]], p))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported (no text insertion): leave it null")
        return v

    def logprob_top_n(self) -> int | None:
        """Alternatives listed per answer token; None where no log-probabilities were asked."""
        return self.logprobs

    def scores_prompt(self) -> bool:
        """Whether the prompt's tokens are scored too (``echo`` with ``logprobs``)."""
        return self.echo and self.logprobs is not None

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("best_of must be 1: one answer per request")
        return v


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = Field(
        None, description="Return the log-probability of each answer token."
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="With logprobs: also the N likeliest tokens at each position (0 to 20).",
    )
    tools: list[ToolDef] | None = Field(
        None, max_length=128, description="Functions the answer may call."
    )
    functions: list[Any] | None = Field(None, description="Only with function_call 'none'.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        validate_default=True,
        description="'required' (a call to one or more of the tools) or a named function: "
        "the answer is the call, its arguments held to the function's schema. 'none' "
        "ignores the tools. 'auto' (the default with tools) is refused: no tool-call parser.",
    )
    function_call: str | dict[str, Any] | None = Field(
        None, validate_default=True, description="'none' (or absent without functions)."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: tool_choice 'required' makes exactly one call."
    )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tool names must differ; {', '.join(twice)} is given twice")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _forced_or_none(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if v in ("none", "required") or isinstance(v, NamedToolChoice):
            if v != "none" and not tools:
                raise ValueError("a forced tool call needs tools")
            if isinstance(v, NamedToolChoice) and v.function.name not in {
                t.function.name for t in tools or ()
            }:
                raise ValueError(f"no tool is named {v.function.name!r}")
            return v
        if v is None and not tools:
            return v
        raise ValueError(
            "tool_choice 'auto' is not supported (no tool-call parser): use 'required' or "
            "name a function to force a call, or 'none' to ignore the tools"
        )

    @field_validator("function_call")
    @classmethod
    def _no_function_calls(cls, v: str | dict[str, Any] | None, info: ValidationInfo) -> Any:
        if v == "none" or (v is None and not info.data.get("functions")):
            return v
        raise ValueError(
            "function calls are not supported (the deprecated form): send tools with "
            "tool_choice 'required' or a named function, or function_call 'none'"
        )

    def forced_tools(self) -> ForcedTools | None:
        """How the answer is a tool call, where ``tool_choice`` forces one."""
        choice = self.tool_choice
        if not _forces_call(self.tools, choice):
            return None
        if isinstance(choice, NamedToolChoice):
            return ForcedTools(choice.function.name)
        return ForcedTools(None, parallel=self.parallel_tool_calls is not False)

    def shown_tools(self) -> list[ToolDef]:
        """The tools the prompt shows the model (those of a forced call)."""
        return _shown_tools(self.tools, self.tool_choice)

    def grammar(self) -> GrammarSpec | None:
        """The answer's constraint: a forced tool call's (its arguments' schema, or for
        'required' an array of calls) or, as for completions, the client's."""
        other = super().grammar()
        forced = self.forced_tools()
        if forced is None:
            return other
        if other is not None:
            raise ValueError(
                f"one constraint on the answer at a time, got tool_choice and {other.field}"
            )
        tools = [(t.function.name, t.function.arguments_schema()) for t in self.tools or ()]
        return GrammarSpec.json_schema(forced.schema(tools), "tool_choice")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprob_top_n(self) -> int | None:
        """Alternatives listed per answer token; None where no log-probabilities were asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        """The client's cap on the answer, or None where it sent none."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered as the chat
    route renders them (so the count is the chat answer's ``usage.prompt_tokens``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=256)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_special_tokens: bool = Field(True, description="The prompt's BOS (prompts only).")
    return_token_strs: bool = Field(False, description="Also each token's text.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("give a prompt or messages: neither is here")
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give a prompt or messages, not both")
        return self

    def shown_tools(self) -> list[ToolDef]:
        """The tools the chat prompt shows: those of a forced call, as the chat route."""
        return _shown_tools(self.tools, self.tool_choice)


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)
