"""`duetime profile --plot`: the fitted step-cost model against every timed step.

Why a picture: the miss table names the cells that miss, but a shape the cost form
cannot follow (a chunk after a long past, a row count where a kernel changes) shows
as a bend or a separated cloud in measured / predicted against the step's rows,
which a table of medians by band flattens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.predict.ete import StepSample, priced_seconds

__all__ = ["plot_step_fit"]

_COLORS = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green"}


def plot_step_fit(
    cost: LinearStepCost,
    samples: Sequence[StepSample],
    path: Path,
    *,
    floor_pct: float | None = None,
    title: str = "step-cost model",
) -> Path:
    """Two panels, every sample priced by ``cost``: measured against predicted seconds
    (log-log, the diagonal and ``floor_pct`` either side of it), and measured /
    predicted against the step's rows (prompt tokens + decoders), by kind of step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from duetime.metrics.atomic import save_png

    if not samples:
        raise ValueError("no timed steps to plot")
    pred = priced_seconds(cost, samples)
    real = np.array([s.seconds for s in samples])
    rows = np.array([s.prefill_tokens + s.decode_seqs for s in samples])
    kinds = np.array([s.kind for s in samples])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, color in _COLORS.items():
        k = kinds == kind
        if not k.any():
            continue
        left.scatter(1e3 * pred[k], 1e3 * real[k], s=7, alpha=0.5, color=color, label=kind)
        right.scatter(rows[k], real[k] / pred[k], s=7, alpha=0.5, color=color, label=kind)
    lo, hi = 1e3 * min(pred.min(), real.min()), 1e3 * max(pred.max(), real.max())
    line = np.array([lo, hi])
    left.plot(line, line, "k--", lw=1, label="measured = predicted")
    right.axhline(1.0, color="k", ls="--", lw=1)
    if floor_pct is not None:
        f = floor_pct / 100
        left.plot(line, line * (1 + f), "k:", lw=1, label=f"±{floor_pct:.1f} % (noise floor)")
        left.plot(line, line * (1 - f), "k:", lw=1)
        for y in (1 + f, 1 - f):
            right.axhline(y, color="k", ls=":", lw=1)
    left.set(xscale="log", yscale="log", xlabel="predicted step (ms)", ylabel="measured step (ms)")
    left.set_title(title)
    left.legend(fontsize=8)
    right.set(xscale="log", xlabel="rows in the step (prompt tokens + decoders)")
    right.set_ylabel("measured / predicted")
    right.set_title("where the model misses, by rows")
    right.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)
