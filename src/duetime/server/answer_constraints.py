"""The answer's constraints as clients send them: OpenAI's ``response_format`` and
vLLM's ``structured_outputs``, each turned into one :class:`GrammarSpec`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from duetime.core.grammar import GrammarSpec
from duetime.server.body_fields import Text, _Body

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
