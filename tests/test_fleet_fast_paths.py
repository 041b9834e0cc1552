"""The parts of the fleet and the executor core that exist for speed: the figures a
router sees are those of the moment it is asked, one snapshot object per executor
shows the current state, the route log reads as ``rid → replicas``, the collector
pause restores what it found, and LOR's shortcut picks what the full rule picks."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from duetime.core.request import Request
from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.routers.least_outstanding import least
from duetime.sim import SimConfig, Simulator
from duetime.sim.fleet import Fleet, ReplicaSpec
from duetime.sim.fleet_routes import RouteLog
from duetime.sim.gc_pause import gc_paused
from tests.factories import SIMPLE_COST, poisson_jobs


class Inspector:
    """LOR that, at each question, checks the snapshot against the replicas' live state
    (a test may look behind the snapshot; a router never does)."""

    name = "inspector"

    def __init__(self) -> None:
        self.fleet: Fleet | None = None
        self.asked = 0

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        fleet = self.fleet
        assert fleet is not None
        for i, rep in enumerate(fleet.replicas):
            sim = rep.sim
            if rep.up:
                running = len(sim.running)
                waiting = len(sim.waiting) + len(sim.suspended) + len(rep.inbox)
                assert snap.running[i] == running
                assert snap.waiting[i] == waiting
                assert snap.kv_used[i] == sim.kv_used
                assert snap.outstanding[i] == running + waiting
            else:
                assert snap.outstanding[i] == snap.running[i] == snap.kv_used[i] == 0
        assert snap.now == fleet.now
        self.asked += 1
        return Route(least(snap.outstanding, snap.up))


@pytest.mark.parametrize("fail_at", [{}, {1: 1.5}])
def test_a_router_sees_every_replica_as_it_is_when_asked(fail_at: dict[int, float]) -> None:
    cfg = SimConfig(kv_capacity=4000, max_num_seqs=16)
    specs = [ReplicaSpec(SIMPLE_COST, cfg, f"r{i}") for i in range(3)]
    router = Inspector()
    fleet = Fleet(
        specs,
        lambda: make_policy("fcfs"),
        router,
        predictor=make_job_predictor("oracle"),
        fail_at=fail_at,
    )
    router.fleet = fleet
    res = fleet.run(poisson_jobs(300, rate=60.0, seed=4))
    assert router.asked == res.router_calls > 300 - 1
    assert res.counters["rerouted"] + res.counters["failed"] > 0 or not fail_at


def test_the_executor_hands_one_snapshot_showing_the_current_state() -> None:
    sim = Simulator(make_policy("fcfs"), SIMPLE_COST, SimConfig(kv_capacity=4000))
    first = sim.snapshot()
    for job in poisson_jobs(5, rate=10.0, seed=1):
        sim.admit_arrival(job)
    sim.now = 2.5
    sim._static_kv = 100  # (a holder's KV, as the books would have it)
    snap = sim.snapshot()
    assert snap is first
    assert snap.now == 2.5
    assert snap.kv_free == 4000 - 100 == sim.kv_capacity - sim.kv_used
    assert [s.rid for s in snap.waiting] == [s.rid for s in sim.waiting]
    assert snap.num_decoding == sim._n_dec


def test_the_route_log_reads_as_the_replicas_each_request_went_to() -> None:
    log = RouteLog()
    log.first(7, 2)
    log.first(3, 0)
    log.again(7, 1)
    log.again(7, 0)
    assert dict(log) == {7: [2, 1, 0], 3: [0]}
    assert (log.last(7), log.last(3), log.last(9)) == (0, 0, None)
    assert log.last_replicas() == {7: 0, 3: 0}
    assert len(log) == 2
    assert 9 not in log
    assert log.get(9) is None
    other = RouteLog()
    other.first(3, 0)
    assert other != log
    other.first(7, 2)
    other.again(7, 1)
    other.again(7, 0)
    assert other == log


def test_the_collector_pause_restores_what_it_found() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner pause found it off: leaves it off
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: off after
        gc.enable()
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("seed", range(20))
def test_lor_shortcut_picks_the_first_least_loaded_up_replica(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 4, size=8).astype(np.int64)
    up = rng.random(8) < 0.6
    up[rng.integers(8)] = True
    want = min((int(values[i]), i) for i in range(8) if up[i])[1]
    assert least(values, up) == want


def test_outstanding_is_running_plus_waiting_kept_or_not() -> None:
    snap = lambda kept: FleetSnapshot(  # noqa: E731
        now=0.0,
        request=Request(rid=1, arrival=0.0, prompt_len=10),
        up=np.array([True, True]),
        running=np.array([3, 1], dtype=np.int64),
        waiting=np.array([0, 4], dtype=np.int64),
        kv_used=np.array([0, 0], dtype=np.int64),
        kv_capacity=np.array([10, 10], dtype=np.int64),
        prefix_lookup=lambda i: 0,
        forecast_of=lambda i: None,
        kept_outstanding=kept,
    )
    assert snap(None).outstanding.tolist() == [3, 5]
    kept = np.array([3, 5], dtype=np.int64)
    assert snap(kept).outstanding is kept
