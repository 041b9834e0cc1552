"""The simulated fleet: one replica is today's simulator, every request ends once,
runs repeat, failures re-route, the fleet queue waits."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np
import pytest

from duetime.core.router import FleetSnapshot, Refuse, Route, RouteDecision, Wait
from duetime.experiment import SimSpec, plan_spec
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.routers import available_routers, make_router
from duetime.sim import SimConfig, Simulator
from duetime.sim.fleet import Fleet, FleetResult, ReplicaSpec
from tests.factories import SIMPLE_COST, fresh_jobs, poisson_jobs


@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("fcfs", {}),
        ("edf", {"deadline_scale": 3.0}),
        ("sjf", {"predictor": "noisy"}),
        ("timelyllm", {"deadline_scale": 4.0, "rate": 12.0}),
        ("amin", {"deadline_scale": 4.0, "rate": 12.0}),
        ("deferred-prefill", {"rate": 12.0}),
        ("fcfs", {"prefix_cache": 20_000, "shared_prefix": 200, "prefix_groups": 3}),
    ],
)
def test_one_replica_round_robin_is_the_single_engine_simulator(policy: str, extra: dict) -> None:
    spec = SimSpec(policy=policy, requests=600, **{"rate": 4.0, **extra})
    single, fleet = plan_spec(spec), plan_spec(spec)
    want = Simulator(single.policy, single.cost, single.config, single.predictor).run(single.jobs)
    got = Fleet(
        [ReplicaSpec(fleet.cost, fleet.config)],
        lambda: make_policy(policy),
        make_router("round-robin"),
        predictor=fleet.predictor,
    ).run(fleet.jobs)
    assert got.records == want.records
    assert got.replicas[0].engine_steps == want.engine_steps
    assert got.replicas[0].preemptions == want.preemptions


def _fleet(n: int = 3, router: str = "lor", **kw: object) -> Fleet:
    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    specs = [ReplicaSpec(SIMPLE_COST, cfg, f"r{i}") for i in range(n)]
    # lengths known (the forecast router forecasts with them; without, max_tokens each)
    kw.setdefault("predictor", make_job_predictor("oracle"))
    return Fleet(specs, lambda: make_policy("fcfs"), make_router(router, seed=1), **kw)  # type: ignore[arg-type]


def _ended_once(res: FleetResult, n_jobs: int) -> None:
    """Every request has exactly one outcome: a record where it ended, or a refusal."""
    rids = [r.request.rid for r in res.records]
    assert sorted(rids) == list(range(n_jobs))
    for rec in res.records:
        rid = rec.request.rid
        if rid in res.refused:
            assert rec.finish is None
            assert rec.cancelled_at is not None
        else:
            assert rec.finish is not None
    c = res.counters
    assert c["routed"] + c["refused"] == n_jobs  # each arrival decided once
    assert sum(len(v) for v in res.routes.values()) == c["routed"] + c["rerouted"]


@pytest.mark.parametrize("router", available_routers())
def test_every_request_is_routed_once_or_refused_once(router: str) -> None:
    jobs = poisson_jobs(300, rate=40.0, seed=3, slo=3.0)
    res = _fleet(3, router).run(jobs)
    _ended_once(res, 300)
    assert res.counters["rerouted"] == 0
    assert all(len(v) == 1 for v in res.routes.values())


@pytest.mark.parametrize("router", ["round-robin", "lor", "forecast"])
def test_a_failed_replicas_requests_are_rerouted_or_failed_once(router: str) -> None:
    jobs = poisson_jobs(300, rate=60.0, seed=4, slo=4.0)
    res = _fleet(3, router, fail_at={1: 2.0}).run(jobs)
    _ended_once(res, 300)
    c = res.counters
    assert res.failed_replicas == [1]
    assert c["rerouted"] + c["failed"] > 0  # the replica held requests when it failed
    moved = [rid for rid, reps in res.routes.items() if len(reps) > 1]
    assert len(moved) == c["rerouted"]
    assert all(reps[0] == 1 and 1 not in reps[1:] for reps in (res.routes[r] for r in moved))
    # nothing finishes on replica 1 after it failed, nor is routed there
    late = [r for r in res.replicas[1].records if r.finish is not None and r.finish > 2.5]
    assert not late
    arrived_after = [j.request.rid for j in jobs if j.request.arrival > 2.0]
    assert all(res.routes.get(rid, [0])[0] != 1 for rid in arrived_after)


def test_a_failure_after_the_last_event_changes_nothing() -> None:
    """A failure past the run's end moved the clock there (sim time 1000 s, a replica's
    mean running batch 50 times lower) and listed a replica that served all its requests
    as down."""
    jobs = poisson_jobs(100, rate=40.0, seed=5)
    plain = _fleet(2, "lor").run(jobs)
    late = _fleet(2, "lor", fail_at={1: 1000.0}).run(fresh_jobs(jobs))
    assert late.sim_time == plain.sim_time < 1000.0
    assert late.records == plain.records
    assert late.failed_replicas == []


def test_every_replica_down_refuses_the_rest() -> None:
    jobs = poisson_jobs(100, rate=40.0, seed=5)
    res = _fleet(2, "lor", fail_at={0: 0.5, 1: 0.5}).run(jobs)
    _ended_once(res, 100)
    assert res.counters["refused"] > 0
    assert set(res.refused.values()) == {"every replica is down"}


@pytest.mark.parametrize("router", ["random", "power-of-two", "forecast"])
def test_the_same_seed_gives_the_same_records(router: str) -> None:
    jobs = poisson_jobs(300, rate=40.0, seed=6, slo=3.0)
    a = _fleet(4, router, fail_at={2: 1.5}).run(jobs)
    b = _fleet(4, router, fail_at={2: 1.5}).run(fresh_jobs(jobs))
    assert [(r.request.rid, r.finish, r.cancelled_at) for r in a.records] == [
        (r.request.rid, r.finish, r.cancelled_at) for r in b.records
    ]
    assert a.routes == b.routes
    assert a.counters == b.counters


class CapOfFour:
    """Waits in the fleet queue (shortest prompt first) while every replica holds 4."""

    name = "cap-4"

    def __init__(self) -> None:
        self.most = 0  # the most requests a replica held when the router looked

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        load = snap.running + snap.waiting
        self.most = max(self.most, int(load.max()))
        i = int(load.argmin())
        if load[i] >= 4:
            return Wait(float(snap.request.prompt_len))
        return Route(i)


def test_the_fleet_queue_holds_requests_until_a_replica_has_room() -> None:
    jobs = poisson_jobs(200, rate=200.0, seed=7)
    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    router = CapOfFour()
    fleet = Fleet(
        [ReplicaSpec(SIMPLE_COST, cfg) for _ in range(2)], lambda: make_policy("fcfs"), router
    )
    res = fleet.run(jobs)
    _ended_once(res, 200)
    assert res.counters["waited"] > 0
    assert not res.refused
    assert all(rep.records for rep in res.replicas)
    assert router.most == 4  # the cap held: never a fifth on a replica


def test_a_router_that_names_a_down_replica_is_an_error() -> None:
    class Zero:
        name = "zero"

        def route(self, snap: FleetSnapshot) -> RouteDecision:
            return Route(0)

    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    fleet = Fleet(
        [ReplicaSpec(SIMPLE_COST, cfg) for _ in range(2)],
        lambda: make_policy("fcfs"),
        Zero(),
        fail_at={0: 0.1},
    )
    with pytest.raises(RuntimeError, match="replica 0, which is down"):
        fleet.run(poisson_jobs(50, rate=40.0, seed=8))


@pytest.mark.parametrize(
    ("replica", "words"),
    [
        (2, "chose replica 2, and the fleet has 0..1"),
        (-1, "chose replica -1, and the fleet has 0..1"),
        (1.0, "chose replica 1.0: a Route takes a replica's index, an int"),
        (True, "chose replica True: a Route takes a replica's index"),
    ],
)
def test_a_route_to_no_replica_of_the_fleet_says_so(replica: Any, words: str) -> None:
    # 2 was "which is down", 1.0 a raw TypeError from indexing the replicas
    class Off:
        name = "off"

        def route(self, snap: FleetSnapshot) -> RouteDecision:
            return Route(replica)

    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    fleet = Fleet(
        [ReplicaSpec(SIMPLE_COST, cfg) for _ in range(2)], lambda: make_policy("fcfs"), Off()
    )
    with pytest.raises(RuntimeError, match=re.escape(words)):
        fleet.run(poisson_jobs(5, rate=40.0, seed=8))


def test_a_numpy_integer_route_is_a_replica() -> None:
    class Argmin:
        name = "argmin"

        def route(self, snap: FleetSnapshot) -> RouteDecision:
            return Route(np.argmin(snap.running))  # type: ignore[arg-type]

    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    fleet = Fleet(
        [ReplicaSpec(SIMPLE_COST, cfg) for _ in range(2)], lambda: make_policy("fcfs"), Argmin()
    )
    res = fleet.run(poisson_jobs(20, rate=40.0, seed=8))
    assert all(rep.records for rep in res.replicas)


def test_refusals_carry_the_routers_reason() -> None:
    class No:
        name = "no"

        def route(self, snap: FleetSnapshot) -> RouteDecision:
            return Refuse("closed", retry_after_s=3.0)

    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    res = Fleet([ReplicaSpec(SIMPLE_COST, cfg)], lambda: make_policy("fcfs"), No()).run(
        poisson_jobs(20, rate=10.0, seed=9)
    )
    assert Counter(res.refused.values()) == {"closed": 20}
    assert all(r.cancelled_at == r.request.arrival for r in res.records)


def test_bad_fleet_input_is_named() -> None:
    with pytest.raises(ValueError, match="replica 5"):
        _fleet(2, fail_at={5: 1.0})
    with pytest.raises(ValueError, match="at least one replica"):
        Fleet([], lambda: make_policy("fcfs"), make_router("lor"))
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        make_router("nope")
