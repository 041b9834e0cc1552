"""`duetime bench timebill --engine`'s report: predictor timings, the tables and the plot.

Kept apart from :mod:`duetime.bench.timebill_engine` (which runs the jobs) so
the presentation can change without touching the measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot", "predictor_report", "table"]


def _pcts(xs: Sequence[float], name: str) -> dict[str, float | None]:
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return {f"{name}_p50_s": None, f"{name}_p90_s": None}
    return {f"{name}_p50_s": float(np.median(a)), f"{name}_p90_s": float(np.percentile(a, 90))}


def predictor_report(timings: Sequence[Any], predictor: Any) -> dict[str, Any]:
    """t_Predict and t_prefill (p50 / p90), waits, and how often the input was compressed."""
    rep: dict[str, Any] = {
        **_pcts([t.predict_s for t in timings], "predict"),
        **_pcts([t.prefill_s for t in timings], "prefill"),
        **_pcts([t.wait_s for t in timings if t.predict_s is not None], "wait"),
        "predictions": sum(1 for t in timings if t.predict_s is not None),
        "predict_exceeded_prefill": sum(
            1
            for t in timings
            if t.predict_s is not None and t.prefill_s is not None and t.predict_s > t.prefill_s
        ),
    }
    calls = getattr(predictor, "calls", None)
    tm = getattr(predictor, "time_model", None)
    if calls is not None:
        rep["compressed_calls"] = sum(1 for c in calls if c.pieces_used < c.pieces_full)
        rep["pieces_full_mean"] = float(np.mean([c.pieces_full for c in calls])) if calls else None
        rep["pieces_used_mean"] = float(np.mean([c.pieces_used for c in calls])) if calls else None
    if tm is not None:
        rep["predict_time_model_s"] = {
            "a_p": tm.a_p, "b_p": tm.b_p, "c_p": tm.c_p, "floor_s": tm.floor_s,
        }  # fmt: skip
        rep["max_pieces"] = tm.max_pieces
    return rep


def table(fig: dict[str, Any]) -> list[Any]:
    """Per strategy: completion % / token F1 / ROUGE-L per method and budget, and mean α %."""
    from rich.table import Table

    bs = fig["budgets_s"]
    scale = fig["budget_scale_" + fig["budget_scale"]]
    tables = []
    for o, per in fig["summary"].items():
        t = Table(
            title=f"{o}: completion % / token F1 / ROUGE-L (real engine, {fig['eviction']}, "
            f"predictor {fig['predictor']})",
            caption=f"T in s = the paper's {fig['paper_budgets_s']} s x "
            f"{scale:.3f} ({fig['budget_scale']} scaling)"
            "; scores vs full-KV output, incomplete jobs = 0; α: mean eviction ratio %",
        )
        t.add_column("method", no_wrap=True)
        for b in bs:
            t.add_column(f"T={b:g}", justify="right", no_wrap=True)  # .2f: 0.004 s read 0.00
        t.add_column("α", justify="right", no_wrap=True)
        for m, s in per.items():
            cells = []
            for b in bs:
                r = next(
                    r for r in fig["rows"]
                    if r["overrun"] == o and r["method"] == m and r["budget_s"] == b
                )  # fmt: skip
                cells.append(
                    f"{100 * r['completion_rate']:.0f} / {r['token_f1_mean']:.2f} / "
                    f"{r['rouge_l_mean']:.2f}"
                )
            t.add_row(m, *cells, f"{100 * s['mean_alpha_mean']:.0f}")
        tables.append(t)
    return tables


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    """Completion rate, token F1 and mean α vs budget; one line per method, one column per
    strategy (the simulator bench's layout plus the score row)."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    strategies = list(fig["summary"])
    f = Figure(figsize=(5.0 * len(strategies), 9.0))
    panels = (
        ("completion_rate", "completion rate (%)", 100.0),
        ("token_f1_mean", "token F1 vs full KV (incomplete = 0)", 1.0),
        ("mean_alpha", "mean KV eviction ratio α (%)", 100.0),
    )
    for col, o in enumerate(strategies):
        for row, (key, label, mult) in enumerate(panels):
            ax = f.add_subplot(3, len(strategies), row * len(strategies) + col + 1)
            for m in fig["summary"][o]:
                rs = sorted(
                    (r for r in fig["rows"] if r["overrun"] == o and r["method"] == m),
                    key=lambda r: r["budget_s"],
                )
                style = "-" if m.startswith("timebill") else "--"
                xs = [r["budget_s"] for r in rs]
                ax.plot(xs, [mult * r[key] for r in rs], style, marker="o", label=m)
            ax.set_ylabel(label, fontsize=8)
            if row == 0:
                ax.set_title(o, fontsize=10)
                ax.legend(fontsize=7)
            if row == len(panels) - 1:
                ax.set_xlabel("time budget T (s)")
    return save_titled_png(
        f,
        path,
        f"TimeBill vs baselines on the real engine ({fig['eviction']}, "
        f"{fig['workload']['jobs']} jobs, N_max {fig['n_max_tokens']})",
    )
