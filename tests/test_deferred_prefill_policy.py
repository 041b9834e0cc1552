"""The deferred-prefill trigger: K departures since the last prefill phase, not K free slots."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.record import RequestRecord
from duetime.core.request import Job, Request
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator

BIG = 1 << 30
COST = LinearStepCost(c0=1.0)  # every step takes 1 s: step counts read off the clock


def jobs(
    outputs: list[int], prompt_len: int = 100, arrivals: list[float] | None = None
) -> list[Job]:
    at = arrivals or [0.0] * len(outputs)
    return [
        Job(Request(rid=i, arrival=t, prompt_len=prompt_len, max_tokens=o), o)
        for i, (o, t) in enumerate(zip(outputs, at, strict=True))
    ]


def phases(records: list[RequestRecord]) -> tuple[list[int], list[int]]:
    """Prompts per prefill phase and departures before each later phase.

    A stalled prefill step decodes nothing, so a phase is the requests sharing a
    first-token time; a departure before phase ``i + 1`` is a finish in
    ``[t_i, t_{i+1})`` (a one-token output finishes at its own prefill).
    """
    firsts = sorted({r.first_token for r in records if r.first_token is not None})
    sizes = [sum(r.first_token == t for r in records) for t in firsts]
    done = np.array(sorted(r.finish for r in records if r.finish is not None))
    edges = np.searchsorted(done, firsts, side="left")
    return sizes, [int(x) for x in np.diff(edges)]


def test_a_refill_cut_short_by_memory_waits_for_k_departures() -> None:
    """KV for 5 prompts, C = 8, K = 3: every refill stops at 5 with requests waiting, so
    3 slots always stand free; a rule counting free slots would prefill after every
    single departure, one prompt at a time. The paper's rule waits for 3 departures."""
    k = 3
    outputs = [int(x) for x in np.random.default_rng(0).integers(2, 13, size=40)]
    # 6 fresh prompts need 6 x 101 > 600 tokens; 5 that grow by <= 12 each still fit.
    cfg = SimConfig(kv_capacity=600, max_num_seqs=8, max_batch_tokens=BIG)
    res = Simulator(make_policy("deferred-prefill", k=k), COST, cfg).run(jobs(outputs))
    assert all(r.completed for r in res.records)
    assert res.preemptions == 0  # departures are finishes only, as `phases` counts them
    sizes, departures = phases(res.records)
    assert sizes[0] == 5  # memory, not the 8 slots, stops the refill
    assert all(d >= k for d in departures), departures
    assert all(s >= k for s in sizes[1:-1]), sizes  # each phase amortises c_p over >= K
    assert sum(sizes) == len(outputs)


def test_a_phase_cut_by_the_step_budget_goes_on_in_the_next_step() -> None:
    """8 prompts of 100 tokens, 250 tokens per step: the first phase takes 4 consecutive
    prefill steps to fill the batch. Counting free slots stopped it at 6 of 8 (2 < K free)."""
    cfg = SimConfig(kv_capacity=BIG, max_num_seqs=8, max_batch_tokens=250)
    res = Simulator(make_policy("deferred-prefill", k=3), COST, cfg).run(jobs([50] * 12))
    firsts = sorted(r.first_token for r in res.records if r.first_token is not None)
    assert firsts[:8] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    assert all(r.completed for r in res.records)


def test_an_arrival_gets_in_once_k_slots_are_free_without_k_departures() -> None:
    """The queue ran out with the batch at 2 of 8: a later arrival is prefilled at once
    (6 >= K slots stand free), not held until K = 3 requests leave a batch of 2."""
    cfg = SimConfig(kv_capacity=BIG, max_num_seqs=8, max_batch_tokens=BIG)
    res = Simulator(make_policy("deferred-prefill", k=3), COST, cfg).run(
        jobs([40, 40, 5], arrivals=[0.0, 0.0, 10.5])
    )
    late = res.records[2]
    assert late.first_token is not None
    assert late.first_token <= 10.5 + 2.0  # the step under way, then its prefill step
    first_two = [r.finish for r in res.records[:2]]
    assert all(f is not None and late.first_token < f for f in first_two)


def test_without_memory_pressure_departures_and_free_slots_agree() -> None:
    """Unlimited KV (the paper's model, the bench): every refill fills the batch, so the
    phases come exactly after >= K departures and admit >= K prompts."""
    k = 4
    outputs = [int(x) for x in np.random.default_rng(1).integers(2, 30, size=60)]
    cfg = SimConfig(kv_capacity=BIG, max_num_seqs=8, max_batch_tokens=BIG)
    res = Simulator(make_policy("deferred-prefill", k=k), COST, cfg).run(jobs(outputs))
    sizes, departures = phases(res.records)
    assert sizes[0] == 8
    # The batch is full after every phase but the last, so each refill admits exactly
    # what left since the previous one.
    assert sizes[1:-1] == departures[:-1]
    assert all(d >= k for d in departures)


@pytest.mark.parametrize("capacity", [0, -3])
def test_a_batch_capacity_below_one_is_refused(capacity: int) -> None:
    # 0 read as "unset" and a negative one capped every phase below zero
    with pytest.raises(ValueError, match=f"batch capacity must be >= 1.*got {capacity}"):
        make_policy("deferred-prefill", capacity=capacity)
