"""`duetime bench ala`'s report: the figures as --json writes them, its tables, lines and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from duetime.bench.ala import BASELINES


def public(fig: dict[str, Any]) -> dict[str, Any]:
    """The figure without in-memory objects (what --json writes)."""
    out = dict(fig)
    out["configs"] = {
        n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in fig["configs"].items()
    }
    return out


def _short(name: str) -> str:
    """A config's name for a rich table or line: shortened, markup escaped."""
    from rich.markup import escape

    return escape(name.replace("-llama2-7b", "").replace("gemma3-270m-", ""))


def tables(fig: dict[str, Any]) -> list[Any]:
    """Rich tables: median % error per method and config; Table I."""
    from rich.markup import escape
    from rich.table import Table

    methods = ("ala", "ala_sa", *BASELINES)
    t = Table(title="median % error on held-out (ii, oo) pairs (paper: ALA ~4 %)")
    t.add_column("config", no_wrap=True)
    t.add_column("pairs", justify="right")
    for head in ("ALA", "ALA+SA", "linear", "RF", "GB", "XGB"):
        t.add_column(head, justify="right")
    for name, r in fig["configs"].items():
        best = min(r["median_err_pct"].values())
        cells = [
            f"[bold]{v:.1f}[/]" if v == best else f"{v:.1f}"
            for v in (r["median_err_pct"][m] for m in methods)
        ]
        t.add_row(_short(name), f"{r['pairs_train']}/{r['pairs_val']}/{r['pairs_test']}", *cells)
    t1 = Table(
        title="Table I: error predictor trained on "
        f"{escape(fig['error_predictor_source'])}'s SA log"
    )
    for col in ("dataset", "predicted err %", "confidence", "actual err %"):
        t1.add_column(col, justify="left" if col == "dataset" else "right")
    for row in fig["table1"]:
        t1.add_row(
            escape(row["dataset"]),
            f"{row['predicted_err_pct']:.2f}",
            f"{row['confidence']:.2f}",
            f"{row['actual_err_pct']:.2f}",
        )
    tx = Table(
        title="median % error beyond the training range (batch: train the smaller 2/3 of "
        "batch sizes, test larger; shape: train small ii and oo, test larger)"
    )
    tx.add_column("config / split", no_wrap=True)
    tx.add_column("runs", justify="right")
    for head in ("ALA", "linear", "RF", "GB", "XGB"):
        tx.add_column(head, justify="right")
    for name, r in fig["configs"].items():
        short = _short(name)
        for split, x in r.get("extrapolation", {}).items():
            med = x["median_err_pct"]
            best = min(med.values())
            cells = [
                f"[bold]{v:.1f}[/]" if v == best else f"{v:.1f}"
                for v in (med[m] for m in ("ala", *BASELINES))
            ]
            tx.add_row(f"{short} / {split}", f"{x['runs_train']}/{x['runs_test']}", *cells)
    return [t, t1, tx]


def sa_lines(fig: dict[str, Any]) -> list[str]:
    """One line per configuration: validation median % error per annealing iteration."""
    from rich.markup import escape

    return [
        f"SA {escape(name)}: "
        + " ".join(
            f"{s['val_median_err_pct']:.1f}{'' if s['accepted'] else 'x'}" for s in r["sa_log"]
        )
        + f" -> best {r['sa_best_val_err_pct']:.1f} %"
        for name, r in fig["configs"].items()
    ]


def plot(fig: dict[str, Any], path: Path) -> None:
    """Bars of median % error per method and config; validation error over SA iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from duetime.metrics.atomic import save_png

    methods = ("ala", "ala_sa", *BASELINES)
    names = list(fig["configs"])
    f, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    w = 0.8 / len(methods)
    for k, m in enumerate(methods):
        vals = [fig["configs"][n]["median_err_pct"][m] for n in names]
        ax1.bar(np.arange(len(names)) + k * w, vals, w, label=m)
    ax1.set_xticks(np.arange(len(names)) + 0.4 - w / 2)
    ax1.set_xticklabels(
        [n.replace("-llama2-7b", "").replace("gemma3-270m-", "") for n in names],
        rotation=25,
        ha="right",
    )
    ax1.set_yscale("log")
    ax1.set_ylabel("median error on held-out pairs (%)")
    # Legends under the axes: inside, they hid bars and curves.
    ax1.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    for n in names:
        log = fig["configs"][n]["sa_log"]
        ax2.plot([s["iteration"] for s in log], [s["val_median_err_pct"] for s in log], label=n)
    ax2.set_xlabel("simulated-annealing iteration")
    ax2.set_ylabel("validation median error (%)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    f.tight_layout()
    save_png(f, path)
    plt.close(f)
