"""Draw docs/figures/architecture.png: a served and a simulated request through duetime.

Run: python docs/figures/architecture.py  (needs matplotlib; writes the PNG beside this file)
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

SERVED = "#dbe9f6"
SIM = "#e3f1df"
SHARED = "#fbe9c9"


def box(ax, x, y, w, h, title, module, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="#444", lw=1))
    ax.text(x + w / 2, y + h * 0.63, title, ha="center", va="center", fontsize=9, weight="bold")
    ax.text(x + w / 2, y + h * 0.28, module, ha="center", va="center", fontsize=7.5, family="monospace")


def arrow(ax, a, b, label=""):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.1, color="#333"))
    if label:
        ax.text((a[0] + b[0]) / 2 + 0.05, (a[1] + b[1]) / 2, label, fontsize=7, color="#333", va="center")


def main() -> None:
    fig, ax = plt.subplots(figsize=(11, 6.6))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    w, h = 2.5, 0.62
    # served path, left column (top to bottom)
    xs = 0.3
    served = [
        ("HTTP request", "server/app.py", 5.7),
        ("admission (forecast)", "server/admission.py → sim/forecast.py", 4.8),
        ("engine loop thread", "server/engine_loop.py", 3.9),
    ]
    for t, m, y in served:
        box(ax, xs, y, w + 0.6, h, t, m, SERVED)
    arrow(ax, (xs + 1.55, 5.7), (xs + 1.55, 4.8 + h))
    arrow(ax, (xs + 1.55, 4.8), (xs + 1.55, 3.9 + h), "submit")
    # simulated path, right column
    xr = 7.9
    sim = [
        ("duetime sim / bench", "cli/sim.py, workloads/", 5.7),
        ("length prediction", "predict/ (annotate jobs)", 4.8),
        ("Simulator.run", "sim/simulator.py", 3.9),
    ]
    for t, m, y in sim:
        box(ax, xr, y, w + 0.3, h, t, m, SIM)
    arrow(ax, (xr + 1.4, 5.7), (xr + 1.4, 4.8 + h))
    arrow(ax, (xr + 1.4, 4.8), (xr + 1.4, 3.9 + h))
    # shared core, middle
    xc = 4.0
    box(ax, xc, 2.75, 3.0, 0.8, "ExecutorCore: snapshot → apply", "core/executor.py, core/snapshot.py", SHARED)
    box(ax, xc, 4.35, 3.0, 0.62, "Policy.schedule → Decision", "policies/ (edf, pud, timebill, …)", SHARED)
    arrow(ax, (xs + w + 0.6, 3.9 + h / 2), (xc, 3.3), "EngineExecutor.tick")
    arrow(ax, (xr, 3.9 + h / 2), (xc + 3.0, 3.3), "run loop")
    arrow(ax, (xc + 1.2, 3.55), (xc + 1.2, 4.35))
    ax.text(xc + 0.55, 3.95, "snapshot", fontsize=7, color="#333", va="center")
    arrow(ax, (xc + 1.8, 4.35), (xc + 1.8, 3.55))
    ax.text(xc + 1.88, 3.95, "decision", fontsize=7, color="#333", va="center")
    # step back ends
    box(ax, 0.3, 1.55, w + 0.6, h, "model step", "engine/gemma3.py (+ kernels)", SERVED)
    box(ax, xr, 1.55, w + 0.3, h, "cost-model step", "core/cost.py (LinearStepCost)", SIM)
    arrow(ax, (xc, 2.9), (0.3 + w + 0.6, 1.55 + h / 2), "engine")
    arrow(ax, (xc + 3.0, 2.9), (xr, 1.55 + h / 2), "simulator")
    # results
    box(ax, 0.3, 0.35, w + 0.6, h, "token stream / JSON", "server/relay.py, server/answers.py", SERVED)
    box(ax, xr, 0.35, w + 0.3, h, "records → metrics", "core RequestRecord, metrics/", SIM)
    arrow(ax, (1.85, 1.55), (1.85, 0.35 + h), "tokens (Stream)")
    arrow(ax, (xr + 1.4, 1.55), (xr + 1.4, 0.35 + h), "finish times")
    ax.text(1.85, 6.45, "served request", ha="center", fontsize=11, weight="bold", color="#1f4e79")
    ax.text(9.3, 6.45, "simulated request", ha="center", fontsize=11, weight="bold", color="#2e6b2e")
    ax.text(5.5, 6.45, "one policy, one state machine", ha="center", fontsize=11, weight="bold", color="#8a5a00")
    out = Path(__file__).with_suffix(".png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
