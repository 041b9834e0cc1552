"""What every request body is built from: bounds, strict text, and duetime's time fields.

Types are strict (``"max_tokens": "3"`` or ``true`` is a 400, not 3 or 1), and
text must be valid Unicode: JSON's ``\ud800`` escapes can smuggle a lone
surrogate into a Python string that no tokenizer can encode. The time-aware
extensions (:class:`TimeFields`) arrive through the client's ``extra_body``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from duetime.core.request import MAX_TUF_MAGNITUDE

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
    """What every part of a request body shares: strict types, no NaN or Infinity
    (JSON parsers read them; a bound check would then report a misleading reason),
    and ``null`` for a field with a default meaning that default."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's API takes ``null`` for its optional fields, and clients send it
        (``"temperature": null``, ``"max_tokens": null``): it was a 400 ("Input should
        be a valid number"). A required field's ``null`` stays, and is refused."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        defaulted = {
            field.alias or name
            for name, field in cls.model_fields.items()
            if not field.is_required() and field.default is not None
        }
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


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

    @model_validator(mode="after")
    def _one_deadline(self) -> TimeFields:
        """``time_budget_ms`` is another name for ``deadline_ms``: two different values
        would leave one of them ignored without a word."""
        both = (self.deadline_ms, self.time_budget_ms)
        if None not in both and both[0] != both[1]:
            raise ValueError(
                f"deadline_ms {both[0]:g} and time_budget_ms {both[1]:g} are the same "
                "field under two names: give one"
            )
        return self

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
