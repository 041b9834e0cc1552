"""Request and response bodies of the OpenAI-compatible API, with duetime's time fields.

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

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from duetime.core.grammar import GrammarSpec
from duetime.core.request import MAX_TUF_MAGNITUDE
from duetime.core.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SamplingParams
from duetime.server.tool_calls import ForcedTools

#: Upper bound on any millisecond field: about 11.6 days, far past any sane deadline.
MAX_MS = 1e9
#: Upper bound on max_tokens accepted at all (the context length is checked later).
MAX_TOKENS_LIMIT = 1 << 20
#: Upper bound on n, the choices (sequences) one request may ask for.
MAX_CHOICES = 16
#: Upper bound on the prompts of one completions request (each gets n choices).
MAX_PROMPTS = 64


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"character {e.start} is a lone surrogate ({text[e.start]!a}): not valid Unicode"
        ) from None
    return text


#: A string that can be encoded: what the tokenizer, the metrics and the logs receive.
Text = Annotated[str, AfterValidator(_unicode)]


class _Body(BaseModel):
    """What every part of a request body shares: strict types, and no NaN or Infinity
    (JSON parsers read them; a bound check would then report a misleading reason)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class TUFSpec(_Body):
    """TimelyLLM's time-utility function ``TUF(t) = min(β, α·(t − ERT) + β)``, times in ms."""

    model_config = ConfigDict(extra="forbid")

    ert_ms: float = Field(ge=0, le=MAX_MS, description="Expected response time (ms).")
    beta: float = Field(1.0, gt=0, le=MAX_TUF_MAGNITUDE, description="Utility before ERT.")
    alpha: float = Field(
        -2.0, le=0, ge=-MAX_TUF_MAGNITUDE, description="Slope after ERT (utility per second)."
    )


class TimeFields(_Body):
    """duetime's extensions, shared by both endpoints (send them through ``extra_body``)."""

    deadline_ms: float | None = Field(
        None,
        gt=0,
        le=MAX_MS,
        description="Deadline for the whole answer, in ms after the server receives the request.",
    )
    time_budget_ms: float | None = Field(
        None, gt=0, le=MAX_MS, description="Alias of deadline_ms (TimeBill's time budget T)."
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Larger is more important.")
    tuf: TUFSpec | None = Field(None, description="Time-utility function for utility policies.")
    overrun: Literal["kill", "skip_next"] | None = Field(
        None,
        description="What happens past the deadline (policies that support it): kill the request "
        "or skip the next ones of its class.",
    )
    kv_eviction: Literal["off", "auto"] | Annotated[float, Field(ge=0, lt=1)] = Field(
        "off",
        description="'off', 'auto' (the policy may evict KV to meet the deadline, e.g. TimeBill) "
        "or a fixed eviction ratio in [0, 1). Allowing eviction lets admission accept a request "
        "with degraded quality instead of answering 429.",
    )
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens (benchmarks).")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT, description="Never stop before this.")
    segment: Literal["sentence", "paragraph", "action"] | None = Field(
        None,
        description="TimelyLLM segmented generation: suspend after each sentence, paragraph or "
        "robot action (a line like move(50)) keeping the KV cache, and resume when the client is "
        "expected to want more (reading time at 300 words/min; at once for actions).",
    )
    klass: Text = Field("default", max_length=64, description="Request class (per-class stats).")

    def allows_eviction(self) -> bool:
        """Whether the request lets the policy drop KV (a fixed ratio of 0 does not)."""
        if isinstance(self.kv_eviction, str):
            return self.kv_eviction == "auto"
        return self.kv_eviction > 0

    def deadline_s(self) -> float | None:
        ms = self.deadline_ms if self.deadline_ms is not None else self.time_budget_ms
        return None if ms is None else ms / 1000.0


class StreamOptions(_Body):
    include_usage: bool = False


#: Upper bound on a regular expression or grammar's text.
MAX_GRAMMAR_CHARS = 1 << 16


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: the answer is JSON under ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text = Field("response", max_length=256)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema (absent: any JSON value)."
    )
    strict: bool | None = Field(
        None, description="Accepted; the schema is always enforced, strict or not."
    )


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one constraint on the answer."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | Text | None = Field(
        None, alias="json", description="A JSON schema (an object, or its text)."
    )
    regex: Text | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=4096
    )
    grammar: Text | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="Lark or GBNF."
    )
    json_object: bool | None = Field(None, description="true: any JSON object.")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = ", ".join(g.rstrip("_") for g in given) or "none"
            raise ValueError(
                "give exactly one of json, regex, choice, grammar, json_object; got " + names
            )
        return self

    def spec(self, field: str) -> GrammarSpec:
        if self.json_ is not None:
            return GrammarSpec.json_schema(self.json_, f"{field}.json")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, f"{field}.regex")
        if self.choice is not None:
            return GrammarSpec.choice(self.choice, f"{field}.choice")
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar, f"{field}.grammar")
        return GrammarSpec.json_schema({"type": "object"}, f"{field}.json_object")


