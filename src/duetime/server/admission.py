"""Admission control: refuse early what cannot be served in time.

A request is refused with 429 (and ``Retry-After``) when the queue is full, or
when even an optimistic estimate of its finish time misses its deadline:

    t̂_finish = now + T_prefill(queued prompt tokens) + T_prefill(prompt − cached)
               + N̂ · t_step(running + 1 decoders, KV in use + prompt)

with ``N̂`` the predicted answer length (exactly ``max_tokens`` when the
client asked for ``ignore_eos``), ``cached`` the prompt tokens the prefix
cache holds now (their prefill is a copy), and step times from
:class:`StepTimer`. The
estimate ignores whatever a policy may put ahead of the request later, so it
errs towards accepting: a request it refuses had no chance under FCFS order.
A request that allows KV eviction (``kv_eviction`` not ``off``) is accepted
anyway, flagged as degraded: the policy (TimeBill) may trade quality for time.
Until the timer has a model, deadlines are not judged at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duetime.server.engine_loop import EngineStats
from duetime.server.step_timer import StepTimer

__all__ = ["Admission", "Verdict"]


@dataclass(slots=True, frozen=True)
class Verdict:
    accept: bool
    reason: str = ""
    why: str = ""  # "queue" or "deadline" for a refusal (the metric label)
    retry_after_s: int = 0
    predicted_finish_s: float | None = None  # seconds from now
    degraded: bool = False


class Admission:
    def __init__(self, timer: StepTimer, *, max_waiting: int = 256) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.timer = timer
        self.max_waiting = max_waiting

    def estimate(
        self, stats: EngineStats, prompt_len: int, tokens: float, cached_tokens: int = 0
    ) -> float | None:
        """Optimistic seconds from now to the last token, or None without a step model."""
        if not self.timer.ready:
            return None
        t = self.timer.prefill_time(stats.waiting_prefill_tokens + prompt_len - cached_tokens)
        step = self.timer.step_time(0, stats.running + 1, stats.kv_used + prompt_len)
        return t + max(tokens - 1, 0.0) * step

    def judge(
        self,
        stats: EngineStats,
        queued: int,
        *,
        prompt_len: int,
        tokens: float,
        budget_s: float | None,
        allows_eviction: bool,
        cached_tokens: int = 0,
    ) -> Verdict:
        """``queued``: requests waiting in the engine plus those not yet handed to it;
        ``cached_tokens``: of the prompt, those the prefix cache holds."""
        if queued >= self.max_waiting:
            drain = self.timer.prefill_time(stats.waiting_prefill_tokens)
            return Verdict(
                False,
                f"the queue is full ({queued} requests waiting, limit {self.max_waiting})",
                why="queue",
                retry_after_s=max(1, math.ceil(drain)),
            )
        eta = self.estimate(stats, prompt_len, tokens, cached_tokens)
        if budget_s is None or eta is None or eta <= budget_s:
            return Verdict(True, predicted_finish_s=eta)
        if allows_eviction:
            return Verdict(
                True, "accepted with KV eviction allowed", predicted_finish_s=eta, degraded=True
            )
        return Verdict(
            False,
            f"the deadline cannot be met: predicted finish in {eta * 1000:.0f} ms "
            f"> {budget_s * 1000:.0f} ms ({tokens:.0f} predicted tokens, "
            f"{stats.running} running, {stats.waiting} waiting)",
            why="deadline",
            retry_after_s=max(1, math.ceil(eta - budget_s)),
            predicted_finish_s=eta,
        )
