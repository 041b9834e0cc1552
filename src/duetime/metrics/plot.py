"""Plot a parameter sweep: one subplot per metric, one line per policy (or per
combination of fields that varies), spread across seeds.

Rows are the plain dicts a sweep naturally produces, one per run, e.g.
``{"policy": "edf", "rate_req_s": 4.0, "seed": 0, "e2e_p90_s": 1.7}``. Runs that
share a policy and an x value (different seeds) are drawn as their mean with
a shaded min–max band, which shows the seed-to-seed spread without claiming
a distribution that three seeds cannot support. A ``hue`` of several fields
(``("policy", "replicas", "router")``) draws one line per combination of them,
labelled with the fields whose values differ between rows.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from duetime.metrics.atomic import save_png


def plot_sweep(
    rows: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    y: str | Sequence[str],
    x: str = "rate_req_s",
    hue: str | Sequence[str] = "policy",
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Write the plot to ``path`` (atomically, parents created) in the format its
    suffix names where matplotlib writes it (``.pdf``, ``.svg``), else PNG; return
    the path.

    ``x`` values may be numbers (plotted to scale; evenly spaced and in order where
    one is infinite) or labels (plotted evenly spaced, in first-seen order). Rows
    whose ``y`` value is missing or None are skipped for that metric only. Uses
    matplotlib's object API with the Agg canvas, so it needs no display and leaves
    pyplot's global state alone.
    ``hue`` is the field (or fields) whose values make the lines; of several fields,
    the label and the legend's title name those that vary across ``rows``.
    """
    # Imported here: matplotlib costs ~0.5 s to import and most callers never plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = [y] if isinstance(y, str) else list(y)
    if not metrics:
        raise ValueError("plot_sweep needs at least one metric in y")
    data = list(rows)
    key, legend_title, data = _hue_labels(data, [hue] if isinstance(hue, str) else list(hue))
    xs: list[Any] = list(dict.fromkeys(r.get(x) for r in data))
    numbers = all(isinstance(v, int | float) for v in xs)
    # To scale where every x is a finite number; an infinite one (``--rates 2,inf``: all
    # at once) would be dropped from a scaled axis, so then every x is a label, in order.
    numeric = numbers and all(math.isfinite(v) for v in xs)
    order = {v: i for i, v in enumerate(sorted(xs) if numbers else xs)}
    # One colour per line across all subplots, even where a line lacks a metric.
    colour = {h: f"C{i % 10}" for i, h in enumerate(dict.fromkeys(str(r.get(key)) for r in data))}

    ncols = min(len(metrics), 3)
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, metric in zip(axes, metrics, strict=False):
        for label, (xs, mean, lo, hi) in _series(data, x, metric, key).items():
            pos = xs if numeric else [order[v] for v in xs]
            ax.plot(pos, mean, marker="o", label=label, color=colour[label])
            if any(a != b for a, b in zip(lo, hi, strict=True)):
                ax.fill_between(pos, lo, hi, color=colour[label], alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel(x)
        ax.grid(True, alpha=0.3)
        if not numeric:
            ax.set_xticks(range(len(order)), [f"{v:g}" if numbers else str(v) for v in order])
        if ax.lines:
            ax.legend(title=legend_title, fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return save_png(fig, path, dpi=dpi)


def _series(
    rows: list[Mapping[str, Any]], x: str, metric: str, hue: str
) -> dict[str, tuple[list[Any], list[float], list[float], list[float]]]:
    """``{hue label: (x values, mean, min, max)}`` with x sorted (numbers) or first-seen."""
    groups: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        v = r.get(metric)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        groups[str(r.get(hue))][r.get(x)].append(float(v))
    out = {}
    for label, by_x in groups.items():
        xs = list(by_x)
        if all(isinstance(v, int | float) for v in xs):
            xs.sort()
        vals = [by_x[v] for v in xs]
        out[label] = (
            xs,
            [sum(v) / len(v) for v in vals],
            [min(v) for v in vals],
            [max(v) for v in vals],
        )
    return out


_HUE = "_hue"  # the key a row's line label is kept under while plotting


def _hue_labels(
    rows: list[Mapping[str, Any]], fields: list[str]
) -> tuple[str, str, list[Mapping[str, Any]]]:
    """The key of a row's line label, the legend's title and the rows: of several
    ``fields``, each row gets the values of those that vary across rows, joined, as
    its label (the first field's when none varies)."""
    if not fields:
        raise ValueError("plot_sweep needs at least one field in hue")
    if len(fields) == 1:
        return fields[0], fields[0], rows
    varies = [f for f in fields if len({str(r.get(f)) for r in rows}) > 1] or fields[:1]
    labelled: list[Mapping[str, Any]] = [
        {**r, _HUE: ", ".join(str(r.get(f)) for f in varies)} for r in rows
    ]
    return _HUE, ", ".join(varies), labelled
