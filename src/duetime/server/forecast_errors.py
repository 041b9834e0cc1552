"""How wrong admission's forecasts have been lately, as a margin for a target hit rate.

A forecast of a request's end-to-end time misses by what no forecast can know:
when the answers on the engine end, what arrives meanwhile (Poisson bursts),
the step-cost model's error. Accepting every request forecast to finish by its
deadline therefore meets the deadline for only some of them (0.90 of the accepted
in `duetime bench admission`'s default load). A server asked for a *confidence*
``c`` instead accepts a request only if

    forecast e2e * q_c <= deadline - arrival

where ``q_c`` is the split-conformal ``c`` quantile of ``actual e2e / forecast e2e``
over the newest finished requests that had a forecast: with exchangeable errors,
an accepted request is then late with probability at most ``1 - c``.

Only requests that were at risk count (forecast at least ``at_risk`` of their
budget): a 1-token answer forecast at 0.2 s and served in 0.5 s is 2.5x off and
late for nothing, and such ratios would inflate the margin for everyone.
Until ``min_samples`` such requests have finished the margin is 1 (the plain
forecast). ``q_c`` below 1 (forecasts too pessimistic lately) accepts more.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np

__all__ = ["ForecastErrors", "check_confidence"]


def check_confidence(confidence: float) -> float:
    """``confidence`` if it is a share a target can be (NaN is refused too)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"deadline confidence must be in (0, 1), got {confidence}")
    return confidence


class ForecastErrors:
    def __init__(
        self,
        confidence: float,
        *,
        window: int = 500,
        min_samples: int = 20,
        at_risk: float = 0.5,
    ) -> None:
        check_confidence(confidence)
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be >= 1, got {window}, {min_samples}")
        self.confidence = confidence
        self.min_samples = min_samples
        self.at_risk = at_risk
        self._ratios: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, forecast_e2e: float, actual_e2e: float, budget_s: float) -> None:
        """A finished request forecast at ``forecast_e2e`` s took ``actual_e2e`` s; its
        deadline was ``budget_s`` s after arrival."""
        if forecast_e2e <= 0 or forecast_e2e < self.at_risk * budget_s:
            return
        with self._lock:
            self._ratios.append(actual_e2e / forecast_e2e)

    @property
    def samples(self) -> int:
        return len(self._ratios)

    def margin(self) -> float:
        """``q_c``: the factor a forecast is stretched by before it is held against the
        deadline (1 until ``min_samples``)."""
        with self._lock:
            n = len(self._ratios)
            if n < self.min_samples:
                return 1.0
            ratios = np.sort(np.fromiter(self._ratios, float))
        k = min(n, math.ceil((n + 1) * self.confidence))  # the conformal rank, 1-based
        return float(ratios[k - 1])
