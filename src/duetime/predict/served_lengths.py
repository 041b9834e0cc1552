"""How long the *served* model's answers are, learned online from the ones it writes.

The length predictor learned ShareGPT's answers (the model that wrote them), but a
server runs another model: base Gemma 3 270M, for one, writes until ``max_tokens``
on nearly every prompt, while the predictor expects a ShareGPT-like answer. Every
answer says how far off the predictor was for this model, so the server keeps the
newest finished ones, watches the running ones, and corrects each new prediction.

The correction is a ratio. For answer ``i`` with predicted point ``p_i`` (as the
predictor gave it, capped at the request's ``max_tokens``) and ``a_i`` tokens
written, ``r_i = log(a_i / p_i)``. Where the answer ended on its own, ``r_i`` is
what it is. Where it did not (yet): cut by ``max_tokens``, or still being written,
its natural length is only known to be at least ``a_i``: ``r_i`` is right-censored
there. The Kaplan-Meier estimate over both kinds gives the distribution of ``r``;
a new request with point ``p`` and cap ``m`` is then predicted
``L_q = min(m, p * exp(r_q))`` at quantile ``q``:

- the point at ``q = 1/2`` (the median: what minimises the absolute error, as the
  predictor's own median readout does);
- the interval at ``q = (1 - c) / 2`` and ``(1 + c) / 2`` for coverage ``c``.

Counting the running answers matters twice: it learns from a long answer before
it ends, and it undoes the bias of a window of finished answers, which short
answers reach first.

Where the estimate never reaches ``q`` (too few answers ended for the data to say
where the rest would) the data only say the answers went at least as far as they
did. ``r_q`` is then the 90th percentile of how far the unended ones went (a
maximum would follow one outlier), and ``L_q`` is never below the predictor's own
``q`` figure: a model that writes to the cap every time is soon predicted to
write to the cap, while at start-up, with answers a few tokens in, the
predictor's figures stand.

Until ``min_answers`` answers have finished, too few to estimate from, the
server starts careful: each point is raised to the top of the predictor's
interval, and only the "at least" evidence of the unended answers corrects it.
An accepted request stays on the engine, so an optimistic start would cost the
requests of the next minute, not just this one: measured on base Gemma with
every request asking for 512 tokens, the server accepted a dozen requests on the
predictor's word in its first 25 s, and those held the batch past every deadline
until 50 s.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from duetime.core.request import LengthPrediction

__all__ = ["Correction", "ServedLengths", "kaplan_meier_quantiles"]

#: Where no answer ended past them: this percentile of how far the unended ones went.
UNENDED_PERCENTILE = 90.0


def kaplan_meier_quantiles(
    values: np.ndarray, ended: np.ndarray, levels: Iterable[float]
) -> list[float]:
    """The ``levels`` quantiles of a right-censored sample (Kaplan-Meier).

    ``values[i]`` is an observation, ``ended[i]`` False where it is only a lower
    bound (censored). A quantile the estimate never reaches is ``inf``. Ties: events
    before censorings at the same value, the usual convention.
    """
    levels = list(levels)
    if len(values) == 0:
        return [math.inf] * len(levels)
    order = np.lexsort((~ended, values))  # by value; an event before a censoring at a tie
    v, e = values[order], ended[order]
    at_risk = len(v) - np.arange(len(v))
    cdf = 1.0 - np.cumprod(np.where(e, 1.0 - 1.0 / at_risk, 1.0))
    # only events move the estimate, so the first value reaching q is an event's
    ks = np.searchsorted(cdf, np.asarray(levels) - 1e-12, side="left")
    return [float(v[k]) if k < len(v) else math.inf for k in ks]


@dataclass(slots=True, frozen=True)
class Correction:
    """Quantiles of ``log(answer / predicted)`` at the interval's low end, the median
    and the high end (``inf``: not reached, see the module), how far the unended
    answers went (``floor``), and whether too few answers have finished to estimate
    from (``cold``: only the floor counts, and the point starts at the interval's top)."""

    lo: float
    mid: float
    hi: float
    floor: float
    cold: bool = False

    def apply(self, pred: LengthPrediction, most: float, coverage: float) -> LengthPrediction:
        """``pred`` corrected, never over ``most`` tokens."""
        base = max(pred.point, 1.0)
        if self.cold:
            pred = LengthPrediction(point=pred.hi, lo=pred.lo, hi=pred.hi, confidence=coverage)

        def at(r: float, own: float) -> float:
            if math.isinf(r):  # the data say: at least this far, and the predictor's own
                return min(most, max(round(base * math.exp(min(self.floor, 700.0))), own))
            return min(most, round(base * math.exp(min(r, 700.0))))  # whole tokens

        lo, point, hi = at(self.lo, pred.lo), at(self.mid, pred.point), at(self.hi, pred.hi)
        # a fallback can land the point above a reached high end: keep lo <= point <= hi
        point = max(point, lo)
        return LengthPrediction(point=point, lo=lo, hi=max(hi, point), confidence=coverage)


class ServedLengths:
    """The newest ``window`` finished answers, the running ones, and predictions
    corrected by both.

    Safe to call from several threads: the engine's reports answers that end, the
    event loop starts them and corrects predictions.
    """

    def __init__(self, window: int = 1000, min_answers: int = 16, coverage: float = 0.9) -> None:
        if window < 1 or min_answers < 1:
            raise ValueError(f"window and min_answers must be >= 1, got {window}, {min_answers}")
        if not 0.0 < coverage < 1.0:
            raise ValueError(f"coverage must be in (0, 1), got {coverage}")
        self.min_answers = min_answers
        self.coverage = coverage
        self._levels = ((1.0 - coverage) / 2.0, 0.5, (1.0 + coverage) / 2.0)
        self._ratios: deque[float] = deque(maxlen=window)  # log(answer / predicted)
        self._ended: deque[bool] = deque(maxlen=window)  # False: cut by max_tokens
        self._running: dict[int, float] = {}  # request id -> its predicted point
        self._lock = threading.Lock()

    # --- answers -------------------------------------------------------------------------------
    def start(self, rid: int, predicted: float) -> None:
        """Request ``rid``, whose point was ``predicted``, is on its way to the engine."""
        with self._lock:
            self._running[rid] = max(predicted, 1.0)

    def end(self, rid: int, tokens: int, reason: str) -> None:
        """Request ``rid`` ended with ``tokens`` tokens: ``stop`` (on its own) and
        ``length`` (cut by ``max_tokens``) are learned from, anything else (an abort,
        an error) only forgotten."""
        with self._lock:
            predicted = self._running.pop(rid, None)
            if predicted is None or reason not in ("stop", "length"):
                return
            if reason == "length" and tokens < 1:
                return  # a cut at 0 tokens says nothing
            self._ratios.append(math.log(max(tokens, 0.5) / predicted))  # empty: half a token
            self._ended.append(reason == "stop")

    @property
    def running(self) -> int:
        return len(self._running)

    def summary(self) -> tuple[int, float | None]:
        """(finished answers in the window, the share of them ``max_tokens`` cut)."""
        with self._lock:
            n = len(self._ended)
            return n, (None if n == 0 else 1.0 - sum(self._ended) / n)

    # --- corrections ---------------------------------------------------------------------------
    def correction(self, progress: Iterable[tuple[int, int]] = ()) -> Correction:
        """The correction the answers give now; ``progress``: (request id, tokens written
        so far) of running requests (the engine's image)."""
        with self._lock:
            finished = len(self._ratios)
            values = list(self._ratios)
            ended = list(self._ended)
            for rid, made in progress:
                predicted = self._running.get(rid)
                if predicted is not None and made >= 1:
                    values.append(math.log(made / predicted))
                    ended.append(False)
        v = np.asarray(values, dtype=float)
        e = np.asarray(ended, dtype=bool)
        cold = finished < self.min_answers
        if cold:  # too few ended to estimate where: only how far the unended went counts
            lo = mid = hi = math.inf
            e[:] = False
        else:
            lo, mid, hi = kaplan_meier_quantiles(v, e, self._levels)
        last_end = v[e].max() if e.any() else -math.inf
        beyond = v[~e & (v > last_end)]
        floor = float(np.percentile(beyond, UNENDED_PERCENTILE)) if len(beyond) else -math.inf
        return Correction(lo, mid, hi, floor, cold)

    def correct(
        self, pred: LengthPrediction, most: float, correction: Correction | None
    ) -> LengthPrediction:
        """``pred`` as this model's answers say it should be (``correction``, from
        :meth:`correction`; None: unchanged), never over ``most`` tokens."""
        if correction is None:
            return pred.capped(most)
        return correction.apply(pred, most, self.coverage)
