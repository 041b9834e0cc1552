"""`duetime bench fleet-real`: one trace through a real fleet and through the simulated one.

The real fleet is ``replicas`` `duetime serve` processes (``threads_per_replica``
threads each, their batch limits given so no start-up sizing runs, prefix cache
off so that each router's run meets cold backends) behind a `duetime gateway`
process, started again for each router. The simulated fleet is `duetime sim
--replicas N --router X`'s (:class:`~duetime.sim.fleet.Fleet`), each replica
priced by the cost model its real backend publishes at ``GET /v1/profile``, with
that backend's limits.

The order of a run, and why:

1. Start the backends; a short warm-up burst straight to each (mixed prompt and
   answer lengths, so the batch shrinks step by step) gives each the steps its
   online fit needs; read every backend's profile (the *warm-up profiles*).
2. Build the trace with `duetime load`'s workload code (:mod:`..server.load_workload`)
   and count each prompt's tokens with the backend's own ``/tokenize``: the
   simulator must price the prompts the engine prefills, not a word count.
3. Rate (unless given): ``load`` × the fleet's capacity, the sum over replicas of
   each one's saturated throughput on this trace under its warm-up profile
   (:func:`duetime.bench.fleet.capacity_req_s`). Deadlines (unless given): the
   classes of `duetime bench fleet` with their multiples of a mean request's time
   alone on the slowest replica.
4. For each router: the gateway, the trace sent through it open loop (every
   request asks for exactly its ``max_tokens``: ``ignore_eos``), the gateway
   ended; then the profiles read again (fitted to that run's own steps) and the
   same trace simulated twice: with those (``sim``) and with the warm-up ones
   (``sim_warmup``: what the backends published before any of this load).

Backends the run does not start (``external``: vLLM, say) join the fleet with the
profile `duetime profile --url` fitted for them, given to the gateway
(``--profile URL=path``) and to their simulated replica; they get no warm-up.

The gateway holds no request (``--max-inflight`` ≥ the trace) and the backends'
queues take the whole trace, as a simulated replica queues every request routed
to it. What the simulated replicas do not run is the server's admission: a
request a real backend refuses (429) is a miss on the real side and runs on the
simulated one.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from duetime.bench.fleet import CLASSES, capacity_req_s
from duetime.bench.fleet_real_compare import compare, routed_alike, run_row
from duetime.bench.fleet_real_live import (
    WARMUP_ROUNDS,
    FleetRealConfig,
    check_external,
    profiles,
    prompt_tokens,
    real_run,
    served_model,
    specs_of,
    start_backends,
    warm_up,
)
from duetime.bench.fleet_real_procs import FleetStartError, LocalProcesses
from duetime.core.request import Job, Request
from duetime.policies import make_policy
from duetime.routers import make_router
from duetime.server.load_workload import LoadRequest
from duetime.sim.fleet import Fleet, ReplicaSpec

__all__ = ["FleetRealConfig", "Progress", "run_fleet_real"]

#: ``progress(stage, done, total)``: a stage's label and how far it is.
Progress = Callable[[str, int, int], None]

#: One simulated run: its row, its records, each request's replica.
_Sim = tuple[dict[str, Any], list[Any], dict[int, int]]


# --- the trace as the simulator takes it -------------------------------------------------
def _jobs(plan: Sequence[LoadRequest], tokens: Mapping[str, int], max_len: int) -> list[Job]:
    """The trace's requests with their real prompt tokens; each answer is its max_tokens.

    A request longer than the served model takes (``max_len``) is an error here: the
    backends would refuse it with a 400, and the comparison would be of nothing.
    """
    jobs = []
    for lr in plan:
        if tokens[lr.prompt] + lr.max_tokens > max_len:
            raise ValueError(
                f"request {lr.rid}: {tokens[lr.prompt]} prompt tokens + {lr.max_tokens} answer "
                f"tokens exceed the served model's max_model_len {max_len}: shorten "
                "--prompt-len / --output-len (or --max-context for ShareGPT)"
            )
        deadline = None if lr.deadline_s is None else lr.arrival + lr.deadline_s
        req = Request(
            rid=lr.rid,
            arrival=lr.arrival,
            prompt_len=tokens[lr.prompt],
            max_tokens=lr.max_tokens,
            deadline=deadline,
            priority=lr.priority or 0,
            klass=lr.klass,
        )
        jobs.append(Job(req, output_len=lr.max_tokens))
    return jobs


def _mix(cfg: FleetRealConfig) -> dict[str, float]:
    """``--class-mix``, or `bench fleet`'s three classes: also where only ``--deadline``
    is given (``--deadline interactive=1`` alone was refused: no request had a class),
    unless those deadlines name only the one class a mix-less trace has."""
    from duetime.server.load_workload import DEFAULT_CLASS

    if cfg.class_mix or (cfg.deadlines and set(cfg.deadlines) <= {DEFAULT_CLASS}):
        return cfg.class_mix
    return {name: share for name, share, _ in CLASSES}


def _default_deadlines(
    cfg: FleetRealConfig, specs: Sequence[ReplicaSpec], jobs: Sequence[Job]
) -> tuple[dict[str, float], dict[str, float]]:
    """The class mix and per-class deadlines: `bench fleet`'s classes (or those of
    ``--class-mix``) at their multiples of a mean request's time alone on the slowest
    replica."""
    prompt = statistics.fmean(j.request.prompt_len for j in jobs)
    output = statistics.fmean(j.output_len for j in jobs)
    alone = max(s.cost.alone_time(max(1, round(prompt)), round(output)) for s in specs)
    mix = _mix(cfg)
    factor = {name: x for name, _, x in CLASSES}
    # to the ms, and at least 1 ms: a deadline sent as 0 ms is a 400, not a miss
    return mix, {name: max(0.001, round(factor[name] * alone, 3)) for name in mix}


def _simulate(
    cfg: FleetRealConfig, specs: Sequence[ReplicaSpec], router: str, jobs: Sequence[Job]
) -> _Sim:
    """The trace through the simulated fleet: its row, its records, each request's replica."""
    fresh = [Job(replace(j.request), j.output_len) for j in jobs]
    fleet = Fleet(specs, lambda: make_policy(cfg.policy), make_router(router, seed=cfg.seed))
    res = fleet.run(fresh)
    row = run_row(res.records, res.counters["refused"])
    return row, res.records, res.routes.last_replicas()


