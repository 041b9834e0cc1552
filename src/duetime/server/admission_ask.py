"""What admission judges and answers: the sequences of one HTTP request (an ask), the
answer a forecast assumes for each, and the verdict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from duetime.core.grammar import AnswerWork
from duetime.core.request import Job, assumed_answer

__all__ = ["Verdict", "assumed_answer"]


@dataclass(slots=True, frozen=True)
class Verdict:
    accept: bool
    reason: str = ""
    why: str = ""  # "queue" or "deadline" for a refusal (the metric label)
    retry_after_s: int = 0
    predicted_finish_s: float | None = None  # seconds from now
    degraded: bool = False
    which: int = 0  # the request judged that a refusal is about (index into those judged)


@dataclass(slots=True, frozen=True)
class _Ask:
    """The sequences of one HTTP request and what judging them takes (see
    :meth:`Admission.admit`)."""

    jobs: Sequence[Job]
    budget_s: float | None
    allows_eviction: bool
    cached: Mapping[int, int]
    longest: int | None
    work: AnswerWork | None = None

    def assumed(self, job: Job) -> Job:
        """What a forecast plays one of them as: its assumed answer a step a token, no
        more steps than its grammar's answers took, the forced rows riding in them."""
        tokens = assumed_answer(job.request, most=self.longest)
        return Job(job.request, int(self.at_most_steps(tokens)), ride_rows=self.ride_rows(tokens))

    def at_most_steps(self, tokens: float) -> float:
        """``tokens`` judged as steps: no more than its grammar's answers took."""
        return tokens if self.work is None else min(tokens, self.work.steps)

    def ride_rows(self, tokens: float) -> int:
        """The forced rows riding in the steps of an answer of ``tokens`` tokens: its
        grammar's answers' rows, no more than the tokens its steps do not make."""
        if self.work is None:
            return 0
        return int(min(self.work.rows, max(tokens - self.at_most_steps(tokens), 0)))
