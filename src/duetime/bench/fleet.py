"""`duetime bench fleet`: the routers side by side, at 50-95 % of a fleet's capacity.

ShareGPT requests in three classes with their own deadlines (``CLASSES``: a
multiple of each request's time alone on the base profile), through FCFS
replicas, on a homogeneous fleet and on a mixed one (half the replicas twice as
slow with half the KV). Load is a share of the fleet's capacity: the sum of each
replica's saturated throughput, measured by a closed run (every request queued
at t = 0) on that replica alone. Every router sees the same jobs (one seed) and
the same length predictor; only the forecast router uses the predicted lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.request import Job
from duetime.experiment import SimSpec, build_jobs
from duetime.metrics import SLO, summarize
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.routers import available_routers, make_router
from duetime.sim.fleet import Fleet, ReplicaSpec
from duetime.sim.fleet_build import replica
from duetime.sim.profiles import DEFAULT_PROFILE, load_profile
from duetime.sim.simulator import Simulator

#: (class, share of requests, deadline = arrival + slack × time alone)
CLASSES = (("interactive", 0.4, 3.0), ("standard", 0.4, 8.0), ("batch", 0.2, 25.0))
LOADS = (0.5, 0.7, 0.85, 0.95)
FIGURES = ("deadline_hit_rate", "goodput_req_s", "e2e_p50_s", "e2e_p99_s", "refused")


def fleets(n: int, profile: str = DEFAULT_PROFILE) -> dict[str, list[ReplicaSpec]]:
    """The two fleets compared: ``n`` alike, and half of them twice as slow, half the KV."""
    _, cfg = load_profile(profile)
    slow = [
        replica(profile, slowdown=2.0, kv_capacity=cfg.kv_capacity // 2, name="slow")
        for _ in range(n // 2)
    ]
    return {
        "homogeneous": [replica(profile) for _ in range(n)],
        "mixed": [replica(profile) for _ in range(n - n // 2)] + slow,
    }


def capacity_req_s(spec: ReplicaSpec, jobs: Sequence[Job]) -> float:
    """Saturated throughput of one replica, requests/s: every job queued at t = 0, FCFS."""
    closed = [Job(_at(j, 0.0), j.output_len) for j in jobs]
    res = Simulator(make_policy("fcfs"), spec.cost, spec.config).run(closed)
    return len(closed) / res.sim_time


def _at(job: Job, arrival: float) -> Any:
    from dataclasses import replace

    return replace(job.request, arrival=arrival, deadline=None, predicted=None)


def classed_jobs(
    requests: int, rate: float, seed: int, profile: str = DEFAULT_PROFILE
) -> list[Job]:
    """ShareGPT at ``rate`` req/s, each request in a class with its deadline."""
    jobs = build_jobs(SimSpec(requests=requests, rate=rate, seed=seed))
    cost, _ = load_profile(profile)
    rng = np.random.default_rng(seed + 7919)
    names = [c[0] for c in CLASSES]
    which = rng.choice(len(CLASSES), size=len(jobs), p=[c[1] for c in CLASSES])
    for job, k in zip(jobs, which, strict=True):
        req = job.request
        alone = cost.alone_time(req.prompt_len, job.output_len)
        req.klass = names[k]
        req.deadline = req.arrival + CLASSES[k][2] * alone
    return jobs


def run(
    *,
    replicas: int = 4,
    requests: int = 1500,
    seed: int = 0,
    routers: Sequence[str] | None = None,
    loads: Sequence[float] = LOADS,
    predictor: str = "noisy:0.3",
) -> dict[str, Any]:
    """Every router × load × fleet; figures named with their units."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if predictor.partition(":")[0] == "learned":  # found before the runs, in CLI words
        raise ValueError(
            f"--predictor {predictor} reads each request's prompt, and bench fleet plays "
            "ShareGPT lengths without their texts: use noisy[:σ], oracle or interval:<spec>"
        )
    if any(not 0 < x < 2 for x in loads):
        raise ValueError(f"--loads are shares of capacity in (0, 2), got {list(loads)}")
    routers = list(routers or available_routers())
    for name in routers:
        make_router(name)  # unknown names fail before any run
    pilot = build_jobs(SimSpec(requests=min(requests, 800), rate=1.0, seed=seed))
    rows: list[dict[str, Any]] = []
    caps: dict[str, float] = {}
    for fleet_name, specs in fleets(replicas).items():
        cache: dict[str, float] = {}
        cap = 0.0
        for s in specs:
            if s.name not in cache:
                cache[s.name] = capacity_req_s(s, pilot)
            cap += cache[s.name]
        caps[fleet_name] = cap
        for load in loads:
            for name in routers:
                jobs = classed_jobs(requests, load * cap, seed)
                fleet = Fleet(
                    specs,
                    lambda: make_policy("fcfs"),
                    make_router(name, seed=seed),
                    predictor=make_job_predictor(predictor, seed=seed),
                )
                res = fleet.run(jobs)
                summary = summarize(res.records, slo=SLO())
                rows.append(
                    {
                        "fleet": fleet_name,
                        "load_pct": round(100 * load),
                        "rate_req_s": load * cap,
                        "router": name,
                        **{k: summary[k] for k in FIGURES if k in summary},
                        "refused": res.counters["refused"],
                        "wall_s": res.wall_s,
                    }
                )
    return {
        "replicas": replicas,
        "requests": requests,
        "seed": seed,
        "policy": "fcfs",
        "predictor": predictor,
        "classes": [{"klass": c, "share": s, "deadline_slack_x": x} for c, s, x in CLASSES],
        "capacity_req_s": caps,
        "rows": rows,
    }


def plot(fig: dict[str, Any], path: Path) -> None:
    """Deadline hit rate and goodput against load, one line per router, a column a fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from duetime.metrics.atomic import save_png

    names = list(fig["capacity_req_s"])
    f, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7), squeeze=False)
    routers = list(dict.fromkeys(r["router"] for r in fig["rows"]))
    for col, fleet_name in enumerate(names):
        for row, (key, label) in enumerate(
            (("deadline_hit_rate", "deadline hit rate"), ("goodput_req_s", "goodput, req/s"))
        ):
            ax = axes[row][col]
            for name in routers:
                pts = [r for r in fig["rows"] if r["fleet"] == fleet_name and r["router"] == name]
                ax.plot([r["load_pct"] for r in pts], [r[key] for r in pts], marker="o", label=name)
            ax.set_xlabel("load, % of fleet capacity")
            ax.set_ylabel(label)
            ax.set_title(f"{fleet_name} fleet of {fig['replicas']}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    f.tight_layout()
    save_png(f, path)
