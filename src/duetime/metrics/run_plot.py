"""Latency CDFs for one or a few runs: where people would rather look than read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from duetime.core.record import RequestRecord
from duetime.metrics.atomic import save_png


def plot_latency_cdf(runs: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """TTFT and end-to-end latency CDFs, one line per run label; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, records in runs.items():
        done = [r for r in records if r.completed]  # as the summary's ttft_* / e2e_* count
        for ax, attr in zip(axes, ("ttft", "e2e"), strict=True):
            vals = np.sort([v for r in done if (v := getattr(r, attr)) is not None])
            if len(vals):
                ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=label)
    for ax, title in zip(axes, ("time to first token", "end-to-end latency"), strict=True):
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of completed requests")
        ax.set_title(title)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        else:  # matplotlib would warn that the legend has no entries
            ax.text(0.5, 0.5, "no completed requests", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return save_png(fig, path)
