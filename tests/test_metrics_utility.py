"""Time utility (TimelyLLM Eq. 1-3) against hand-computed numbers and a scalar reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from duetime.core.record import RequestRecord
from duetime.core.request import Request, TimeUtility
from duetime.metrics import summarize
from duetime.metrics.utility import tuf0, tuf1

NORMAL = TimeUtility(ert=1.0, beta=1.0, alpha=-2.0)  # TimelyLLM's chatbot TUF


def rec(
    arrival: float,
    *,
    finish: float | None = None,
    done: list[float] | None = None,
    ready: list[float] | None = None,
    tuf: TimeUtility | None = NORMAL,
    cancelled_at: float | None = None,
    klass: str = "default",
    rid: int = 0,
) -> RequestRecord:
    req = Request(rid=rid, arrival=arrival, prompt_len=4, tuf=tuf, klass=klass)
    return RequestRecord(
        request=req,
        first_token=arrival,
        finish=finish,
        cancelled_at=cancelled_at,
        output_tokens=4,
        segment_done=list(done or []),
        segment_ready=list(ready or []),
    )


@pytest.mark.parametrize(("t", "u"), [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.5, 0.0), (2.0, -1.0)])
def test_tuf0_matches_the_formula(t: float, u: float) -> None:
    one = np.array([1.0])
    assert tuf0(np.array([t]), one, one, -2 * one)[0] == pytest.approx(u)


def test_vectorised_tufs_equal_time_utility_scalar() -> None:
    rng = np.random.default_rng(0)
    t = rng.uniform(-1, 5, 500)
    ert, beta, alpha = rng.uniform(0, 2, 500), rng.uniform(0.5, 3, 500), -rng.uniform(0, 10, 500)
    fns = [TimeUtility(e, b, a) for e, b, a in zip(ert, beta, alpha, strict=True)]
    assert np.allclose(tuf0(t, ert, beta, alpha), [f(x) for f, x in zip(fns, t, strict=True)])
    later = [f.later_segment()(x) for f, x in zip(fns, t, strict=True)]
    assert np.allclose(tuf1(t, beta, alpha), later)


def test_unsegmented_request_is_scored_at_finish() -> None:
    s = summarize([rec(0.0, finish=0.5), rec(0.0, finish=1.5, rid=1)])
    assert s["time_utility_total"] == pytest.approx(1.0 + 0.0)
    assert s["time_utility_mean"] == pytest.approx(0.5)
    assert s["time_utility_first_mean"] == pytest.approx(0.5)


def test_segmented_utility_by_hand() -> None:
    # seg0: W = 0.5 → TUF0 = 1.  seg1: W = 2.0 - 1.5 = 0.5 → TUF1 = -2·0.5 + 1 = 0.
    # seg2: done 0.2 s before the client was ready → W = 0 → TUF1 = 1.   Total 2.
    r = rec(0.0, finish=3.0, done=[0.5, 2.0, 3.0], ready=[1.5, 3.2])
    s = summarize([r])
    assert s["time_utility_total"] == pytest.approx(2.0)
    assert s["time_utility_first_mean"] == pytest.approx(1.0)
    assert s["robot_wait_mean_s"] == pytest.approx(0.5 + 0.5 + 0.0)


def test_missing_ready_time_means_wanted_at_once() -> None:
    # No segment_ready: segment 1 is wanted when segment 0 is done, W = 1.0 - 0.5.
    s = summarize([rec(0.0, finish=1.0, done=[0.5, 1.0])])
    assert s["time_utility_total"] == pytest.approx(1.0 + 0.0)


def test_never_started_request_is_judged_at_the_horizon() -> None:
    records = [rec(0.0, cancelled_at=0.2), rec(0.0, finish=1.25, tuf=None, rid=1)]
    # Default horizon = last event = 1.25 → TUF0(1.25) = -2·0.25 + 1 = 0.5.
    assert summarize(records)["time_utility_total"] == pytest.approx(0.5)
    # An explicit span moves the horizon: TUF0(2.0) = -1.
    assert summarize(records, span=(0.0, 2.0))["time_utility_total"] == pytest.approx(-1.0)


def test_request_cut_off_mid_answer_scores_its_pending_segment() -> None:
    # seg0 on time (1); seg1 wanted at 1.0, still missing at horizon 1.75: TUF1(0.75) = -0.5.
    records = [
        rec(0.0, done=[0.5], ready=[1.0], cancelled_at=1.1),
        rec(0.0, finish=1.75, tuf=None, rid=1),
    ]
    s = summarize(records)
    assert s["time_utility_total"] == pytest.approx(0.5)
    assert s["robot_wait_mean_s"] == pytest.approx(1.75)  # completed requests only


def test_utility_per_class_and_requests_without_tuf_excluded() -> None:
    urgent = TimeUtility(ert=0.2, beta=2.0, alpha=-10.0)
    records = [
        rec(0.0, finish=0.3, tuf=urgent, klass="urgent"),  # 2 - 10·0.1 = 1
        rec(0.0, finish=0.1, tuf=urgent, klass="urgent", rid=1),  # 2
        rec(0.0, finish=0.5, klass="normal", rid=2),  # 1
        rec(0.0, finish=9.0, tuf=None, klass="normal", rid=3),
    ]
    s = summarize(records)
    assert s["time_utility_total[urgent]"] == pytest.approx(3.0)
    assert s["time_utility_mean[urgent]"] == pytest.approx(1.5)
    assert s["time_utility_mean[normal]"] == pytest.approx(1.0)
    assert s["time_utility_mean"] == pytest.approx(4.0 / 3)


def test_no_tuf_anywhere_gives_none() -> None:
    s = summarize([rec(0.0, finish=1.0, tuf=None)])
    assert s["time_utility_total"] is None
    assert s["time_utility_mean"] is None
    assert not any(k.startswith("time_utility_mean[") for k in s)


def _reference_utility(r: RequestRecord, horizon: float) -> float:
    """Eq. 3 written the slow, obvious way, one record at a time."""
    tuf = r.request.tuf
    assert tuf is not None
    done = r.segment_done or ([r.finish] if r.finish is not None else [])

    def ready(k: int) -> float:  # the simulator appends segment k's ready time at k - 1
        return r.segment_ready[k - 1] if k - 1 < len(r.segment_ready) else done[k - 1]

    total = 0.0
    for k, d in enumerate(done):
        total += tuf(d - r.request.arrival) if k == 0 else tuf.later_segment()(d - ready(k))
    if r.finish is None:
        k = len(done)
        total += (
            tuf(horizon - r.request.arrival) if k == 0 else tuf.later_segment()(horizon - ready(k))
        )
    return total


def test_vectorised_utility_matches_reference_on_random_records() -> None:
    rng = random.Random(7)
    records = []
    for i in range(300):
        arrival = rng.uniform(0, 10)
        t, done, ready = arrival, [], []
        for _ in range(rng.randint(0, 4)):
            t += rng.uniform(0.05, 1.5)
            done.append(t)
            ready.append(t + rng.uniform(-0.5, 1.0))
        finished = bool(done) and rng.random() < 0.7
        tuf = TimeUtility(
            ert=rng.uniform(0.1, 2), beta=rng.uniform(0.5, 2), alpha=-rng.uniform(0, 5)
        )
        records.append(
            rec(
                arrival,
                finish=done[-1] if finished else None,
                cancelled_at=None if finished else t + 0.1,
                done=done,
                ready=ready[: rng.randint(0, len(ready))],
                tuf=tuf,
                rid=i,
            )
        )
    horizon = 20.0
    s = summarize(records, span=(0.0, horizon))
    expected = sum(_reference_utility(r, horizon) for r in records)
    assert s["time_utility_total"] == pytest.approx(expected)


def test_reads_segments_the_way_the_simulator_writes_them() -> None:
    """Two segments, a 5 s client gap: waiting for segment 1 is its decode time, not 5 s."""
    from duetime.core.request import Job
    from duetime.policies import make_policy
    from duetime.sim import Simulator
    from tests.factories import SIMPLE_COST

    req = Request(rid=0, arrival=1.0, prompt_len=10, tuf=NORMAL)
    job = Job(req, output_len=5, segments=(2, 3), segment_gaps=(5.0,))
    r = Simulator(make_policy("fcfs"), SIMPLE_COST).run([job]).records[0]
    assert r.finish is not None
    w0 = r.segment_done[0] - req.arrival
    w1 = r.finish - (r.segment_done[0] + 5.0)
    assert 0 < w1 < 0.1
    s = summarize([r])
    assert s["robot_wait_mean_s"] == pytest.approx(w0 + w1)
    assert s["time_utility_total"] == pytest.approx(NORMAL(w0) + (1.0 - 2.0 * w1))
