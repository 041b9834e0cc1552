"""The engine's step cost for ``bench timebill --engine``: timed steps, evictions, the fit.

TimeBill's estimator (ETE) and the cost-aware policies need this engine's step
time on this workload's shapes: the reference run's own steps, a few short
ones that spread the points, and timed evictions (an eviction costs decode
steps the paper's model does not count).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job
from duetime.predict.ete import StepSample

__all__ = ["eviction_samples", "fit_engine_cost", "short_steps"]


def short_steps(model: Any, jobs: Sequence[Job], reps: int = 2) -> list[StepSample]:
    """Prompts of ``N_x/8`` and ``N_x/2`` tokens and a short decode context, timed (after
    ``measure_steps``' own warm-up); run before the reference so it also warms the engine."""
    from duetime.engine.profile import ProfileGrid, measure_steps

    lo = min(j.request.prompt_len for j in jobs)
    short = tuple(sorted({max(lo // 8, 1), max(lo // 2, 1)}))
    grid = ProfileGrid(
        prompt_lens=short, batches=(1,), contexts=short[:1], mixed=(), reps=reps,
        max_setup_tokens=1 << 30,
    )  # fmt: skip
    return measure_steps(model, grid)


def eviction_samples(model: Any, jobs: Sequence[Job], method: str) -> list[tuple[int, float]]:
    """Timed evictions (α = 0.5) of the workload's shortest, median and longest prompts:
    the ``e`` the eviction-cost-aware α* charges (one SnapKV eviction was ~2 decode steps
    on this engine, which the paper's model does not count)."""
    from duetime.engine.profile import measure_evictions

    lens = sorted(j.request.prompt_len for j in jobs)
    picked = sorted({lens[0], lens[len(lens) // 2], lens[-1]})
    return measure_evictions(model, picked, method="snapkv" if method == "snapkv" else "streaming")


def fit_engine_cost(
    short: Sequence[StepSample], real_steps: Sequence[StepSample]
) -> tuple[LinearStepCost, dict[str, Any]]:
    """Fit ``duetime profile``'s step cost to the reference run's own steps (``real_steps``:
    this workload's prompts and contexts, timed under the same machine load as the runs that
    follow) plus ``short`` steps (:func:`short_steps`), which spread the points so the
    quadratic prefill and the per-KV-token slope are not fitted from a handful of nearby
    lengths."""
    from duetime.predict.ete import cost_mape_pct, fit_batch_cost, fit_timebill

    t0 = time.perf_counter()
    samples = [*short, *real_steps]
    cost = fit_batch_cost(samples, name="timebill-engine-fit")
    ete = fit_timebill(samples)
    info = {
        "source": f"fitted to {len(real_steps)} steps of the reference run and "
        f"{len(samples) - len(real_steps)} short steps timed by this bench",
        "timed_steps": len(samples),
        "fit_mape_pct": cost_mape_pct(cost, samples),
        "fit_wall_s": time.perf_counter() - t0,
        "step_cost": {k: getattr(cost, k) for k in ("c0", "c_prefill", "a1", "a2", "b", "d")},
        "timebill_ete": {"a": ete.a, "b": ete.b, "c": ete.c, "p": ete.p, "q": ete.q},
    }
    return cost, info
