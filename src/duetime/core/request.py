"""What a client asks for, and what only the executor knows about it.

A :class:`Request` is the public part: everything a policy may look at. A
:class:`Job` pairs it with the hidden ground truth (the true output length and
segment lengths) that an executor needs to play a workload back. Keeping the
truth outside ``Request`` is how we guarantee that no policy can peek at it: an
"oracle" policy gets the truth only through an oracle *predictor* that fills
``Request.predicted``, exactly like a learned predictor would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Latest time a request may name (arrival, deadline, gap), in seconds (~31.7 years).
#: Past ~1e10 s a double no longer resolves a microsecond, and past ~1e17 s adding a
#: step leaves the clock where it was: latencies come out 0 and a run may never end.
MAX_TIME_S = 1e9

#: Largest |alpha| and |beta| of a time-utility function (the server and trace files
#: both bound them): alpha = -1e308 made a finite request's utility -inf.
MAX_TUF_MAGNITUDE = 1e6


@dataclass(slots=True, frozen=True)
class LengthPrediction:
    """A predicted number of output tokens: a point estimate and an interval.

    ``lo <= point <= hi``; ``confidence`` in [0, 1] says how much the predictor
    trusts itself (1 for an oracle). Policies of the Amin/Amax family consume
    the interval, TimeBill consumes the point (and a WCET derived from it).
    """

    point: float
    lo: float
    hi: float
    confidence: float = 1.0

    def __post_init__(self) -> None:
        if not (self.lo <= self.point <= self.hi):
            raise ValueError(f"prediction must satisfy lo <= point <= hi, got {self}")
        if self.lo < 0:
            raise ValueError(f"predicted lengths must be >= 0, got lo={self.lo}")

    @classmethod
    def exact(cls, n: float) -> LengthPrediction:
        """A degenerate interval: what an oracle knows."""
        return cls(point=n, lo=n, hi=n, confidence=1.0)

    def capped(self, most: float) -> LengthPrediction:
        """This prediction, no longer than the ``most`` tokens the request may answer."""
        return LengthPrediction(
            point=min(self.point, most),
            lo=min(self.lo, most),
            hi=min(self.hi, most),
            confidence=self.confidence,
        )


@dataclass(slots=True, frozen=True)
class TimeUtility:
    """TimelyLLM's time-utility function, Eq. 1: ``TUF(t) = min(β, α·(t − ERT) + β)``.

    ``t`` is the response time in seconds (from arrival), ``ert`` the expected
    response time, ``beta`` the utility when on time and ``alpha`` (<= 0) the
    slope after ERT. Utility is not clipped below zero: the paper lets late
    answers cost utility, which is what makes the urgency visible.
    """

    ert: float
    beta: float = 1.0
    alpha: float = -2.0

    def __call__(self, t: float) -> float:
        return min(self.beta, self.alpha * (t - self.ert) + self.beta)

    def later_segment(self) -> TimeUtility:
        """TUF1: same α and β, ERT = 0 (the next segment is wanted at once)."""
        return TimeUtility(ert=0.0, beta=self.beta, alpha=self.alpha)


@dataclass(slots=True)
class Request:
    """A generation request as a policy sees it. Times are seconds on the executor's clock.

    ``deadline`` is absolute; use :attr:`time_budget` for the relative form.
    ``max_tokens`` caps generation (TimeBill's ``N_max``). ``prompt_token_ids``
    is only needed by the real engine; the simulator works from ``prompt_len``.
    ``prompt_text`` is the prompt as the client sent it, for predictors that
    read text (the learned length predictor); optional, like the ids.
    ``prefix_group`` and ``prefix_len`` say, without the ids, that the first
    ``prefix_len`` tokens are those of every request in the same group (a system
    prompt, a robot's instructions): what a simulated prefix cache can reuse.
    """

    rid: int
    arrival: float
    prompt_len: int
    max_tokens: int = 4096
    deadline: float | None = None
    priority: int = 0
    tuf: TimeUtility | None = None
    predicted: LengthPrediction | None = None
    klass: str = "default"
    prompt_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = True
    prompt_text: str | None = None
    overrun: str | None = (
        None  # per-request overrun strategy ("kill", "skip-next"); None = policy's
    )
    kv_eviction: str | float | None = None  # "off", "auto" or a fixed ratio; None = policy's
    prefix_group: str | None = None
    prefix_len: int = 0
    #: When a forecast of the server's state (``sim/forecast.py``) had the answer done,
    #: absolute; None where none was made. Set at admission, reported to the client.
    forecast_finish: float | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.rid}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.rid}: max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.arrival) or self.arrival < 0:
            raise ValueError(f"request {self.rid}: arrival must be finite and >= 0")
        if self.prefix_group is None:
            if self.prefix_len:
                raise ValueError(f"request {self.rid}: prefix_len without a prefix_group")
        elif not 1 <= self.prefix_len <= self.prompt_len:
            raise ValueError(
                f"request {self.rid}: prefix_len must be in 1..prompt_len={self.prompt_len}, "
                f"got {self.prefix_len}"
            )

    @property
    def time_budget(self) -> float | None:
        """Deadline relative to arrival, or None."""
        return None if self.deadline is None else self.deadline - self.arrival


@dataclass(slots=True)
class Job:
    """A request plus the ground truth an executor needs to play it back.

    ``output_len`` is the true number of tokens the answer has (the simulator
    stops there; the real engine, with ``ignore_eos``, does too).
    ``segments`` splits ``output_len`` into TimelyLLM segments; after segment
    ``k`` the client is busy for ``segment_gaps[k]`` seconds (robot action,
    reading) before it wants segment ``k + 1``. An empty ``segments`` means one
    segment.

    ``segment_gap_estimates`` is what the server is told each gap will take
    (TimelyLLM §4.3: the robot's execution-time model, which for an action whose
    time varies with the scenario, such as a search, gives its *minimum*). The
    executor's ``Seq.ready_at``, which policies read, comes from these; the
    client's true wants (``RequestRecord.segment_ready``, what is scored) from
    ``segment_gaps``. Empty: the server knows the true gaps.

    ``ride_rows`` is work beside the answer's steps that the simulator charges: an
    answer under a grammar takes ``output_len`` engine steps while its forced runs
    ride along as extra rows of those steps (jump-forward, ``engine/executor.py``),
    ``ride_rows`` in all, spread evenly over its decode steps. The real engine
    ignores it (it rides for real); a forecast of a structured answer sets it
    (``server/admission.py``), so the rows' time is not missed.
    """

    request: Request
    output_len: int
    segments: tuple[int, ...] = field(default=())
    segment_gaps: tuple[float, ...] = field(default=())
    segment_gap_estimates: tuple[float, ...] = field(default=())
    ride_rows: int = 0

    def __post_init__(self) -> None:
        rid = self.request.rid
        if self.output_len < 1:
            raise ValueError(f"job {rid}: output_len must be >= 1, got {self.output_len}")
        if self.ride_rows < 0:
            raise ValueError(f"job {rid}: ride_rows must be >= 0, got {self.ride_rows}")
        if self.segments:
            if sum(self.segments) != self.output_len or min(self.segments) < 1:
                raise ValueError(
                    f"job {rid}: segments {self.segments} must be >= 1 and sum to "
                    f"output_len={self.output_len}"
                )
            if len(self.segment_gaps) not in (0, len(self.segments) - 1):
                raise ValueError(
                    f"job {rid}: need len(segments) - 1 = {len(self.segments) - 1} gaps, "
                    f"got {len(self.segment_gaps)}"
                )
        estimates = self.segment_gap_estimates
        if estimates and len(estimates) != len(self.segment_gaps):
            raise ValueError(
                f"job {rid}: need one gap estimate per gap ({len(self.segment_gaps)}), "
                f"got {len(estimates)}"
            )
        if any(not (math.isfinite(g) and g >= 0) for g in self.segment_gaps + estimates):
            raise ValueError(f"job {rid}: segment gaps and their estimates must be finite, >= 0")

    def gap(self, k: int) -> float:
        """The client's true gap after segment ``k`` (0 where the job gives none)."""
        return self.segment_gaps[k] if k < len(self.segment_gaps) else 0.0

    def gap_estimate(self, k: int) -> float:
        """What the server expects the gap after segment ``k`` to be (the true one
        where the job gives no estimate)."""
        if k < len(self.segment_gap_estimates):
            return self.segment_gap_estimates[k]
        return self.gap(k)


def assumed_answer(req: Request, generated: int = 0, most: int | None = None) -> int:
    """Answer tokens a forecast takes ``req`` to have, ``generated`` of them made: its
    predicted length (without one, ``max_tokens`` or the ``most`` it can be), or the top
    of the predicted interval once the answer has passed the point; at least one more
    than it has. Server admission and the fleet's routers forecast by this one rule: a
    forecast sees no oracle."""
    cap = req.max_tokens if most is None else max(1, min(req.max_tokens, most))
    p = req.predicted
    if p is None:
        return cap
    n = p.point if generated < p.point else p.hi
    return int(min(cap, max(generated + 1, math.ceil(n))))
