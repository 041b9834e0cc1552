"""Admission by forecast: the load expected from the requests accepted lately.

The forecast has more requests like the recent ones arrive at their accepted rate;
:class:`RecentLoad` replays the newest shapes within its window.
"""

from __future__ import annotations

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission
from duetime.server.engine_loop import EngineStats
from duetime.server.recent_load import RecentLoad
from duetime.server.step_timer import StepTimer
from duetime.sim.simulator import SimConfig, Simulator
from tests.admission_images import ask_job


def test_the_forecast_expects_more_requests_like_those_accepted_lately() -> None:
    """Alone, a 30-token answer beside one other finishes in ~1.2 s. Once requests with
    500-token prompts have been accepted 10 a second, the forecast has more arrive
    at that rate, and their prefills hold its decoding up: refused."""
    cost = LinearStepCost.batch(c=0.02, a=0.001, b=0.01, d=0.0)
    sim = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=8, max_time=2.5))
    busy = Request(rid=1, arrival=0.0, prompt_len=16, max_tokens=400)
    busy.predicted = LengthPrediction.exact(400)
    sim.run([Job(busy, output_len=400)])
    image = sim.image()
    stats = EngineStats(now=image.now, running=1, kv_used=40, kv_capacity=sim.kv_capacity)
    adm = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"))
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    alone = adm.admit([ask_job(2, 30, image.now)], image=image, **args)  # type: ignore[arg-type]
    assert alone.accept
    assert alone.predicted_finish_s is not None
    assert alone.predicted_finish_s < 1.5
    # (that acceptance is noted too: one of the recent requests)
    for k in range(20):
        t = image.now - 2.0 + 0.1 * k
        seen = Request(rid=100 + k, arrival=t, prompt_len=500, max_tokens=30, deadline=t + 2.0)
        adm.recent.note(Job(seen, output_len=30), 30)
    expected = adm.recent.future(image.now, image.now + 1.0)
    assert 9 <= len(expected) <= 11  # ~10 a second
    crowded = adm.admit([ask_job(3, 30, image.now)], image=image, **args)  # type: ignore[arg-type]
    assert not crowded.accept
    assert "more like the recent ones arriving" in crowded.reason


def test_recent_load_replays_the_newest_shapes_at_the_accepted_rate() -> None:
    load = RecentLoad(window_s=10.0)
    shapes = [(0.0, 100, 10), (1.0, 200, 20), (2.0, 300, 30)]
    for i, (t, prompt, answer) in enumerate(shapes):
        load.note(Job(Request(rid=i, arrival=t, prompt_len=prompt), output_len=answer), answer)
    assert load.future(2.5, 100.0) == []  # fewer than 4: no guess
    load.note(Job(Request(rid=3, arrival=3.0, prompt_len=400, deadline=5.0), 40), 40)
    # 4 in the 4 s since the first: one a second
    future = load.future(4.0, 8.5)
    assert [j.request.arrival for j in future] == [5.0, 6.0, 7.0, 8.0]
    assert [j.request.prompt_len for j in future] == [400, 300, 200, 100]  # newest first
    assert [j.output_len for j in future] == [40, 30, 20, 10]
    assert [j.request.rid for j in future] == [-1, -2, -3, -4]
    assert future[0].request.deadline == 7.0
    assert future[1].request.deadline is None
    assert future[0].request.predicted == LengthPrediction.exact(40)
    assert len(load.future(4.0, 1e9, most=7)) == 7
    assert load.future(12.5, 100.0) == []  # the window has let the first three go
