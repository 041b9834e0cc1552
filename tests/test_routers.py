"""Each router's rule on a hand-built fleet snapshot."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from duetime.core.request import Request
from duetime.core.router import FleetSnapshot, Refuse, Route, Router
from duetime.routers import available_routers, make_router


def snap(
    running: list[int],
    waiting: list[int],
    *,
    kv_used: list[int] | None = None,
    kv_capacity: list[int] | None = None,
    up: list[bool] | None = None,
    hits: list[int] | None = None,
    ends: list[float | None] | None = None,
    deadline: float | None = None,
    now: float = 10.0,
    asked: list[int] | None = None,
) -> FleetSnapshot:
    """A fleet of ``len(running)`` replicas; ``asked`` collects the replicas forecast."""
    n = len(running)
    asked = [] if asked is None else asked

    def forecast(i: int) -> float | None:
        asked.append(i)
        return None if ends is None else ends[i]

    return FleetSnapshot(
        now=now,
        request=Request(rid=1, arrival=now, prompt_len=100, deadline=deadline),
        up=np.array(up or [True] * n),
        running=np.array(running, dtype=np.int64),
        waiting=np.array(waiting, dtype=np.int64),
        kv_used=np.array(kv_used or [0] * n, dtype=np.int64),
        kv_capacity=np.array(kv_capacity or [1000] * n, dtype=np.int64),
        prefix_lookup=lambda i: 0 if hits is None else hits[i],
        forecast_of=forecast,
    )


def pick(router: Router, s: FleetSnapshot) -> int:
    dec = router.route(s)
    assert isinstance(dec, Route)
    return dec.replica


def test_every_router_satisfies_the_protocol_and_avoids_down_replicas() -> None:
    for name in available_routers():
        router = make_router(name, seed=0)
        assert isinstance(router, Router)
        assert router.name == name
        for _ in range(20):
            s = snap([0, 5, 0], [0, 0, 0], up=[False, True, False], ends=[1.0, 11.0, 1.0])
            assert pick(router, s) == 1


def test_round_robin_cycles_and_skips_down_replicas() -> None:
    rr = make_router("round-robin")
    assert [pick(rr, snap([9, 0, 0], [0, 0, 0])) for _ in range(4)] == [0, 1, 2, 0]
    down = snap([0, 0, 0], [0, 0, 0], up=[True, False, True])
    assert [pick(rr, down) for _ in range(3)] == [2, 0, 2]


def test_random_is_uniform_over_up_replicas_and_seeded() -> None:
    s = snap([0] * 4, [0] * 4, up=[True, True, False, True])
    picks = [pick(make_router("random", seed=3), s) for _ in range(1)]
    r = make_router("random", seed=3)
    many = Counter(pick(r, s) for _ in range(3000))
    assert set(many) == {0, 1, 3}
    assert min(many.values()) > 900
    assert picks[0] == pick(make_router("random", seed=3), s)


def test_lor_takes_fewest_running_plus_waiting() -> None:
    lor = make_router("lor")
    assert pick(lor, snap([3, 1, 2], [0, 4, 0])) == 2  # 3, 5, 2
    assert pick(lor, snap([2, 2, 1], [0, 0, 1])) == 0  # tie: lowest index


def test_least_kv_takes_the_smallest_fraction_of_kv_used() -> None:
    r = make_router("least-kv")
    # 500/1000 = 0.5, 300/400 = 0.75, 800/2000 = 0.4
    s = snap([0, 0, 0], [0, 0, 0], kv_used=[500, 300, 800], kv_capacity=[1000, 400, 2000])
    assert pick(r, s) == 2
    assert pick(r, snap([3, 1, 2], [0, 0, 0])) == 1  # all empty: fewest outstanding


def test_shortest_queue_reads_the_waiting_queue_first() -> None:
    r = make_router("shortest-queue")
    assert pick(r, snap([1, 9, 5], [3, 0, 0])) == 2  # 0 waiting at 1 and 2: fewer running
    assert pick(r, snap([0, 9], [1, 0])) == 1  # LOR would take replica 0


def test_prefix_affinity_follows_the_cache_within_the_load_cap() -> None:
    r = make_router("prefix-affinity", cap=2)
    assert pick(r, snap([1, 2, 1], [0, 0, 0], hits=[0, 64, 16])) == 1
    # replica 1 caches more but holds 1 + 2 over the least: past the cap
    assert pick(r, snap([1, 4, 1], [0, 0, 0], hits=[0, 64, 16])) == 2
    assert pick(r, snap([2, 1, 1], [0, 0, 0], hits=[0, 0, 0])) == 1  # no hit: least load
    with pytest.raises(ValueError, match="cap"):
        make_router("prefix-affinity", cap=-1)


def test_power_of_two_takes_the_lighter_of_two_draws() -> None:
    r = make_router("power-of-two", seed=0)
    s = snap([5, 0, 9, 9], [0, 0, 0, 0])
    picks = Counter(pick(r, s) for _ in range(2000))
    # the heaviest of any pair is never chosen unless paired with an equal one
    assert picks[1] > 0
    assert picks[0] > 0
    assert picks[1] == pytest.approx(1000, rel=0.1)  # replica 1 wins each pair it is in: 1/2
    assert picks[0] == pytest.approx(2000 / 3, rel=0.15)  # 0 wins with 2 or 3: 1/3
    lone = snap([5, 0], [0, 0], up=[True, False])
    assert pick(r, lone) == 0


def test_forecast_router_takes_the_largest_slack_and_refuses_when_none_meets() -> None:
    r = make_router("forecast")
    asked: list[int] = []
    s = snap([1, 1, 1], [0, 0, 0], ends=[14.0, 12.5, 13.0], deadline=15.0, asked=asked)
    assert pick(r, s) == 1
    assert sorted(asked) == [0, 1, 2]
    late = r.route(snap([1, 1], [0, 0], ends=[17.0, 16.0], deadline=15.0))
    assert isinstance(late, Refuse)
    assert late.retry_after_s == pytest.approx(1.0)
    assert "1.00 s late" in late.reason
    slightly = r.route(snap([1, 1], [0, 0], ends=[15.004, 16.0], deadline=15.0))
    assert isinstance(slightly, Refuse)
    assert "the best forecast is 4 ms late" in slightly.reason  # was "0.00 s late"
    gone = r.route(snap([1, 1], [0, 0], ends=[None, None], deadline=15.0))
    assert isinstance(gone, Refuse)
    assert "horizon" in gone.reason
    # no deadline: earliest finish, never a refusal
    assert pick(r, snap([1, 1], [0, 0], ends=[30.0, 20.0])) == 1
    assert pick(r, snap([4, 1], [0, 0], ends=[None, None])) == 1
    # down replicas are not forecast
    asked = []
    s = snap([1, 1], [0, 0], ends=[1.0, 12.0], up=[False, True], deadline=15.0, asked=asked)
    assert pick(r, s) == 1
    assert asked == [1]
