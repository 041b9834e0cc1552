"""The load a forecast expects beside a request that arrives in a burst
(``server/recent_load.py``): its burst's companions, and later bursts like the recent."""

from __future__ import annotations

import pytest

from duetime.core.request import Job, Request
from duetime.server.recent_load import RecentLoad


def _note(load: RecentLoad, rid: int, at: float, prompt: int = 100, answer: int = 10) -> None:
    load.note(Job(Request(rid=rid, arrival=at, prompt_len=prompt), output_len=answer), answer)


def _fleet(load: RecentLoad, rounds: int, size: int = 6, period: float = 2.0) -> None:
    """``rounds`` bursts of ``size`` commands, ``period`` s apart, 3 ms between commands;
    command ``i`` of a burst has a prompt of ``100 + i``."""
    for r in range(rounds):
        for i in range(size):
            _note(load, 100 * r + i, r * period + 0.003 * i, prompt=100 + i)


def _at(jobs: list[Job], t: float) -> list[Job]:
    return [j for j in jobs if j.request.arrival == t]


def test_the_first_of_a_burst_expects_the_rest_and_later_bursts_at_their_period() -> None:
    load = RecentLoad(window_s=60.0)
    _fleet(load, rounds=3)
    future = load.future(6.0, 9.5)
    companions = _at(future, 6.0)
    assert [j.request.prompt_len for j in companions] == [101, 102, 103, 104, 105]
    assert [len(_at(future, t)) for t in (8.0, 10.0)] == [6, 0]  # one burst every 2 s
    assert len(future) == 11
    assert [j.request.rid for j in future] == list(range(-1, -12, -1))


def test_a_burst_half_judged_expects_only_what_it_still_lacks() -> None:
    load = RecentLoad(window_s=60.0)
    _fleet(load, rounds=3)
    for i in range(3):  # three of the fourth burst accepted
        _note(load, 300 + i, 6.0 + 0.003 * i, prompt=100 + i)
    companions = _at(load.future(6.01, 7.0), 6.01)
    assert [j.request.prompt_len for j in companions] == [104, 105]
    # two more on their way through the server: nothing beyond them is expected
    assert len(_at(load.future(6.01, 7.0, arriving=2), 6.01)) == 2
    # (a request of three sequences completes it)
    assert _at(load.future(6.01, 7.0, joining=3), 6.01) == []


def test_a_burst_expects_only_the_companions_such_bursts_had_accepted() -> None:
    """Under a deadline only two of six can meet, the fleet's bursts had their first
    two accepted: the first of a new one expects one companion, not five, the second
    none; and it is not refused for load that would itself be refused."""
    load = RecentLoad(window_s=60.0)
    for r in range(3):
        for i in range(6):
            job = Job(Request(rid=10 * r + i, arrival=2.0 * r + 0.003 * i, prompt_len=100 + i), 10)
            if i < 2:
                load.note(job, 10)
            else:
                load.refused(job)
    first = load.future(6.0, 7.0, arriving=5)
    assert [j.request.prompt_len for j in _at(first, 6.0)] == [101]
    _note(load, 30, 6.0, prompt=100)
    assert _at(load.future(6.003, 7.0, arriving=4), 6.003) == []
    # bursts replayed later bring their accepted members only
    later = load.future(6.003, 8.5)
    assert [j.request.prompt_len for j in later if j.request.arrival == 8.0] == [100, 101]


def test_what_is_on_its_way_picks_the_bursts_to_go_by() -> None:
    """Bursts of six and of three seen (all accepted): a first member that knows four
    more are on their way expects five companions, as the bursts of six had; not
    knowing, the mean of both (3.5, rounded up)."""
    load = RecentLoad(window_s=60.0)
    for r, size in enumerate((6, 3, 6, 3)):
        for i in range(size):
            _note(load, 10 * r + i, 2.0 * r + 0.003 * i)
    assert len(_at(load.future(8.0, 8.5, arriving=4), 8.0)) == 5
    assert len(_at(load.future(8.0, 8.5), 8.0)) == 4
    # a burst larger than any seen: those on its way, shaped like the request itself
    like = Job(Request(rid=99, arrival=8.0, prompt_len=7), output_len=3)
    assert [
        j.request.prompt_len for j in _at(load.future(8.0, 8.5, arriving=7, like=like), 8.0)
    ] == [7] * 7


def test_one_burst_is_a_coincidence_two_a_pattern() -> None:
    """A client that sends its next request as soon as the last was refused makes a
    "burst" of two, the second accepted. Once, that is no reason to expect a companion
    beside a later lone request (a forecast of 4 s of another prompt's prefill refused
    such a request in the server's end-to-end tests, now and then); twice, it is."""
    load = RecentLoad(window_s=60.0)

    def pair(t: float, rid: int) -> None:
        load.refused(Job(Request(rid=rid, arrival=t, prompt_len=400), output_len=4))
        _note(load, rid + 1, t + 0.01, prompt=400)

    pair(0.0, 0)
    assert _at(load.future(1.0, 2.0), 1.0) == []
    pair(1.0, 2)
    assert [j.request.prompt_len for j in _at(load.future(2.0, 2.5), 2.0)] == [400]


