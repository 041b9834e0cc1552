"""Turn a load run's outcomes into the project's metrics, a table and a plot.

Outcomes become :class:`~duetime.core.record.RequestRecord` s on the client's
clock (arrival = when the request was sent), so TTFT, TBT, e2e, throughput,
goodput and deadline hit rate mean exactly what docs/metrics.md says: a
rejected or failed request is a cancelled record (no latency, a deadline
miss), a request cut off by the drain timeout an unfinished one. The load
generator adds its own counts (``ok``, ``rejected``, ``errors``,
``unfinished``, ``not_sent``) and what a duetime server reports about itself.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.record import RequestRecord
from duetime.core.request import Request
from duetime.metrics import cached_prompt_pct, summarize
from duetime.server.loadgen import LoadRun, Outcome

Row = dict[str, Any]

# The rows of the terminal table, in order; the JSON has every key of a row.
TABLE_KEYS: tuple[str, ...] = (
    "sent",
    "ok",
    "rejected",
    "errors",
    "unfinished",
    "ttft_p50_s",
    "ttft_p90_s",
    "tbt_p50_s",
    "tbt_p90_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "e2e_p99_s",
    "throughput_req_s",
    "throughput_tok_s",
    "goodput_req_s",
    "deadline_hit_rate",
    "prompt_cached_pct",
)

# Keys kept from duetime.metrics.summarize (the rest describe simulator-only features).
_SUMMARY_KEYS = (
    *(
        f"{name}_{stat}_s"
        for name in ("ttft", "tbt", "e2e")
        for stat in ("mean", "p50", "p90", "p99")
    ),
    "span_s",
    "throughput_req_s",
    "throughput_tok_s",
    "goodput_req_s",
    "deadline_requests",
    "deadline_hit_rate",
)


def to_record(out: Outcome) -> RequestRecord:
    """The outcome of a sent request as a record on the client's clock."""
    assert out.sent is not None, "only sent requests have records"
    req = out.request
    request = Request(
        rid=req.rid,
        arrival=out.sent,
        prompt_len=req.prompt_len,
        max_tokens=req.max_tokens,
        deadline=None if req.deadline_s is None else out.sent + req.deadline_s,
        priority=req.priority or 0,
        klass=req.klass,
    )
    record = RequestRecord(request=request, first_token=out.first_token)
    record.target_tokens = req.max_tokens
    record.output_tokens = out.output_tokens
    if out.status == "ok":
        record.finish = out.finish
        if out.first_token is None:
            # An answer without text (EOS came first) still ended: its end is the first sign of
            # it. Without a first token, its TTFT was NaN and made every TTFT percentile NaN.
            record.first_token = out.finish
    elif out.status in ("rejected", "error"):
        record.cancelled_at = out.ended
    return record


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def error_kind(message: str) -> str:
    """One kind of error a key in ``top_errors``: the message with its numbers as ``#``,
    an HTTP status kept. Each too-long prompt's 400 names its own token count, and five
    of them filled the five places with one cause."""
    status, sep, rest = (
        message.partition(": ") if message.startswith("HTTP ") else ("", "", message)
    )
    return status + sep + _NUMBER.sub("#", rest)


def summarize_run(run: LoadRun, slo_ttft_s: float | None = None) -> Row:
    """Flat metrics of one run, plus ``classes``: the same per request class. With a
    first-token bound ``slo_ttft_s`` (sent as ``x-slo-ttft-ms``), also how it was kept."""
    sent = run.sent
    records = [to_record(o) for o in sent]
    whole = summarize(records)
    span = _span(records, whole)
    row = _row(sent, records, span)
    if slo_ttft_s is not None:
        row.update(ttft_slo_report(sent, slo_ttft_s))
    row.update(not_sent=len(run.outcomes) - len(sent), launch_s=run.launch_s, wall_s=run.wall_s)
    errors = Counter(error_kind(o.error) for o in sent if o.status == "error" and o.error)
    row["top_errors"] = dict(errors.most_common(5))
    classes = sorted({o.request.klass for o in sent})
    if len(classes) > 1 or (classes and classes[0] != "default"):
        by_class = {}
        for klass in classes:
            mine = [i for i, o in enumerate(sent) if o.request.klass == klass]
            by_class[klass] = _row([sent[i] for i in mine], [records[i] for i in mine], span)
            for key in ("deadline_hit_rate", "goodput_req_s", "e2e_p90_s"):
                row[f"{key}[{klass}]"] = by_class[klass][key]
        row["classes"] = by_class
    return row


