"""`duetime bench admission`: deadlines judged by forecast vs by the estimate, under overload.

The same open-loop ShareGPT load (Poisson arrivals faster than the engine can
serve, or bursts of requests sent together at Poisson times; one deadline for
all) is sent to `duetime serve` once per admission mode, each on a fresh
engine over the same loaded model, modes interleaved within each repetition.
Each request asks for at most its recorded answer's length (base Gemma 3 270M
writes to that cap nearly always), or with
``fixed_max_tokens`` for one limit as a chat client does, and the server
predicts it with its length predictor, as a deployment would: corrected by the
served model's own answers (``lengths="served"``, the server's default) or as
the predictor has it (``"predictor"``); both, and each mode runs twice. A
forecast may expect each burst's companions (``burst_gaps``: the server's
``--burst-gap-ms``, 0 for none, ``server/recent_load.py``).

What a deadline-aware server owes its clients is that a request it accepts is
answered in time: the figures are the deadline hit rate *of the accepted*
requests, goodput (answers in time a second), how many were refused, and for
the forecast how far its predicted end-to-end time (``predicted_e2e_ms``) was
from the real one, and what a forecast cost the admission.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetime.server.admission import ADMISSION_MODES
from duetime.server.app import create_app
from duetime.server.build import (
    DEFAULT_CONFIDENCE,
    ServeOptions,
    build_state,
    load_served_model,
)
from duetime.server.forecast_errors import check_confidence
from duetime.server.load_report import summarize_run
from duetime.server.load_workload import LoadWorkload
from duetime.server.loadgen import Bounds, Outcome, Target, run_load
from duetime.server.recent_load import DEFAULT_BURST_GAP_S
from duetime.server.threaded import serve_in_thread

__all__ = [
    "LENGTHS",
    "AdmissionBenchConfig",
    "Arm",
    "arms_of",
    "check_config",
    "run_admission_bench",
]

#: How the server's predicted lengths are had: corrected by the served model's answers, or not.
LENGTHS = ("served", "predictor")


@dataclass(slots=True)
class AdmissionBenchConfig:
    """One `bench admission` run: the server its arms start, then the load they are sent."""

    model: str = "gemma"
    dtype: str = "q8"
    policy: str = "edf"
    predictor: str | None = "auto"
    modes: Sequence[str] = ADMISSION_MODES
    lengths: Sequence[str] = ("served",)  # served: corrected by the model's answers; predictor
    # the server's --deadline-confidence for the forecast arms (None: the plain forecast)
    confidences: Sequence[float | None] = (DEFAULT_CONFIDENCE,)
    # the server's --burst-gap-ms for the forecast arms, in seconds (0: no bursts expected)
    burst_gaps: Sequence[float] = (DEFAULT_BURST_GAP_S,)
    extra: dict[str, Any] = field(default_factory=dict)  # more ServeOptions (tests)
    rate: float = 3.0
    duration_s: float = 120.0
    deadline_s: float = 20.0
    max_tokens: int = 256
    max_context: int = 2048  # longest prompt + answer, Gemma tokens (pairs past it left out)
    fixed_max_tokens: int | None = None  # every request's max_tokens (None: its answer's length)
    #: Every answer runs to its max_tokens: the forecast then knows each length, and its
    #: error is the step-cost model's and the arrivals' it cannot see, not the lengths'.
    ignore_eos: bool = False
    arrival: str = "poisson"  # how requests arrive: workloads/arrivals.py
    burst_size: int = 1  # with arrival "bursts": requests a burst
    seed: int = 0
    repeats: int = 1


def check_config(cfg: AdmissionBenchConfig) -> None:
    """Refuse what would fail part-way, before the model loads."""
    from duetime.bench.engine_fit import check_model_spec
    from duetime.policies import make_policy

    check_model_spec(cfg.model)
    if not cfg.modes:
        raise ValueError("--modes is empty: name forecast, estimate or both")
    for mode in cfg.modes:
        if mode not in ADMISSION_MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(ADMISSION_MODES)}")
    if not cfg.lengths:
        raise ValueError("--lengths is empty: name served, predictor or both")
    for lengths in cfg.lengths:
        if lengths not in LENGTHS:
            raise ValueError(f"--lengths: {lengths!r} is not one of {', '.join(LENGTHS)}")
    if not cfg.confidences:
        raise ValueError("--confidences is empty: name off, a confidence in (0, 1), or both")
    for c in cfg.confidences:
        if c is not None:
            try:
                check_confidence(c)
            except ValueError as e:
                raise ValueError(f"--confidences: {e}") from None
    if not cfg.burst_gaps:
        raise ValueError("--burst-gaps is empty: name 0 (no bursts expected), a gap in ms, or both")
    if any(not g >= 0 for g in cfg.burst_gaps):
        raise ValueError(f"--burst-gaps must be >= 0 ms, got {[g * 1000 for g in cfg.burst_gaps]}")
    from duetime.workloads import arrival_process

    try:
        arrival_process(cfg.arrival, cfg.rate, burst_size=cfg.burst_size)
    except ValueError as e:
        raise ValueError(f"--arrival: {e}") from None
    try:
        make_policy(cfg.policy)
    except ValueError as e:
        raise ValueError(f"--policy: {e}") from None
    for option, value in (("--rate", cfg.rate), ("--duration", cfg.duration_s)):
        if not 0 < value < math.inf:  # inf: 100,000 requests at once, or arrivals for hours
            raise ValueError(f"{option} must be > 0 and finite, got {value:g}")
    if not cfg.deadline_s > 0:
        raise ValueError(f"--deadline must be > 0, got {cfg.deadline_s:g}")


@dataclass(slots=True, frozen=True)
class Arm:
    """One way of serving the load: admission mode, predicted lengths, deadline
    confidence, the gap that makes arrivals a burst (0: none)."""

    mode: str
    lengths: str
    confidence: float | None
    burst_gap_s: float = DEFAULT_BURST_GAP_S

    def labels(self) -> tuple[str, str, str, str]:
        """Mode, lengths, confidence, bursts; the estimate has no confidence and expects
        no bursts (label "")."""
        if self.mode == "estimate":
            return self.mode, self.lengths, "", ""
        conf = "plain" if self.confidence is None else f"conf{self.confidence:g}"
        bursts = f"bursts{self.burst_gap_s * 1000:g}ms" if self.burst_gap_s else "even"
        return self.mode, self.lengths, conf, bursts


#: Each dimension's baseline, the label others are compared with (ratios ``<a>_vs_<base>``).
_BASELINES = ("estimate", "predictor", "plain", "even")


def arms_of(cfg: AdmissionBenchConfig) -> dict[str, Arm]:
    """Every arm by its name: the labels of the dimensions with more than one value
    joined by ``+`` (``served``, ``forecast+served``), or the mode where none varies."""
    arms: list[Arm] = []
    for m in cfg.modes:
        for n in cfg.lengths:  # confidences and bursts shape forecasts: the estimate runs once
            if m != "forecast":
                arms.append(Arm(m, n, None, 0.0))
                continue
            arms += [Arm(m, n, c, g) for c in cfg.confidences for g in cfg.burst_gaps]
    varying = _varying(arms)
    if not any(varying):
        varying[0] = True
    return {
        "+".join(x for x, v in zip(a.labels(), varying, strict=True) if v and x): a for a in arms
    }


def _varying(arms: Sequence[Arm]) -> list[bool]:
    return [len({a.labels()[d] for a in arms} - {""}) > 1 for d in range(len(_BASELINES))]


def _ratios(summary: dict[str, dict[str, Any]], arms: dict[str, Arm]) -> dict[str, float]:
    """Goodput and hit-rate ratios of each arm to the one that differs from it only by
    its baseline in one dimension (``goodput_met_req_s_forecast_vs_estimate``, with the
    other varying dimensions' labels after where more than one runs)."""
    by_labels: dict[tuple[str, ...], str] = {a.labels(): name for name, a in arms.items()}
    varying = _varying(list(arms.values()))
    out: dict[str, float] = {}
    for name, arm in arms.items():
        labels = arm.labels()
        for d, base in enumerate(_BASELINES):
            if labels[d] in (base, ""):
                continue
            want = [*labels[:d], base, *labels[d + 1 :]]
            if base == "estimate":  # against the estimate, whatever the forecast's shape
                want[2] = want[3] = ""
            other = by_labels.get(tuple(want))
            if other is None:
                continue
            rest = [x for k, x in enumerate(labels) if k != d and varying[k] and x]
            tail = "".join(f"_{x}" for x in rest)
            for key in ("goodput_met_req_s", "hit_rate_of_accepted"):
                a, b = summary[name].get(key), summary[other].get(key)
                if a and b:
                    out[f"{key}_{labels[d]}_vs_{base}{tail}"] = a / b
    return out


def _one_run(cfg: AdmissionBenchConfig, loaded: tuple[Any, Any, str], arm: Arm) -> dict[str, Any]:
    model, codec, name = loaded
    options = ServeOptions(
        model=cfg.model,
        dtype=cfg.dtype,
        policy=cfg.policy,
        predictor=cfg.predictor,
        admission=arm.mode,
        length_window=ServeOptions().length_window if arm.lengths == "served" else 0,
        deadline_confidence=arm.confidence,
        burst_gap_s=arm.burst_gap_s,
        **cfg.extra,
    )
    state = build_state(options, model, codec, name)
    workload = LoadWorkload(
        workload="sharegpt",
        requests=100_000,
        arrival=cfg.arrival,
        burst_size=cfg.burst_size,
        seed=cfg.seed,
        deadlines={"*": cfg.deadline_s},  # one for every request, as the server is sent it
        max_tokens=cfg.max_tokens,
        max_context=cfg.max_context,
        fixed_max_tokens=cfg.fixed_max_tokens,
    )
    drawn = workload.build(cfg.rate)
    reqs = [r for r in drawn if r.arrival < cfg.duration_s]
    if not reqs:
        raise ValueError(
            f"no request arrives within --duration {cfg.duration_s:g} s at --rate "
            f"{cfg.rate:g}/s (the first arrives at {drawn[0].arrival:.2f} s): "
            "give a longer --duration"
        )
    bounds = Bounds(
        max_requests=len(reqs),
        duration_s=cfg.duration_s,
        drain_timeout_s=max(60.0, 4 * cfg.deadline_s),
        request_timeout_s=600.0,
        concurrency=1024,
    )
    with serve_in_thread(create_app(state)) as url:
        run = run_load(reqs, Target(base=url, model=name, ignore_eos=cfg.ignore_eos), bounds)
    row = summarize_run(run)
    row.update(_accepted_figures(run.sent, row.get("span_s")))
    walls = list(state.admission.forecast_walls)
    row["forecasts"] = len(walls)
    if walls:
        ms = np.asarray(walls) * 1000
        row["forecast_ms_p50"] = float(np.percentile(ms, 50))
        row["forecast_ms_p99"] = float(np.percentile(ms, 99))
    row["mode"] = arm.mode
    row["lengths"] = arm.lengths
    row["deadline_confidence"] = arm.confidence
    row["burst_gap_s"] = arm.burst_gap_s
    if state.admission.errors is not None:
        row["deadline_margin_final"] = state.admission.errors.margin()
    return row


def _accepted_figures(sent: Sequence[Outcome], span_s: float | None) -> dict[str, Any]:
    """Of the accepted requests: how many met the deadline, and the forecast's error."""
    served = [o for o in sent if o.status == "ok" and o.server]
    met = sum(1 for o in served if o.server and o.server.get("deadline_met"))
    tokens = [
        (o.server["predicted_tokens"], o.output_tokens)
        for o in served
        if o.server and o.server.get("predicted_tokens") is not None
    ]
    forecast = [
        o
        for o in served
        if o.server and o.server.get("predicted_e2e_ms") and o.server.get("e2e_ms")
    ]
    pairs = [(o.server["predicted_e2e_ms"], o.server["e2e_ms"]) for o in forecast if o.server]
    out: dict[str, Any] = {
        "accepted": len(served),
        "met": met,
        "hit_rate_of_accepted": met / len(served) if served else None,
        "goodput_met_req_s": met / span_s if span_s else None,
        "with_forecast": len(pairs),
        "length_mae_tokens": statistics.fmean(abs(p - a) for p, a in tokens) if tokens else None,
        "answer_tokens_mean": statistics.fmean(a for _, a in tokens) if tokens else None,
        "predicted_tokens_mean": statistics.fmean(p for p, _ in tokens) if tokens else None,
    }
    if pairs:
        ratio = [p / a for p, a in pairs]
        out["forecast_over_actual_p10"] = float(np.percentile(ratio, 10))
        out["forecast_over_actual_p50"] = statistics.median(ratio)
        out["forecast_over_actual_p90"] = float(np.percentile(ratio, 90))
        errors = [abs(p - a) / a for p, a in pairs]
        out["e2e_forecast_mape_pct"] = 100 * statistics.fmean(errors)
        # the figures `duetime validate` gives for the simulator, for the server's forecasts
        out["e2e_forecast_err_median_pct"] = 100 * statistics.median(errors)
        out["e2e_forecast_err_p90_pct"] = 100 * float(np.percentile(errors, 90))
        # each request's forecast beside what it lived, in arrival order (JSON only):
        # where the error comes from (prompt, answer, when it came) is read off these
        out["forecast_pairs"] = [
            {
                "arrival_s": round(o.request.arrival, 3),
                "prompt_tokens": o.request.prompt_len,
                "answer_tokens": o.output_tokens,
                "predicted_e2e_ms": p,
                "e2e_ms": a,
            }
            for o, (p, a) in zip(forecast, pairs, strict=True)
        ]
    return out


def run_admission_bench(
    cfg: AdmissionBenchConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    check_config(cfg)
    loaded = load_served_model(ServeOptions(model=cfg.model, dtype=cfg.dtype))
    arms = arms_of(cfg)
    runs: list[dict[str, Any]] = []
    for rep in range(cfg.repeats):
        for name, arm in arms.items():  # interleaved: a drift in the machine's speed hits all
            row = _one_run(cfg, loaded, arm)
            row["arm"] = name
            row["repeat"] = rep
            runs.append(row)
            if progress:
                progress(len(runs), cfg.repeats * len(arms))
    summary = {a: _median_row([r for r in runs if r["arm"] == a]) for a in arms}
    ratios = _ratios(summary, arms)
    return {
        "model": loaded[2],
        "policy": cfg.policy,
        "rate_req_s": cfg.rate,
        "duration_s": cfg.duration_s,
        "deadline_s": cfg.deadline_s,
        "max_tokens": cfg.max_tokens,
        "fixed_max_tokens": cfg.fixed_max_tokens,
        "ignore_eos": cfg.ignore_eos,
        "lengths": list(cfg.lengths),
        "deadline_confidences": list(cfg.confidences),
        "burst_gaps_s": list(cfg.burst_gaps),
        "arrival": cfg.arrival,
        "burst_size": cfg.burst_size,
        "repeats": cfg.repeats,
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }


TABLE_KEYS = (
    "sent",
    "accepted",
    "rejected",
    "errors",
    "met",
    "hit_rate_of_accepted",
    "goodput_met_req_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "forecast_over_actual_p50",
    "e2e_forecast_mape_pct",
    "e2e_forecast_err_median_pct",
    "e2e_forecast_err_p90_pct",
    "length_mae_tokens",
    "forecast_ms_p50",
    "forecast_ms_p99",
)


def _median_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repetitions (those a run has)."""
    out: dict[str, Any] = {}
    for key in TABLE_KEYS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if values else None
    return out
