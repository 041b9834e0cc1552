"""`duetime bench sensitivity`: how much each policy loses as length predictions get worse.

The same ShareGPT workload (memory-bound: small KV budget, high rate,
deadlines at a multiple of each request's time alone) runs through every
policy with the noisy oracle at growing log-normal error σ (σ = 0 is the
oracle). Policies read only ``Request.predicted`` (point + interval), so the
predictor is the one thing that changes. FCFS, which reads no prediction, is
the flat reference line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from duetime.experiment import SimSpec, build_jobs, run_spec

__all__ = ["DEFAULT_ERRORS", "DEFAULT_POLICIES", "plot", "run"]

DEFAULT_POLICIES = ("fcfs", "sjf", "amax", "amin", "timebill")
DEFAULT_ERRORS = (0.0, 0.1, 0.25, 0.5, 1.0)


def _predictor(sigma: float) -> str:
    return "oracle" if sigma == 0 else f"noisy:{sigma:g}"


def run(
    policies: Sequence[str] = DEFAULT_POLICIES,
    errors: Sequence[float] = DEFAULT_ERRORS,
    *,
    requests: int = 800,
    rate: float = 20.0,
    kv_capacity: int = 30_000,
    deadline_scale: float = 8.0,
    seed: int = 0,
    profile: str = "a100-llama2-7b",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """One simulation per (policy, σ) on identical jobs; figures named with units."""
    if any(e < 0 for e in errors):
        raise ValueError(f"prediction errors must be >= 0, got {list(errors)}")
    t0 = time.perf_counter()
    base = SimSpec(
        requests=requests,
        rate=rate,
        seed=seed,
        profile=profile,
        kv_capacity=kv_capacity,
        deadline_scale=deadline_scale,
    )
    rows: list[dict[str, Any]] = []
    total = len(policies) * len(errors)
    for policy in policies:
        for sigma in errors:
            spec = SimSpec(**{**base.to_dict(), "policy": policy, "predictor": _predictor(sigma)})
            _, row = run_spec(spec, build_jobs(spec))  # fresh jobs: predictors annotate them
            rows.append(
                {
                    "policy": policy,
                    "prediction_error_sigma": sigma,
                    "tel_s": row["tel_s"],
                    "e2e_mean_s": row["e2e_mean_s"],
                    "deadline_hit_rate": row["deadline_hit_rate"],
                    "completion_rate": row["completed"] / requests,
                    "preemptions": row["preemptions"],
                }
            )
            if progress is not None:
                progress(len(rows), total)
    return {
        "workload": base.to_dict(),
        "errors_sigma": list(errors),
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from duetime.metrics.atomic import save_png

    panels = (("tel_s", "total end-to-end latency (s)"), ("deadline_hit_rate", "deadline hit rate"))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for policy in dict.fromkeys(r["policy"] for r in fig["rows"]):
            mine = [r for r in fig["rows"] if r["policy"] == policy]
            ax.plot(
                [r["prediction_error_sigma"] for r in mine],
                [r[key] for r in mine],
                marker="o",
                linestyle="--" if policy == "fcfs" else "-",
                label=policy,
            )
        ax.set_xlabel("length prediction error σ (log-normal; 0 = oracle)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    w = fig["workload"]
    figure.suptitle(
        f"{w['requests']} ShareGPT requests at {w['rate']}/s, KV {w['kv_capacity']} tokens, "
        f"deadline = {w['deadline_scale']}x time alone ({w['profile']})"
    )
    figure.tight_layout()
    return save_png(figure, path)
