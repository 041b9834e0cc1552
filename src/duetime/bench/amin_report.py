"""`duetime bench amin`'s report: its tables and its plot, from the figures ``run`` returns."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from duetime.bench.amin import CONSTRUCTIONS, LEARNED, SETTINGS, TWO_POINT_ELL, is_learned


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    """TEL / TEL(H-SF) per construction (one panel per setting) and the two-point check."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    panels = 2 + (1 if fig["two_point"] else 0)
    f = Figure(figsize=(5.2 * panels, 4.2))
    names = _constructions(fig)
    x = np.arange(len(names))
    for i, setting in enumerate(SETTINGS):
        ax = f.add_subplot(1, panels, i + 1)
        for j, pol in enumerate(("amax", "amin")):
            ratio = {
                r["construction"]: r["tel_ratio_vs_hsf"]
                for r in fig["rows"]
                if r["setting"] == setting and r["policy"] == pol
            }
            ys = [ratio.get(n, math.nan) for n in names]
            bars = ax.bar(x + (j - 0.5) * 0.38, ys, 0.38, label=pol.capitalize())
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="H-SF")
        labels = [f"{n}\n(held-out)" if is_learned(n) else n for n in names]
        ax.set_xticks(x, labels, rotation=20, fontsize=8)
        ax.set_ylabel("TEL / TEL(H-SF)")
        ax.set_title(f"{setting} batch time, M = {fig['kv_capacity_tokens']:,} tokens", fontsize=9)
        ax.legend(fontsize=8)
    if fig["two_point"]:
        ax = f.add_subplot(1, panels, panels)
        for pol in ("amin", "aell", "amax"):
            pts = sorted(
                (r["alpha"], r["tel_ratio_vs_hsf"]) for r in fig["two_point"] if r["policy"] == pol
            )
            ax.plot(*zip(*pts, strict=True), "o-", label=pol)
        a = np.linspace(0.05, 0.95, 50)
        from duetime.analysis.amin_model import aell_bound, amin_two_point_bound

        ax.plot(a, [amin_two_point_bound(v) for v in a], "C0:", label="Amin bound (Thm 6)")
        ax.plot(a, [aell_bound(v) for v in a], "C1:", label="A_ℓ bound (Thm 7)")
        ax.set_xlabel("α = ℓ/u")
        ax.set_ylabel("TEL / TEL(H-SF)")
        ax.set_title(f"two-point lengths, ℓ = {TWO_POINT_ELL}, unit time", fontsize=9)
        ax.legend(fontsize=7)
    return save_titled_png(
        f, path, f"Amin / Amax vs H-SF: {fig['workload']['requests']:,} ShareGPT requests"
    )


def _constructions(fig: dict[str, Any]) -> list[str]:
    """The interval constructions a run has rows of, the paper's first."""
    ran = {r["construction"] for r in fig["rows"] if r["policy"] != "hsf"}
    return [c for c in (*CONSTRUCTIONS, *fig.get("learned_predictors", ())) if c in ran]


def table(fig: dict[str, Any]) -> Any:
    """Rich tables, one per setting: mean latency and TEL ratio to H-SF per construction."""
    from rich.console import Group
    from rich.table import Table

    rows = {(r["setting"], r["policy"], r["construction"]): r for r in fig["rows"]}
    tables = []
    for s in SETTINGS:
        unit = "steps" if s == "unit" else "s"
        t = Table(
            title=f"{s} batch time, M = {fig['kv_capacity_tokens']:,} tokens",
            caption=f"mean latency in {unit}; ratios are TEL / TEL(H-SF); restarts: Amin's"
            + ("; learned: a trained predictor's 90 % intervals, H-SF on the same "
               "held-out rows" if fig.get("learned_predictors") else ""),
        )  # fmt: skip
        for col in ("intervals", "H-SF", "Amax", "Amin", "Amax/H-SF", "Amin/H-SF", "restarts"):
            t.add_column(col, justify="left" if col == "intervals" else "right", no_wrap=True)
        for c in _constructions(fig):
            hsf = rows[(s, "hsf", LEARNED if is_learned(c) else "oracle")]
            amax, amin = rows[(s, "amax", c)], rows[(s, "amin", c)]
            t.add_row(
                c,
                _num(hsf["mean_latency_s"]),
                _num(amax["mean_latency_s"]),
                _num(amin["mean_latency_s"]),
                f"{amax['tel_ratio_vs_hsf']:.3f}",
                f"{amin['tel_ratio_vs_hsf']:.3f}",
                f"{amin['restarts']:,}",
            )
        tables.append(t)
    return Group(*tables)


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"


def two_point_table(fig: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="two-point lengths (unit time): TEL / TEL(H-SF) vs the paper's bounds")
    for col in ("α", "Amin", "bound (3−α)/2", "A_ℓ", "A_ℓ bound", "Amax", "Amin restarts"):
        t.add_column(col, justify="right")
    by = {(r["u"], r["policy"]): r for r in fig["two_point"]}
    for u in sorted({r["u"] for r in fig["two_point"]}):
        amin, aell, amax = by[(u, "amin")], by[(u, "aell")], by[(u, "amax")]
        t.add_row(
            f"{amin['alpha']:.3f}",
            f"{amin['tel_ratio_vs_hsf']:.3f}",
            f"{amin['bound_amin']:.3f}",
            f"{aell['tel_ratio_vs_hsf']:.3f}",
            f"{aell['bound_aell']:.3f}",
            f"{amax['tel_ratio_vs_hsf']:.3f}",
            f"{amin['restarts']:,}",
        )
    return t
