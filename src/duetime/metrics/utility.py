"""TimelyLLM time utility and robot waiting time, computed per request on arrays.

TimelyLLM (``timelyllm.txt``) scores a request by the utility of its
segments' *waiting times* (Eq. 3)::

    U_i = TUF0_i(W(s_0)) + Σ_{k=1..K} TUF1_i(W(s_k))
    TUF0(t) = min(β, α·(t − ERT) + β)          (Eq. 1, the request's own TUF)
    TUF1(t) = min(β, α·max(t, 0) + β)          (§4.2: same α, β; ERT = 0)

where ``W(s_0)`` is the response time (arrival → segment 0 done) and, for
``k ≥ 1``, ``W(s_k)`` is how long the client waited for segment ``k`` after
it was ready for it: ``max(0, segment_done[k] − ready_k)``. A segment
generated before the client wanted it costs no waiting.

Reading the record the way the simulator writes it: segment 0 is wanted at
arrival, and at each segment boundary the executor appends when the client
will want the *next* segment, so ``ready_k = segment_ready[k − 1]``
(a completed request has one fewer ready time than done times; a request
suspended between segments has as many). Where an executor reported no
ready time for segment ``k`` we take ``segment_done[k − 1]``: the client
wants the next segment at once.

A request that never finished is scored, not dropped, so that a policy cannot
raise utility by cancelling: the segment it was on when the run ended is
evaluated at the run ``horizon`` (segment 0 as ``TUF0(horizon − arrival)``,
a later one as ``TUF1(horizon − ready)``). Because TUFs are non-increasing
this is the most utility the request could still have earned. Segments after
that one are unknown to the record and add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duetime.metrics.columns import Columns


def tuf0(t: np.ndarray, ert: np.ndarray, beta: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """TimelyLLM Eq. 1, vectorised; equals :meth:`TimeUtility.__call__` element-wise."""
    return np.minimum(beta, alpha * (t - ert) + beta)


def tuf1(t: np.ndarray, beta: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """TUF for a later segment (TimelyLLM §4.2): ERT = 0 and negative waits clipped."""
    return np.minimum(beta, alpha * np.maximum(t, 0.0) + beta)


@dataclass(slots=True, frozen=True)
class SegmentOutcome:
    """Per-request arrays (length ``n``); NaN where the quantity does not apply.

    ``utility``: Eq. 3 (all segments), NaN for requests without a TUF.
    ``first_utility``: Eq. 2, ``TUF0(W(s_0))`` only, NaN without a TUF.
    ``robot_wait``: ``Σ_k W(s_k)`` for completed requests, NaN otherwise.
    """

    utility: np.ndarray
    first_utility: np.ndarray
    robot_wait: np.ndarray


def segment_outcomes(cols: Columns, horizon: float | None) -> SegmentOutcome:
    """Score every request's segments; ``horizon`` is when unfinished ones are judged."""
    n = cols.n
    lens = cols.seg_done_len
    starts = np.cumsum(lens) - lens
    req = np.repeat(np.arange(n), lens)
    k = np.arange(len(cols.seg_done)) - starts[req]
    done = cols.seg_done

    ready = done.copy()  # k == 0 entries are never read: segment 0 is wanted at arrival
    ready[1:] = done[:-1]  # default: the previous segment's completion
    reported = (k >= 1) & (k <= cols.seg_ready_len[req])  # ready_k = segment_ready[k - 1]
    rstarts = np.cumsum(cols.seg_ready_len) - cols.seg_ready_len
    ready[reported] = cols.seg_ready[(rstarts[req] + k - 1)[reported]]

    first = k == 0
    wait = np.where(first, done - cols.arrival[req], np.maximum(done - ready, 0.0))

    ert, beta, alpha = cols.tuf_ert[req], cols.tuf_beta[req], cols.tuf_alpha[req]
    seg_util = np.where(first, tuf0(wait, ert, beta, alpha), tuf1(wait, beta, alpha))
    utility = np.bincount(req, weights=seg_util, minlength=n).astype(np.float64)
    first_utility = np.full(n, np.nan)
    first_utility[req[first]] = seg_util[first]

    completed = cols.completed
    robot_wait = np.bincount(req, weights=wait, minlength=n).astype(np.float64)
    robot_wait[~completed] = np.nan

    pending = ~completed & cols.has_tuf
    if horizon is not None and pending.any():
        _score_pending(cols, pending, horizon, starts, rstarts, utility, first_utility)
    utility[~cols.has_tuf] = np.nan
    first_utility[~cols.has_tuf] = np.nan
    return SegmentOutcome(utility=utility, first_utility=first_utility, robot_wait=robot_wait)


def _score_pending(
    cols: Columns,
    pending: np.ndarray,
    horizon: float,
    starts: np.ndarray,
    rstarts: np.ndarray,
    utility: np.ndarray,
    first_utility: np.ndarray,
) -> None:
    """Add, in place, the utility of the segment each unfinished request was on at ``horizon``."""
    m = cols.seg_done_len
    beta, alpha = cols.tuf_beta, cols.tuf_alpha

    on_first = pending & (m == 0)
    if on_first.any():
        t = horizon - cols.arrival[on_first]
        u = tuf0(t, cols.tuf_ert[on_first], beta[on_first], alpha[on_first])
        utility[on_first] += u
        first_utility[on_first] = u

    on_later = np.flatnonzero(pending & (m > 0))
    if on_later.size:
        mk = m[on_later]
        ready = cols.seg_done[starts[on_later] + mk - 1]
        has = cols.seg_ready_len[on_later] >= mk
        ready[has] = cols.seg_ready[rstarts[on_later][has] + mk[has] - 1]
        utility[on_later] += tuf1(horizon - ready, beta[on_later], alpha[on_later])
