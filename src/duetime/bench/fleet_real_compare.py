"""Real fleet against simulated fleet, request by request: what `bench fleet-real` reports.

Both sides hold one record per request of the same trace, keyed by request id
(the load generator's ``rid`` is the simulated job's). A run's row is
:func:`duetime.metrics.summarize` of its records (the same function for both, so
a deadline hit rate means the same thing: a refused or failed request is a miss)
plus what the fleet turned away. The comparison pairs the requests that finished
on both sides: the relative e2e error ``|sim - real| / real`` (median and p90),
its signed median (below 0: the simulator is optimistic), and the hit rates'
difference in points.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.record import RequestRecord
from duetime.metrics import summarize
from duetime.metrics.summary import summarize_by_class

__all__ = [
    "COMPARISON",
    "FIGURES",
    "compare",
    "comparison_columns",
    "plot_fleet_real",
    "routed_alike",
    "run_columns",
    "run_row",
]

#: The figures of a run's row that the table prints, in order.
FIGURES = (
    "requests",
    "completed",
    "refused",
    "deadline_hit_rate",
    "e2e_p50_s",
    "e2e_p90_s",
    "ttft_p50_s",
    "throughput_tok_s",
)


def run_row(records: Sequence[RequestRecord], refused: int) -> dict[str, Any]:
    """One side's figures: the summary, refusals, and the hit rate of each class."""
    s = summarize(records)
    row: dict[str, Any] = {k: s[k] for k in FIGURES if k in s}
    row["refused"] = refused
    row["unfinished"] = s["unfinished"]
    by_class = summarize_by_class(records)
    if len(by_class) > 1:
        for klass, cs in by_class.items():
            row[f"deadline_hit_rate[{klass}]"] = cs["deadline_hit_rate"]
    return row


def _e2e(records: Iterable[RequestRecord]) -> dict[int, float]:
    return {r.request.rid: e for r in records if (e := r.e2e) is not None}


def compare(
    real: Sequence[RequestRecord], sim: Sequence[RequestRecord]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The comparison's figures and one pair per request finished on both sides.

    Hit rates are each side's own (over all its requests); the e2e errors are over
    the requests both finished, matched by id (``matched`` says how many).
    """
    real_e2e, sim_e2e = _e2e(real), _e2e(sim)
    klass = {r.request.rid: r.request.klass for r in real}
    rids = sorted(set(real_e2e) & set(sim_e2e))
    pairs: list[dict[str, Any]] = [
        {"rid": rid, "klass": klass[rid], "real_e2e_s": real_e2e[rid], "sim_e2e_s": sim_e2e[rid]}
        for rid in rids
    ]
    # signed, in % of the real e2e
    rel = np.array([100.0 * (sim_e2e[rid] - real_e2e[rid]) / real_e2e[rid] for rid in rids])
    hit_real, hit_sim = summarize(real)["deadline_hit_rate"], summarize(sim)["deadline_hit_rate"]
    figures: dict[str, Any] = {
        "matched": len(pairs),
        "e2e_rel_err_p50_pct": float(np.median(np.abs(rel))) if len(rel) else None,
        "e2e_rel_err_p90_pct": float(np.percentile(np.abs(rel), 90)) if len(rel) else None,
        "e2e_rel_bias_p50_pct": float(np.median(rel)) if len(rel) else None,
        "hit_rate_real": hit_real,
        "hit_rate_sim": hit_sim,
        "hit_rate_gap_points": (
            None if hit_real is None or hit_sim is None else 100.0 * (hit_sim - hit_real)
        ),
    }
    return figures, pairs


def routed_alike(real: Mapping[int, int], sim: Mapping[int, int]) -> float | None:
    """The share of the requests routed on both sides that went to the same replica
    (real: the backend that answered; simulated: the replica it last went to)."""
    both = set(real) & set(sim)
    return sum(real[rid] == sim[rid] for rid in both) / len(both) if both else None


def run_columns(run: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One router's table: its real run beside its two simulations."""
    return [
        ("real", run["real"]),
        ("sim", run["sim"]),
        ("sim, warm-up profiles", run["sim_warmup"]),
    ]


def comparison_columns(
    fig: Mapping[str, Any], which: str = "compare"
) -> list[tuple[str, dict[str, Any]]]:
    """Every router's comparison: ``compare`` (the simulation priced by the profiles
    fitted to its run) or ``compare_warmup`` (by the warm-up ones)."""
    return [(run["router"], run[which]) for run in fig["runs"]]


#: The comparison table's rows.
COMPARISON = (
    "matched",
    "routed_alike",
    "e2e_rel_err_p50_pct",
    "e2e_rel_err_p90_pct",
    "e2e_rel_bias_p50_pct",
    "hit_rate_real",
    "hit_rate_sim",
    "hit_rate_gap_points",
)


def plot_fleet_real(fig: Mapping[str, Any], path: Path) -> Path:
    """Simulated against real e2e, one panel a router, one point a request (y = x: exact)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_png

    runs = fig["runs"]
    f = Figure(figsize=(4.2 * len(runs), 4.2), layout="constrained")
    FigureCanvasAgg(f)
    axes = f.subplots(1, len(runs), squeeze=False)[0]
    for ax, run in zip(axes, runs, strict=True):
        pairs = run["pairs"]
        xs = [p["real_e2e_s"] for p in pairs]
        ys = [p["sim_e2e_s"] for p in pairs]
        ax.scatter(xs, ys, s=10, alpha=0.7)
        top = max([*xs, *ys, 1e-3])
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        c = run["compare"]
        ax.set_title(
            f"{run['router']}: hit rate real {_fmt(c['hit_rate_real'])}, "
            f"sim {_fmt(c['hit_rate_sim'])}",
            fontsize=9,
        )
        ax.set(xlabel="real e2e, s", ylabel="simulated e2e, s")
        ax.grid(alpha=0.3)
    return save_png(f, path)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
