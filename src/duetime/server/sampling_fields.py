"""What both generation endpoints share: sampling, penalties, stops, choices, and the
constraint on the answer.

Decoding is greedy unless a request asks otherwise (``temperature`` defaults to 0,
see :mod:`duetime.server.schemas`); :meth:`_Common.sampling` builds what the engine
draws with and :meth:`_Common.grammar` the one constraint a request may carry.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from duetime.core.grammar import GrammarSpec
from duetime.core.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SamplingParams
from duetime.server.answer_constraints import (
    MAX_GRAMMAR_CHARS,
    ResponseFormat,
    StructuredOutputs,
)
from duetime.server.body_fields import MAX_CHOICES, StreamOptions, Text, TimeFields

#: The longest stop string a request may give, in characters.
MAX_STOP_CHARS = 256


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
    stop: Text | list[Text] | None = Field(
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
            raise ValueError(f"stop takes up to 4 non-empty strings, got {stops!r}"[:200])
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return stops
