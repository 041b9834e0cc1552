"""Turn a run's :class:`RequestRecord` list into one flat dict of metrics.

Flat ``{name: number}`` dicts are what every consumer wants: a JSON file, a
row of a sweep table, a column of a terminal table. Every key carries its
unit (``_s`` seconds, ``_req_s`` requests per second, ``_tok_s`` tokens per
second, ``_rate`` a fraction in [0, 1]); counts and utilities are unitless.
A value is ``None`` when it is undefined (no completed request, no deadline
in the workload, a zero-length span), never NaN, so that JSON stays valid.

How requests that did not complete count (see also docs/metrics.md):

* ``completed``: ``finish`` is set. ``cancelled``: ``cancelled_at`` is set and
  not completed. ``unfinished``: neither (the run ended with it in flight).
* TTFT, TBT, E2E statistics and ``tel_s``: completed requests only.
* throughput and goodput: completed requests whose ``finish`` lies in the span.
* ``slo_hit_rate``: over *all* requests; cancelled and unfinished ones miss.
* ``deadline_hit_rate``: over requests that carry a deadline; cancelled and
  unfinished ones miss.
* time utility: every request with a TUF; an unfinished one is judged at the
  end of the span (see :mod:`duetime.metrics.utility`).
* ``robot_wait_mean_s``: completed requests only.
* preemptions: all requests (a cancelled request's preemptions happened).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from duetime.core.record import RequestRecord
from duetime.metrics.columns import Columns
from duetime.metrics.slo import SLO
from duetime.metrics.utility import SegmentOutcome, segment_outcomes

Summary = dict[str, float | int | None]
Span = tuple[float, float]

PERCENTILES = (50, 90, 99)
DEADLINE_EPS = 1e-12  # same tolerance as RequestRecord.deadline_met


def summarize(
    records: Iterable[RequestRecord], *, slo: SLO | None = None, span: Span | None = None
) -> Summary:
    """Headline metrics of one run.

    ``span`` is the ``(start, end)`` window, in executor seconds, over which
    throughput and goodput are rates, and whose end is the horizon at which
    unfinished requests' time utility is judged. By default it runs from the
    first arrival to the last event (the last finish, or a later cancellation).
    Pass it explicitly to drop warm-up and drain, or to compare runs on the
    same window. Without ``slo``, goodput counts completed requests that met
    their deadline (requests without one count as good).

    Keys, in order: ``requests completed cancelled unfinished span_s``;
    ``{ttft,tbt,e2e}_{mean,p50,p90,p99}_s``; ``throughput_req_s
    throughput_tok_s goodput_req_s slo_hit_rate deadline_requests
    deadline_hit_rate tel_s time_utility_total time_utility_mean
    time_utility_first_mean robot_wait_mean_s preemptions_total
    preemptions_mean``; then ``time_utility_total[<klass>]`` and
    ``time_utility_mean[<klass>]`` for each class that has a TUF. Empty input
    gives zero counts and ``None`` everywhere else.
    """
    cols = Columns.from_records(records)
    window = resolve_span(cols, span)
    seg = segment_outcomes(cols, None if window is None else window[1])
    out = summarize_columns(cols, np.ones(cols.n, dtype=bool), window, seg, slo)
    out.update(_utility_by_class(cols, seg))
    return out


def cached_prompt_pct(pairs: Iterable[tuple[int, int]]) -> float | None:
    """Percent of prompt tokens whose KV a prefix cache supplied, over ``(prompt tokens,
    cached tokens)`` pairs (one per answer that reports both); None for no prompt tokens.
    One definition for a simulated or engine run's records and a load run's usage."""
    prompt = cached = 0
    for p, c in pairs:
        prompt += p
        cached += c
    return 100.0 * cached / prompt if prompt else None


def summarize_by_class(
    records: Iterable[RequestRecord], *, slo: SLO | None = None, span: Span | None = None
) -> dict[str, Summary]:
    """:func:`summarize` for each ``request.klass``, sorted by class name.

    All classes share the run's span (rates are per second of the whole run,
    so per-class throughputs add up to the total), and the per-class
    ``time_utility_*[<klass>]`` keys are left out as redundant.
    """
    cols = Columns.from_records(records)
    window = resolve_span(cols, span)
    seg = segment_outcomes(cols, None if window is None else window[1])
    return {
        name: summarize_columns(cols, cols.of_class(name), window, seg, slo)
        for name in cols.klass_names
    }


def resolve_span(cols: Columns, span: Span | None) -> Span | None:
    """The explicit span, checked, or first arrival → last event; None for no records."""
    if span is not None:
        start, end = float(span[0]), float(span[1])
        if not end >= start:
            raise ValueError(f"span must satisfy start <= end, got {span}")
        return start, end
    last = cols.last_event()
    if last is None:
        return None
    return float(cols.arrival.min()), last


def summarize_columns(
    cols: Columns, mask: np.ndarray, window: Span | None, seg: SegmentOutcome, slo: SLO | None
) -> Summary:
    """The metrics of the requests selected by ``mask`` (the shared core of both entry points)."""
    completed = cols.completed & mask
    cancelled = cols.cancelled & mask
    n = int(mask.sum())
    ttft = cols.first_token - cols.arrival
    e2e = cols.finish - cols.arrival
    tbt = _tbt(cols)

    out: Summary = {
        "requests": n,
        "completed": int(completed.sum()),
        "cancelled": int(cancelled.sum()),
        "unfinished": n - int(completed.sum()) - int(cancelled.sum()),
        "span_s": None if window is None else window[1] - window[0],
    }
    out.update(_stats("ttft", ttft[completed]))
    out.update(_stats("tbt", tbt[completed & ~np.isnan(tbt)]))
    out.update(_stats("e2e", e2e[completed]))

    deadline_ok = np.isnan(cols.deadline) | (cols.finish <= cols.deadline + DEADLINE_EPS)
    latency_ok = slo.met(ttft, tbt, e2e) if slo is not None else cols.completed
    good = completed & deadline_ok & latency_ok
    out.update(_rates(cols, completed, good, window))
    out["slo_hit_rate"] = _frac(int(good.sum()), n)

    has_deadline = mask & ~np.isnan(cols.deadline)
    hits = int((has_deadline & completed & deadline_ok).sum())
    out["deadline_requests"] = int(has_deadline.sum())
    out["deadline_hit_rate"] = _frac(hits, int(has_deadline.sum()))
    out["tel_s"] = float(e2e[completed].sum()) if completed.any() else None

    with_tuf = mask & cols.has_tuf
    out["time_utility_total"] = float(seg.utility[with_tuf].sum()) if with_tuf.any() else None
    out["time_utility_mean"] = _mean(seg.utility[with_tuf])
    out["time_utility_first_mean"] = _mean(seg.first_utility[with_tuf])
    out["robot_wait_mean_s"] = _mean(seg.robot_wait[completed])
    out["preemptions_total"] = int(cols.preemptions[mask].sum())
    out["preemptions_mean"] = _mean(cols.preemptions[mask].astype(np.float64))
    return out


def _tbt(cols: Columns) -> np.ndarray:
    """Per-request mean gap between output tokens after the first (RequestRecord.tbt)."""
    gaps = (cols.output_tokens - 1).astype(np.float64)
    gaps[gaps < 1] = np.nan
    return (cols.finish - cols.first_token) / gaps


def _rates(cols: Columns, completed: np.ndarray, good: np.ndarray, window: Span | None) -> Summary:
    """Throughput and goodput: completions inside the span per second of span."""
    keys = ("throughput_req_s", "throughput_tok_s", "goodput_req_s")
    if window is None or window[1] <= window[0]:
        return dict.fromkeys(keys)
    start, end = window
    in_span = completed & (cols.finish >= start) & (cols.finish <= end)
    dur = end - start
    return {
        "throughput_req_s": int(in_span.sum()) / dur,
        "throughput_tok_s": int(cols.output_tokens[in_span].sum()) / dur,
        "goodput_req_s": int((good & in_span).sum()) / dur,
    }


def _utility_by_class(cols: Columns, seg: SegmentOutcome) -> Summary:
    out: Summary = {}
    with_tuf = cols.has_tuf
    for name in cols.klass_names:
        u = seg.utility[with_tuf & cols.of_class(name)]
        if not u.size:
            continue
        out[f"time_utility_total[{name}]"] = float(u.sum())
        out[f"time_utility_mean[{name}]"] = float(u.mean())
    return out


def _stats(prefix: str, values: np.ndarray) -> Summary:
    """``<prefix>_mean_s`` and ``<prefix>_p{50,90,99}_s`` (linear interpolation), or Nones."""
    keys = [f"{prefix}_mean_s", *(f"{prefix}_p{p}_s" for p in PERCENTILES)]
    if values.size == 0:
        return dict.fromkeys(keys)
    pct = np.percentile(values, PERCENTILES)
    return dict(zip(keys, [float(values.mean()), *map(float, pct)], strict=True))


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _frac(num: int, den: int) -> float | None:
    return num / den if den else None