# --- the whole run -----------------------------------------------------------------------
def run_fleet_real(cfg: FleetRealConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Start the fleet, run every router real and simulated, end every process."""
    cfg.check()
    step = _stepper(progress)
    # the trace's shapes before any process starts (a class --deadline names that no
    # request has is refused here); lengths and classes do not depend on the rate
    shapes = cfg.trace(class_mix=_mix(cfg), deadlines=cfg.deadlines).build(1.0)
    with (
        tempfile.TemporaryDirectory(prefix="duetime-fleet-real-") as d,
        LocalProcesses(Path(d)) as procs,
        httpx.Client(timeout=30.0, trust_env=False) as client,
    ):
        tmp = Path(d)
        given = cfg.external_profiles()
        own = _start_own(cfg, procs, step)
        model, max_len = served_model(client, own[0])
        tokens = prompt_tokens(client, own[0], [lr.prompt for lr in shapes])
        shape_jobs = _jobs(shapes, tokens, max_len)  # a prompt too long: refused before warm-up
        longest = max(j.request.prompt_len + j.output_len for j in shape_jobs)
        check_external(client, list(given), model, longest)
        urls = own + list(given)
        warm = _warm_profiles(cfg, client, own, urls, tmp, given, model, step)
        warm_specs = specs_of(urls, tmp, "warmup")
        trace = _trace(cfg, client, own[0], warm_specs, shape_jobs, tokens, max_len)
        runs = []
        for k, router in enumerate(cfg.routers):
            stage = f"{router}: real ({k + 1}/{len(cfg.routers)})"
            real = real_run(cfg, procs, urls, router, model, trace.plan, partial(step, stage))
            after = profiles(client, urls, tmp, f"{router}-after", given)
            after_specs = specs_of(urls, tmp, f"{router}-after") if after else warm_specs
            step(f"{router}: simulated", 0, 1)
            sim = _simulate(cfg, after_specs, router, trace.jobs)
            sim_warm = _simulate(cfg, warm_specs, router, trace.jobs)
            step(f"{router}: simulated", 1, 1)
            runs.append(_router_entry(router, real, after, sim, sim_warm))
    return _report(cfg, model, urls, given, trace, warm, runs)


# --- its phases --------------------------------------------------------------------------
def _stepper(progress: Progress | None) -> Progress:
    """A step to call at every stage whether or not the caller asked for progress."""

    def step(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    return step


def _start_own(cfg: FleetRealConfig, procs: LocalProcesses, step: Progress) -> list[str]:
    """Start the backends this run owns (the slow part of a start); their URLs."""
    step("starting backends", 0, 1)
    own = [b.url for b in start_backends(cfg, procs)]
    step("starting backends", 1, 1)
    return own


def _warm_profiles(
    cfg: FleetRealConfig,
    client: httpx.Client,
    own: Sequence[str],
    urls: Sequence[str],
    tmp: Path,
    given: Mapping[str, dict[str, Any]],
    model: str,
    step: Progress,
) -> list[dict[str, Any]]:
    """Warm-up bursts to the backends this run owns until every backend publishes a cost
    model (its online fit needs steps first): the warm-up profiles, also written to
    ``tmp``. A backend still without one after the last burst ends the run."""
    for round_ in range(WARMUP_ROUNDS):
        step("warm-up", round_, WARMUP_ROUNDS)
        warm_up(cfg, own, model, round_)
        warm = profiles(client, urls, tmp, "warmup", given)
        if warm is not None:
            step("warm-up", WARMUP_ROUNDS, WARMUP_ROUNDS)
            return warm
    raise FleetStartError(
        f"a backend of {', '.join(own)} published no cost model at /v1/profile "
        f"after {WARMUP_ROUNDS} warm-up bursts"
    )


@dataclass(frozen=True, slots=True)
class _Trace:
    """The trace every router runs, with the rate and classes it was built with."""

    capacity: float  # requests/s the fleet takes, under the warm-up profiles
    rate: float
    mix: dict[str, float]
    deadlines: dict[str, float]
    plan: list[LoadRequest]
    jobs: list[Job]  # the plan as the simulator takes it


def _trace(
    cfg: FleetRealConfig,
    client: httpx.Client,
    url: str,
    warm_specs: Sequence[ReplicaSpec],
    shape_jobs: Sequence[Job],
    tokens: Mapping[str, int],
    max_len: int,
) -> _Trace:
    """The trace at its rate: ``--rate``, or ``--load`` × the fleet's capacity; its
    deadlines those given, or `bench fleet`'s. Both are priced by the warm-up profiles on
    the trace's shapes, and every prompt is counted by the backend at ``url``."""
    capacity = sum(capacity_req_s(s, shape_jobs) for s in warm_specs)
    rate = cfg.rate if cfg.rate is not None else cfg.load * capacity
    mix, deadlines = _mix(cfg), cfg.deadlines
    if not deadlines:
        mix, deadlines = _default_deadlines(cfg, warm_specs, shape_jobs)
    plan = cfg.trace(class_mix=mix, deadlines=deadlines).build(rate)
    counted = {**tokens, **prompt_tokens(client, url, [lr.prompt for lr in plan])}
    return _Trace(capacity, rate, mix, deadlines, plan, _jobs(plan, counted, max_len))


def _router_entry(
    router: str, real: Mapping[str, Any], after: list[dict[str, Any]] | None, sim: _Sim, warm: _Sim
) -> dict[str, Any]:
    """One router's entry: the real run beside both simulations and how close each came,
    with every request finished on both sides paired with the replica each sent it to."""
    sim_row, sim_records, sim_routes = sim
    warm_row, warm_records, warm_routes = warm
    figures, pairs = compare(real["records"], sim_records)
    figures["routed_alike"] = routed_alike(real["routes"], sim_routes)
    for pair in pairs:
        pair["real_replica"] = real["routes"].get(pair["rid"])
        pair["sim_replica"] = sim_routes.get(pair["rid"])
    warm_figures = compare(real["records"], warm_records)[0]
    warm_figures["routed_alike"] = routed_alike(real["routes"], warm_routes)
    return {
        "router": router,
        "real": real["row"],
        "sim": sim_row,
        "sim_warmup": warm_row,
        "compare": figures,
        "compare_warmup": warm_figures,
        "profiles_after": after,
        "pairs": pairs,
        # each request's replica (index into "backends"), also those refused
        # by a backend (its 429 names it); the gateway's own refusals have none
        "routes": {"real": real["routes"], "sim": sim_routes},
    }


def _report(
    cfg: FleetRealConfig,
    model: str,
    urls: Sequence[str],
    given: Mapping[str, dict[str, Any]],
    trace: _Trace,
    warm: list[dict[str, Any]],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's JSON: the fleet, the trace and how its rate was chosen, every router's."""
    return {
        "model": model,
        "replicas": len(urls),
        "external": list(given),
        "threads_per_replica": cfg.threads_per_replica,
        "policy": cfg.policy,
        "max_num_seqs": cfg.max_num_seqs,
        "max_batch_tokens": cfg.max_batch_tokens,
        "workload": cfg.workload,
        "requests": len(trace.plan),
        "seed": cfg.seed,
        "backends": urls,
        "capacity_req_s": trace.capacity,
        "rate_req_s": trace.rate,
        "rate_chosen": cfg.rate is None,
        "load": cfg.load if cfg.rate is None else None,
        "class_mix": trace.mix,
        "deadlines_s": trace.deadlines,
        "prompt_tokens_mean": statistics.fmean(j.request.prompt_len for j in trace.jobs),
        "output_tokens_mean": statistics.fmean(j.output_len for j in trace.jobs),
        "profiles_warmup": warm,
        "runs": runs,
    }
