"""The outcome of one request, as every executor reports it to `duetime.metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field

from duetime.core.request import Request


@dataclass(slots=True)
class RequestRecord:
    """Timestamps and counts for one finished or cancelled request.

    Times are absolute seconds on the executor's clock. ``segment_done[k]``
    is when TimelyLLM segment ``k`` completed (one entry for an unsegmented
    request). ``segment_ready[k]`` is when the client wanted segment
    ``k + 1`` (the end of the gap after segment ``k``), so a completed request
    has one fewer ready time than done times and segment ``k``'s waiting time
    is ``segment_done[k] − segment_ready[k − 1]``. ``finish`` is None when the
    request was cancelled. ``cached_prompt_tokens``: prompt tokens whose KV a
    prefix cache supplied at the request's last admission (0 without one; None
    until it is admitted).
    """

    request: Request
    first_token: float | None = None
    finish: float | None = None
    cancelled_at: float | None = None
    output_tokens: int = 0
    target_tokens: int = 0
    num_preemptions: int = 0
    kv_evicted_ratio: float = 0.0
    cached_prompt_tokens: int | None = None
    segment_done: list[float] = field(default_factory=list)
    segment_ready: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.finish is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.request.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.request.arrival

    @property
    def tbt(self) -> float | None:
        """Mean time between output tokens after the first."""
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def deadline_met(self) -> bool | None:
        """None when the request had no deadline."""
        d = self.request.deadline
        if d is None:
            return None
        return self.finish is not None and self.finish <= d + 1e-12
