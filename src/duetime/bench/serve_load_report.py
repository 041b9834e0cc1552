"""Tables and a picture of `duetime bench serve-load`'s figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duetime.server.step_log import PARTS

__all__ = ["band_rows", "plot_serve_load", "rate_rows"]

_RATE_KEYS = (
    "served_output_tok_s",
    "offline_output_tok_s",
    "served_over_offline",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "ok",
    "errors",
)


def rate_rows(fig: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One row per rate: client figures, the offline replay's, and where the engine
    thread's time went (shares of its busy span) and who used the CPU."""
    rows = []
    for run in fig["runs"]:
        steps = run["served_steps"]
        row = {k: run.get(k) for k in _RATE_KEYS}
        row["mean_running_batch"] = steps.get("mean_running_batch")
        row.update({f"{p}_share": steps.get(f"{p}_share") for p in PARTS})
        row["round_overhead_ms_per_step"] = steps.get("round_overhead_ms_per_step")
        for who, secs in sorted(run["cpu_s"].items()):
            row[f"cpu_s[{who}]"] = secs
        rows.append((run["run"], row))
    return rows


def band_rows(fig: dict[str, Any]) -> list[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """Per rate, one row per decode-batch band."""
    out = []
    for run in fig["runs"]:
        rows = [(b["band"], {k: v for k, v in b.items() if k != "band"}) for b in run["bands"]]
        out.append((run["run"], rows))
    return out


def plot_serve_load(fig: dict[str, Any], path: str | Path) -> Path:
    """Left: served and offline forward pass by decode batch band, per rate. Right: where
    the engine thread's busy time went, per rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_png

    figure = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for run in fig["runs"]:
        # a band of one or two steps is a transition, not a regime
        bands = [b for b in run["bands"] if b["served_steps"] >= 3]
        xs = [b["mean_decoders"] for b in bands]
        (line,) = left.plot(xs, [b["served_forward_ms"] for b in bands], "o-", label=run["run"])
        off = [(b["mean_decoders"], b["offline_forward_ms"]) for b in bands]
        off = [(x, y) for x, y in off if y is not None]
        if off:
            left.plot(*zip(*off, strict=True), "x--", color=line.get_color())
    left.set(
        xscale="log",
        xlabel="running batch (decode-only steps)",
        ylabel="forward pass, ms (median)",
        title="served (o) vs offline (x), same requests",
    )
    left.grid(alpha=0.3)
    left.legend(title="rate")
    labels = [run["run"] for run in fig["runs"]]
    bottom = [0.0] * len(labels)
    for part in PARTS:
        shares = [run["served_steps"].get(f"{part}_share") or 0.0 for run in fig["runs"]]
        right.bar(labels, shares, bottom=bottom, label=part)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set(ylabel="share of the engine thread's busy span", title="where a round's time goes")
    right.legend(fontsize=8)
    return save_png(figure, path)