def test_requests_on_their_way_are_expected_even_before_any_burst_was_seen() -> None:
    load = RecentLoad()
    like = Job(Request(rid=7, arrival=0.0, prompt_len=321), output_len=12, ride_rows=4)
    future = load.future(0.0, 5.0, arriving=2, like=like)
    assert [(j.request.prompt_len, j.output_len, j.ride_rows) for j in future] == [
        (321, 12, 4),
        (321, 12, 4),
    ]
    assert load.future(0.0, 5.0, arriving=2) == []  # nothing to shape them by


def test_lone_arrivals_make_the_even_stream_and_no_companions() -> None:
    bursty, even = RecentLoad(window_s=10.0), RecentLoad(window_s=10.0, burst_gap_s=0.0)
    for load in (bursty, even):
        for k in range(8):
            _note(load, k, 0.5 * k, prompt=100 + k)
    a, b = bursty.future(4.0, 7.0), even.future(4.0, 7.0)
    assert [(j.request.arrival, j.request.prompt_len) for j in a] == [
        (j.request.arrival, j.request.prompt_len) for j in b
    ]
    assert [j.request.arrival for j in a] == pytest.approx([4.5, 5.0, 5.5, 6.0, 6.5])


def test_no_bursts_when_switched_off() -> None:
    load = RecentLoad(window_s=60.0, burst_gap_s=0.0)
    _fleet(load, rounds=3)
    like = Job(Request(rid=7, arrival=6.0, prompt_len=321), output_len=12)
    future = load.future(6.0, 6.5, arriving=3, like=like)
    assert _at(future, 6.0) == []
    # 18 alone in 6 s: one every 1/3 s, not six every 2 s
    assert [j.request.arrival for j in future] == pytest.approx([6 + 1 / 3])


def test_chance_pairs_of_a_poisson_stream_expect_no_companion() -> None:
    import numpy as np

    load = RecentLoad(window_s=60.0)
    times = np.cumsum(np.random.default_rng(0).exponential(1 / 3.0, size=150))
    for k, t in enumerate(times):
        _note(load, k, float(t))
    now = float(times[-1]) + 0.01  # right behind the last: joins its burst
    assert _at(load.future(now, now + 1.0), now) == []
    assert _at(load.future(now + 1.0, now + 2.0), now + 1.0) == []


def test_a_bad_gap_is_refused() -> None:
    with pytest.raises(ValueError, match="burst_gap_s must be >= 0"):
        RecentLoad(burst_gap_s=-1.0)


def test_admission_forecasts_a_burst_with_its_companions() -> None:
    """Steps of 20 ms + 10 ms a decoder: the first of six robot commands is forecast
    at its time in a batch of six (those on their way and those its burst lacks), not
    alone, and a refusal names them."""
    from duetime.core.cost import LinearStepCost
    from duetime.core.request import LengthPrediction
    from duetime.policies.registry import make_policy
    from duetime.server.admission import Admission
    from duetime.server.engine_loop import EngineStats
    from duetime.server.step_timer import StepTimer
    from duetime.sim.simulator import SimConfig, Simulator

    cost = LinearStepCost.batch(c=0.02, a=0.0, b=0.01, d=0.0)
    sim = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=8))
    sim.run([Job(Request(rid=1, arrival=50.0, prompt_len=8, max_tokens=1), output_len=1)])
    image = sim.image()  # idle, at 50 s and a step
    assert not image.seqs
    stats = EngineStats(now=image.now, running=0, kv_used=0, kv_capacity=sim.kv_capacity)

    def ask(rid: int, now: float) -> Job:
        req = Request(rid=rid, arrival=now, prompt_len=8, max_tokens=20, deadline=now + 2.0)
        req.predicted = LengthPrediction.exact(20)
        return Job(req, output_len=20)

    def finish(adm: Admission, arriving: int) -> float:
        job = ask(999, image.now)
        v = adm.admit(
            [job], stats=stats, queued=0, budget_s=2.0, allows_eviction=False, cached={},
            image=image, arriving=arriving,
        )  # fmt: skip
        assert v.predicted_finish_s is not None, v.reason
        return v.predicted_finish_s

    def admission(gap: float) -> Admission:
        adm = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"), burst_gap_s=gap)
        for r in range(3):  # three bursts of six seen, 15 s apart, the last 15 s ago
            for i in range(6):
                adm.recent.note(ask(100 * r + i, image.now - 45.0 + 15.0 * r), 20)
        return adm

    # a prefill step (no decoders), then 19 decode steps
    alone = 0.02 + 19 * (0.02 + 0.01)
    six = 0.02 + 19 * (0.02 + 6 * 0.01)
    assert finish(admission(0.0), arriving=2) == pytest.approx(alone)
    assert finish(admission(0.05), arriving=0) == pytest.approx(six)
    assert finish(admission(0.05), arriving=2) == pytest.approx(six)
    # the first burst of all: only those on their way are known, shaped like the ask
    fresh = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"))
    assert finish(fresh, arriving=5) == pytest.approx(six)
    job = ask(999, image.now)
    tight = admission(0.05).admit(
        [job], stats=stats, queued=0, budget_s=1.0, allows_eviction=False, cached={},
        image=image, arriving=2,
    )  # fmt: skip
    assert not tight.accept
    assert "5 arriving with it" in tight.reason
