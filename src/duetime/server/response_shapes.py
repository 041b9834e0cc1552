"""What the API answers beside the text: duetime's timing report, token usage, errors."""

from __future__ import annotations

from pydantic import BaseModel


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
