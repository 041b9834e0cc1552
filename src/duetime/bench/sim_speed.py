"""`duetime bench sim`: how fast the simulator is at 100k-request scale.

The issue's target: 100,000 ShareGPT requests through FCFS on the GPU-like
profile, at an arrival rate that keeps about 128 sequences running, in at most
10 s of wall time on a 2-core machine. The rate is derived from the profile
and the workload's mean lengths (Little's law on the running set), and the
measured mean running count is printed beside it so the claim can be checked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job


def rate_for_running(jobs: list[Job], cost: LinearStepCost, target_running: float) -> float:
    """Arrival rate at which about ``target_running`` sequences decode at once.

    With B sequences decoding, a step costs ``c0 + b·B + d·B·(P̄ + Ō/2)``. Each
    second, ``λ·w_p`` seconds go to prefill work (``w_p`` = mean extra step
    time a prompt adds), so decode steps run ``(1 − λ·w_p)/step`` times a
    second and a request spends ``Ō·step/(1 − λ·w_p)`` seconds decoding. Little's
    law, ``B = λ·Ō·step/(1 − λ·w_p)``, gives ``λ = B / (Ō·step + B·w_p)``.
    """
    p = np.array([j.request.prompt_len for j in jobs], dtype=float)
    o = float(np.mean([j.output_len for j in jobs]))
    b = target_running
    step = cost.decode_step(max(round(b), 1), b * (p.mean() + o / 2))
    w_p = float(np.mean([cost.prefill_time(int(n)) - cost.c0 for n in p]))
    return b / (o * step + b * w_p)


def calibrate_rate(spec_rate: float, make: Any, target_running: float, iters: int = 7) -> float:
    """Bisect the rate so a pilot run keeps ``target_running`` sequences running.

    ``make(rate) -> mean_running`` runs a short pilot. The mean running count
    grows with the rate, so bisection between half and twice the analytic
    estimate converges; 7 halvings land within about 1 %.
    """
    lo, hi = spec_rate * 0.5, spec_rate * 1.5
    for _ in range(iters):
        mid = (lo + hi) / 2
        if make(mid) < target_running:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run(
    requests: int = 100_000,
    seed: int = 0,
    target_running: float = 128.0,
    replicas: int = 1,
    router: str = "lor",
) -> dict[str, Any]:
    """Run the benchmark; returns figures named with their units. With ``replicas`` > 1,
    a fleet behind ``router`` (:func:`run_fleet`)."""
    import time

    if not (math.isfinite(target_running) and target_running > 0):
        raise ValueError(f"--target-running must be finite and > 0 sequences, got {target_running}")
    if replicas > 1:
        return run_fleet(requests, seed, target_running, replicas, router)

    from duetime.experiment import SimSpec, build_jobs, run_spec
    from duetime.sim.profiles import load_profile

    spec = SimSpec(policy="fcfs", workload="sharegpt", requests=requests, seed=seed)
    t0 = time.perf_counter()
    jobs = build_jobs(spec)
    build_s = time.perf_counter() - t0
    cost, _ = load_profile(spec.profile)
    estimate = rate_for_running(jobs, cost, target_running)

    def pilot(rate: float) -> float:
        p = SimSpec(policy="fcfs", workload="sharegpt", requests=min(requests, 10_000), seed=seed)
        p.rate = rate
        return run_spec(p)[0].mean_running

    t0 = time.perf_counter()
    spec.rate = calibrate_rate(estimate, pilot, target_running)
    calibrate_s = time.perf_counter() - t0
    jobs = build_jobs(spec)  # same seed, new rate: same lengths, rescaled arrivals
    result, row = run_spec(spec, jobs)
    return {
        "requests": requests,
        "policy": spec.policy,
        "profile": spec.profile,
        "rate_req_s": spec.rate,
        "mean_running": result.mean_running,
        "wall_s": result.wall_s,
        "workload_build_s": build_s,
        "rate_calibration_s": calibrate_s,
        "sim_span_s": result.sim_time,
        "sim_speedup_x": result.sim_time / result.wall_s,
        "engine_steps": result.engine_steps,
        "steps_per_s": result.engine_steps / result.wall_s,
        "requests_per_s": requests / result.wall_s,
        "us_per_step": 1e6 * result.wall_s / max(result.engine_steps, 1),
        "policy_calls": result.policy_calls,
        "preemptions": result.preemptions,
        "completed": row["completed"],
        "e2e_p50_s": row["e2e_p50_s"],
        "target_wall_s": 10.0,
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_fleet(
    requests: int, seed: int, target_running: float, replicas: int, router: str
) -> dict[str, Any]:
    """The fleet's figures: ``replicas`` copies of the profile behind ``router``, at
    ``replicas`` times the rate that keeps ``target_running`` sequences running on one
    (the analytic estimate: pilot runs of a large fleet would cost more than the run).
    The fleet's target: 1,000,000 requests over 64 replicas in <= 60 s, <= 4 GiB."""
    import time

    from duetime.experiment import SimSpec, build_jobs
    from duetime.sim.fleet_run import run_fleet as run_spec_fleet
    from duetime.sim.profiles import load_profile

    spec = SimSpec(policy="fcfs", workload="sharegpt", requests=requests, seed=seed)
    t0 = time.perf_counter()
    pilot = build_jobs(SimSpec(policy="fcfs", requests=min(requests, 10_000), seed=seed))
    cost, _ = load_profile(spec.profile)
    spec.rate = rate_for_running(pilot, cost, target_running) * replicas
    spec.replicas, spec.router = replicas, router
    del pilot
    build_s = time.perf_counter() - t0
    result, row, per = run_spec_fleet(spec)
    wall = result.wall_s
    return {
        "requests": requests,
        "replicas": replicas,
        "router": router,
        "policy": spec.policy,
        "profile": spec.profile,
        "rate_req_s": spec.rate,
        "mean_running_per_replica": float(np.mean([r["mean_running"] for r in per])),
        "wall_s": wall,
        "workload_build_s": build_s,
        "sim_span_s": result.sim_time,
        "engine_steps": result.engine_steps,
        "requests_per_s": requests / wall,
        "us_per_request": 1e6 * wall / requests,
        "router_calls": result.router_calls,
        "completed": row["completed"],
        "e2e_p50_s": row["e2e_p50_s"],
        "peak_rss_mib": peak_rss_mib(),
        "target_wall_s": 60.0,
        "target_peak_rss_mib": 4096.0,
    }