def ttft_slo_report(sent: Sequence[Outcome], bound_s: float) -> Row:
    """How a first-token bound was kept: ``ttft_slo_met_rate``, the share of the answered
    requests whose first token came within it; ``ttft_slo_refused``, the 429s; and
    ``ttft_slo_refusal_p50_s`` / ``_max_s``, how long a refusal took to arrive (a bound
    no server can meet should be refused at once, not after a wait)."""
    answered = [o for o in sent if o.status == "ok" and o.sent is not None]
    met = [
        o
        for o in answered
        if o.first_token is not None and o.sent is not None and o.first_token - o.sent <= bound_s
    ]
    refusals = [
        o.ended - o.sent
        for o in sent
        if o.status == "rejected" and o.ended is not None and o.sent is not None
    ]
    return {
        "ttft_slo_s": bound_s,
        "ttft_slo_met_rate": len(met) / len(answered) if answered else None,
        "ttft_slo_refused": len(refusals),
        "ttft_slo_refusal_p50_s": float(np.percentile(refusals, 50)) if refusals else None,
        "ttft_slo_refusal_max_s": max(refusals) if refusals else None,
    }


def _span(records: Sequence[RequestRecord], whole: Mapping[str, Any]) -> tuple[float, float] | None:
    if not records or whole["span_s"] is None:
        return None
    t0 = min(r.request.arrival for r in records)
    return (t0, t0 + float(whole["span_s"]))


def _row(
    outcomes: Sequence[Outcome], records: Sequence[RequestRecord], span: tuple[float, float] | None
) -> Row:
    status = Counter(o.status for o in outcomes)
    s = summarize(records, span=span)
    row: Row = {
        "sent": len(outcomes),
        "ok": status["ok"],
        "rejected": status["rejected"],
        "errors": status["error"],
        "unfinished": status["unfinished"],
        "ok_rate": status["ok"] / len(outcomes) if outcomes else None,
    }
    row.update({key: s[key] for key in _SUMMARY_KEYS})
    row["output_tokens_total"] = sum(o.output_tokens for o in outcomes if o.status == "ok")
    lags = [o.sent - o.request.arrival for o in outcomes if o.sent is not None]
    row["launch_lag_p99_s"] = float(np.percentile(lags, 99)) if lags else None
    waits = [o.retry_after_s for o in outcomes if o.retry_after_s is not None]
    row["retry_after_mean_s"] = float(np.mean(waits)) if waits else None
    row["prompt_cached_pct"] = _prompt_cached_pct(outcomes)
    row.update(_server_reports(outcomes))
    return row


def _prompt_cached_pct(outcomes: Sequence[Outcome]) -> float | None:
    """% of the prompt tokens a server's prefix cache supplied, over the answers whose
    usage said both (OpenAI's ``prompt_tokens_details.cached_tokens``; any server)."""
    return cached_prompt_pct(
        (o.prompt_tokens, o.cached_tokens)
        for o in outcomes
        if o.prompt_tokens is not None and o.cached_tokens is not None
    )


def _server_reports(outcomes: Sequence[Outcome]) -> Row:
    """What a duetime server said about itself (``None`` for other servers)."""
    reports = [o.server for o in outcomes if o.server is not None]
    met = [bool(r["deadline_met"]) for r in reports if r.get("deadline_met") is not None]
    evicted = [
        float(r["kv_eviction_ratio"]) for r in reports if _number(r.get("kv_eviction_ratio"))
    ]
    e2e = [float(r["e2e_ms"]) / 1000.0 for r in reports if _number(r.get("e2e_ms"))]
    return {
        "server_reports": len(reports),
        "server_deadline_met_rate": sum(met) / len(met) if met else None,
        "server_e2e_p90_s": float(np.percentile(e2e, 90)) if e2e else None,
        "server_kv_eviction_ratio_mean": float(np.mean(evicted)) if evicted else None,
    }


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def run_label(rate: float | None) -> str:
    return "trace" if rate is None else f"{rate:g}/s"


def plot_rates(rows: Sequence[Row], path: str | Path) -> Path:
    """e2e p50 / p90 and deadline hit rate (or the ok fraction, without deadlines) vs rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_png

    rates = [float(r["rate_req_s"]) for r in rows]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for key, style in (("e2e_p50_s", "o-"), ("e2e_p90_s", "s--"), ("ttft_p90_s", "^:")):
        xs = [x for x, r in zip(rates, rows, strict=True) if r.get(key) is not None]
        left.plot(xs, [r[key] for r in rows if r.get(key) is not None], style, label=key)
    left.set(xlabel="offered rate (req/s)", ylabel="seconds", title="latency")
    fractions = ["ok_rate"]
    if any(r.get("deadline_hit_rate") is not None for r in rows):
        fractions.insert(0, "deadline_hit_rate")
    for key in fractions:
        xs = [x for x, r in zip(rates, rows, strict=True) if r.get(key) is not None]
        style = "s--" if key == "ok_rate" else "o-"
        right.plot(xs, [r[key] for r in rows if r.get(key) is not None], style, label=key)
    right.set(xlabel="offered rate (req/s)", ylabel="fraction", title="hits", ylim=(-0.02, 1.02))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    return save_png(fig, path)


def plot_run(records_by_label: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """One rate: the TTFT and e2e latency CDFs."""
    from duetime.metrics.run_plot import plot_latency_cdf

    return plot_latency_cdf(records_by_label, path)
