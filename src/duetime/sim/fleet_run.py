"""A fleet run from a :class:`~duetime.experiment.SimSpec`: the replicas, the router,
the records, and summary rows for the fleet and for each replica."""

from __future__ import annotations

from typing import Any

from duetime.experiment import PlannedRun, SimSpec, is_trace, plan_spec, prompt_cached_pct
from duetime.metrics import SLO, summarize
from duetime.policies import make_policy
from duetime.routers import make_router
from duetime.sim.fleet import Fleet, FleetResult
from duetime.sim.fleet_build import build_fleet

#: The fleet's own figures in its row, beside :func:`summarize`'s.
FLEET_FIGURES = (
    "replicas",
    "router",
    "routed",
    "refused",
    "rerouted",
    "failed",
    "waited",
    "router_calls",
    "sim_time_s",
    "wall_s",
    "engine_steps",
    "preemptions",
    "kv_peak_tokens",
    "mean_running",
    "prompt_cached_pct",
    "policy_calls",
    "rejected",
)


def fleet_mean_running(result: FleetResult) -> float:
    """Sequences running across the fleet, averaged over the fleet's ``sim_time``: each
    replica's mean is over its own span (it stops at its last event), so its area is
    weighted back by that span."""
    area = sum(r.mean_running * r.sim_time for r in result.replicas)
    return area / result.sim_time if result.sim_time > 0 else 0.0


def is_fleet(spec: SimSpec) -> bool:
    """Whether a spec asks for a fleet (else the single-engine simulator runs it)."""
    return bool(
        spec.replicas > 1
        or spec.router is not None
        or spec.replica_profiles
        or spec.fleet is not None
        or spec.failures
    )


def make_fleet(plan: PlannedRun) -> Fleet:
    """The fleet a planned spec describes (replicas, router, failures), ready to run."""
    spec = plan.spec  # its replicas >= 1: plan_spec checked them (sim_config)
    given = {"kv_capacity": spec.kv_capacity, "max_num_seqs": spec.max_num_seqs}
    limits = {k: v for k, v in given.items() if v is not None}
    specs = build_fleet(
        spec.replicas, spec.replica_profiles, spec.fleet, spec.profile, plan.config, limits
    )
    router = make_router(spec.router or "round-robin", seed=spec.seed)
    fail_at: dict[int, float] = {}
    for i, t in spec.failures:
        if i in fail_at:
            raise ValueError(f"--fail names replica {i} twice")
        fail_at[i] = t
    policy_name = spec.policy
    make_policy(policy_name)  # a bad name fails here, before any replica is built
    return Fleet(
        specs,
        lambda: make_policy(policy_name),
        router,
        predictor=plan.predictor,
        fail_at=fail_at,
        max_time=plan.config.max_time,
    )


def run_fleet(
    spec: SimSpec, progress: Any = None, plan: PlannedRun | None = None
) -> tuple[FleetResult, dict[str, Any], list[dict[str, Any]]]:
    """Run a fleet spec; returns its result, the fleet's row and one row per replica."""
    plan = plan or plan_spec(spec)
    result = make_fleet(plan).run(plan.jobs, progress=progress)
    slo = SLO()
    row: dict[str, Any] = {
        "policy": spec.policy,
        "rate_req_s": None if is_trace(spec) else spec.rate,
        "seed": spec.seed,
        "workload": spec.workload,
        "predictor": plan.predictor_name or "none",
    }
    row.update(summarize(result.records, slo=slo))
    c = result.counters
    row.update(
        zip(
            FLEET_FIGURES,
            (
                len(result.replicas),
                spec.router or "round-robin",
                c["routed"],
                c["refused"],
                c["rerouted"],
                c["failed"],
                c["waited"],
                result.router_calls,
                result.sim_time,
                result.wall_s,
                result.engine_steps,
                sum(r.preemptions for r in result.replicas),
                max(r.kv_peak for r in result.replicas),
                fleet_mean_running(result),
                prompt_cached_pct(result.records),
                sum(r.policy_calls for r in result.replicas),
                # the replicas' own refusals (a one-engine run's `rejected`); the router's
                # are `refused`
                sum(r.counters.get("rejected", 0) for r in result.replicas),
            ),
            strict=True,
        )
    )
    per: list[dict[str, Any]] = []
    for i, (name, rep) in enumerate(zip(result.names, result.replicas, strict=True)):
        r = {"replica": i, "name": name, "up": i not in result.failed_replicas}
        r.update(summarize(rep.records, slo=slo))
        r.update(
            engine_steps=rep.engine_steps,
            preemptions=rep.preemptions,
            kv_peak_tokens=rep.kv_peak,
            mean_running=rep.mean_running,
            sim_time_s=rep.sim_time,
        )
        r["policy_calls"], r["rejected"] = rep.policy_calls, rep.counters.get("rejected", 0)
        per.append(r)
    return result, row, per
