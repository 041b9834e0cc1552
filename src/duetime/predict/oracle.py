"""Length predictors that see the truth: the oracle, and the oracle with a set error.

They run on the executor side (they are handed the :class:`Job`, which holds
the hidden length) and write ``Request.predicted``; policies then read the
prediction exactly as they would read a learned one. That keeps "oracle" a
property of the experiment, never of the policy.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from duetime.core.request import Job, LengthPrediction


class JobPredictor(Protocol):
    """Annotates a job's request with a length prediction before it is scheduled."""

    name: str

    def predict_job(self, job: Job) -> LengthPrediction: ...


class OraclePredictor:
    """Knows the true output length exactly."""

    name = "oracle"

    def predict_job(self, job: Job) -> LengthPrediction:
        return LengthPrediction.exact(float(job.output_len))


class NoisyOraclePredictor:
    """The truth times a log-normal error of set size, with an interval that covers it.

    The point is ``o · exp(ε)``, ``ε ~ N(0, σ²)`` with ``σ = rel_error``; the
    interval is ``point · exp(∓z·σ)`` with ``z`` the normal quantile for
    ``coverage`` (so it covers the truth with that probability). Seeded.
    """

    name = "noisy"

    def __init__(self, rel_error: float = 0.3, coverage: float = 0.9, seed: int = 0) -> None:
        if not (math.isfinite(rel_error) and rel_error >= 0):
            raise ValueError(f"rel_error must be finite and >= 0, got {rel_error}")
        if not 0 < coverage < 1:
            raise ValueError(f"coverage must be in (0, 1), got {coverage}")
        from scipy.stats import norm

        self.rel_error = rel_error
        self.z = float(norm.ppf(0.5 + coverage / 2))
        self._rng = np.random.default_rng(seed)

    def predict_job(self, job: Job) -> LengthPrediction:
        sigma = self.rel_error
        # Nothing outputs more than max_tokens, so neither point nor interval goes past it
        # (as the learned predictor's N_max): at sigma = 5 the bound reached 1e9 tokens,
        # which Amax reserves KV for. Exponents are clipped, not the products: no overflow.
        cap = float(job.request.max_tokens)
        eps = float(self._rng.normal(0.0, sigma))
        point = job.output_len * float(np.exp(min(eps, math.log(cap / job.output_len))))
        point = min(max(1.0, point), cap)  # exp(log(x)) may round past the cap
        lo = max(1.0, point * float(np.exp(-self.z * sigma)))
        hi = min(point * float(np.exp(min(self.z * sigma, math.log(cap / point)))), cap)
        return LengthPrediction(
            point=point, lo=min(lo, point), hi=max(hi, point), confidence=max(0.0, 1.0 - sigma)
        )


def make_job_predictor(spec: str | None, seed: int = 0) -> JobPredictor | None:
    """``None``/"none", "oracle", "noisy", "noisy:0.5" (relative error), "interval:…"
    (the Amin/Amax paper's intervals, see :mod:`duetime.predict.intervals`) or
    "learned[:path]" (the trained response-length predictor, see
    :mod:`duetime.predict.length_predictor`)."""
    if spec is None or spec == "none":
        return None
    if spec == "oracle":
        return OraclePredictor()
    if spec.startswith("interval:"):
        from duetime.predict.intervals import make_interval_predictor

        return make_interval_predictor(spec)
    if spec == "learned" or spec.startswith("learned:"):
        # TimeBill's RLP from the prompt text (never the truth); see predict/length_predictor.py
        from duetime.predict.length_predictor import make_learned_predictor

        return make_learned_predictor(spec)
    if spec == "noisy" or spec.startswith("noisy:"):  # not "noisy0.9", which read as noisy:0.3
        _, _, err = spec.partition(":")
        try:
            return NoisyOraclePredictor(rel_error=float(err) if err else 0.3, seed=seed)
        except ValueError as e:
            raise ValueError(f"bad predictor {spec!r}: {e}") from None
    raise ValueError(
        f"unknown predictor {spec!r}; use none, oracle, noisy, noisy:<rel_error>, interval:… "
        "or learned[:path]"
    )