class _Common(TimeFields):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(
        0.0,
        ge=0,
        le=2,
        description="0 (the default, unlike OpenAI's 1): greedy, the same answer every time; "
        "above 0: sample from the logits divided by it.",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Sample from the likeliest tokens holding this much mass."
    )
    top_k: int = Field(
        -1, ge=-1, description="vLLM's extension: sample from the k likeliest (-1 or 0: all)."
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="vLLM's extension: drop tokens less likely than min_p times the likeliest.",
    )
    seed: int | None = Field(
        None, ge=-(1 << 63), lt=1 << 64, description="Makes sampling reproducible."
    )
    presence_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted once from each token the answer holds.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted per occurrence in the answer so far.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="vLLM's extension: logits of tokens in the prompt or answer are divided by "
        "it (multiplied when negative); 1 changes nothing.",
    )
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description=f"Choices to generate (1 to {MAX_CHOICES}), each a sequence of its own: "
        "choice i samples with seed + i.",
    )
    stop: Text | list[Annotated[Text, Field(min_length=1, max_length=256)]] | None = Field(
        None, description="Up to 4 stop strings; the answer ends before the first one."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=64,
        description="vLLM's extension: token ids that end the answer (the ending token is "
        "part of it), after min_tokens.",
    )
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        None,
        description="OpenAI's: json_object (any JSON object) or json_schema constrain the "
        "answer's tokens to valid JSON (under the schema); text (the default) does not.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's extension: the answer matches a JSON schema, a regex, one of a "
        "list of strings or a Lark/GBNF grammar.",
    )
    guided_json: dict[str, Any] | Text | None = Field(
        None, description="vLLM's older form of structured_outputs.json."
    )
    guided_regex: Text | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="Older structured regex."
    )
    guided_choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=4096, description="Older structured_outputs.choice."
    )
    guided_grammar: Text | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="Older grammar form."
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        max_length=1024,
        description="Token id (as a string) -> a bias in [-100, 100] added to its logit "
        "before sampling or the arg-max; -100 bans the token in effect.",
    )

    def grammar(self) -> GrammarSpec | None:
        """The constraint on the answer, if any (at most one may be given)."""
        specs = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(GrammarSpec.json_schema({"type": "object"}, "response_format"))
        elif fmt is not None and fmt.json_schema is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            specs.append(
                GrammarSpec.json_schema({} if schema is None else schema, "response_format")
            )
        if self.structured_outputs is not None:
            specs.append(self.structured_outputs.spec("structured_outputs"))
        if self.guided_json is not None:
            specs.append(GrammarSpec.json_schema(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            specs.append(GrammarSpec("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            specs.append(GrammarSpec.choice(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            specs.append(GrammarSpec("grammar", self.guided_grammar, "guided_grammar"))
        if len(specs) > 1:
            names = ", ".join(s.field.split(".")[0] for s in specs)
            raise ValueError(f"one constraint on the answer at a time, got {names}")
        return specs[0] if specs else None

    def sampling(self, choice: int = 0) -> SamplingParams:
        """How the engine picks choice ``choice``'s tokens (greedy at temperature 0); its
        seed is ``seed + choice``, kept in the 64 bits a generator takes."""
        seed = self.seed
        if seed is not None and choice:
            seed = (seed + choice) % (1 << 64)
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.token_biases(),
        )

    @model_validator(mode="after")
    def _one_grammar(self) -> Any:
        self.grammar()  # raises where several constraints were given
        return self

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_numbers(cls, v: Any) -> Any:
        """Integers are biases too (strict mode would refuse ``{"5": 100}``)."""
        if isinstance(v, dict):
            return {k: float(b) if type(b) is int else b for k, b in v.items()}
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or key != str(int(key)):
                raise ValueError(f"keys are token ids written as strings, not {key!r}")
            if abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"token {key}: a bias must be in [-100, 100], not {bias:g}")
        return v

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, ids ascending."""
        return tuple(sorted((int(k), b) for k, b in (self.logit_bias or {}).items()))

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


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


class ContentPart(_Body):
    type: Literal["text"]
    text: Text


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
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages, not both")
        return self

    def shown_tools(self) -> list[ToolDef]:
        """The tools the chat prompt shows: those of a forced call, as the chat route."""
        return _shown_tools(self.tools, self.tool_choice)


def _forces_call(tools: list[ToolDef] | None, choice: Any) -> bool:
    """Whether ``tool_choice`` makes the answer a call to one of ``tools``."""
    return bool(tools) and (choice == "required" or isinstance(choice, NamedToolChoice))


def _shown_tools(tools: list[ToolDef] | None, choice: Any) -> list[ToolDef]:
    """The tools a chat prompt shows the model: all of them where the answer must call
    one, none otherwise (with "none" they are ignored)."""
    return list(tools or ()) if _forces_call(tools, choice) else []


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)


class TimingInfo(BaseModel):
    """What duetime reports about one answer (top-level ``duetime`` field of a response)."""

    ttft_ms: float | None
    e2e_ms: float | None
    deadline_met: bool | None
    kv_eviction_ratio: float
    predicted_tokens: float | None
    #: When admission's forecast had the answer done, ms after arrival (requests with a
    #: deadline, judged by forecast); compare with ``e2e_ms``.
    predicted_e2e_ms: float | None = None
    preemptions: int = 0
    #: Tokens in the answer (also in a stream's last event, where usage may be absent):
    #: what a gateway's speed estimate divides by.
    completion_tokens: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object."""

    error: ErrorBody
