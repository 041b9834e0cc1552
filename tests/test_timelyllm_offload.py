"""Offload of suspended KV (``offload_suspended``) on the simulator: the rule and its invariants."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duetime.core.request import Job, Request
from duetime.core.sequence import Seq
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator
from tests.factories import SIMPLE_COST


class CheckedSim(Simulator):
    """A simulator that checks the device-memory invariants after every step and logs page-outs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paged_out: list[int] = []

    def _on_swap_out(self, seq: Seq) -> None:
        self.paged_out.append(seq.rid)

    def _track_peak(self) -> None:
        assert self.kv_device <= self.kv_capacity, (self.kv_device, self.kv_capacity)
        assert self._parked_kv == sum(s.kv_tokens for s in self._parked.values())
        assert all(s.kv_offloaded for s in self.suspended.values()) or not self.offload_suspended
        super()._track_peak()


def _seg(
    rid: int, arrival: float, prompt: int, segs: tuple[int, ...], gaps: tuple[float, ...]
) -> Job:
    return Job(Request(rid=rid, arrival=arrival, prompt_len=prompt), sum(segs), segs, gaps)


def test_page_out_takes_the_segment_wanted_latest() -> None:
    # A and B stop after 2 tokens holding ~101 KV tokens each; A's robot needs 10 s,
    # B's 5 s. C (150 tokens) arrives at 1 s: only one of them has to leave, and it is A.
    jobs = [
        _seg(0, 0.0, 100, (2, 2), (10.0,)),
        _seg(1, 0.0, 100, (2, 2), (5.0,)),
        _seg(2, 1.0, 150, (4,), ()),
    ]
    sim = CheckedSim(
        make_policy("fcfs"), SIMPLE_COST, SimConfig(kv_capacity=330, offload_suspended=True)
    )
    res = sim.run(jobs)
    assert sim.paged_out == [0]
    assert res.counters["offloads"] == 1
    assert res.counters["swap_ins"] == 1  # A came back from the host; B never left the device
    c = res.records[2]
    assert c.first_token is not None
    assert c.first_token < 2.0
    assert all(
        len(r.segment_done) == len(j.segments) for r, j in zip(res.records, jobs, strict=True)
    )
    assert res.preemptions == 0
    assert sim.prefill_tokens == sum(j.request.prompt_len for j in jobs)  # nothing re-prefilled


def test_without_offload_parked_kv_blocks_the_newcomer() -> None:
    # The same run with suspended KV pinned on the device: the only way in for C is to
    # throw a parked generation's KV away and prefill it again (the collapse offload fixes).
    jobs = [
        _seg(0, 0.0, 100, (2, 2), (10.0,)),
        _seg(1, 0.0, 100, (2, 2), (5.0,)),
        _seg(2, 1.0, 150, (4,), ()),
    ]
    sim = CheckedSim(make_policy("fcfs"), SIMPLE_COST, SimConfig(kv_capacity=330))
    res = sim.run(jobs)
    assert res.preemptions == 1
    assert sim.prefill_tokens > sum(j.request.prompt_len for j in jobs)
    assert "offloads" not in res.counters
    assert not sim.paged_out


@st.composite
def scenarios(draw: Any) -> tuple[list[Job], SimConfig, str]:
    n = draw(st.integers(1, 20))
    jobs = []
    t = 0.0
    for i in range(n):
        t += draw(st.floats(0.0, 0.3))
        k = draw(st.integers(1, 4))
        segs = tuple(draw(st.lists(st.integers(1, 12), min_size=k, max_size=k)))
        gaps = tuple(draw(st.lists(st.floats(0.0, 2.0), min_size=k - 1, max_size=k - 1)))
        prompt = draw(st.integers(1, 150))
        req = Request(rid=i, arrival=t, prompt_len=prompt, deadline=t + draw(st.floats(0.1, 3)))
        jobs.append(Job(req, sum(segs), segs, gaps))
    cfg = SimConfig(
        kv_capacity=draw(st.integers(160, 1500)),
        max_num_seqs=draw(st.integers(1, 12)),
        max_batch_tokens=draw(st.sampled_from([32, 256, 4096])),
        offload_suspended=True,
    )
    return jobs, cfg, draw(st.sampled_from(["fcfs", "edf", "timelyllm", "vllm-stream"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_offload_invariants(scenario: tuple[list[Job], SimConfig, str]) -> None:
    jobs, cfg, name = scenario
    sim = CheckedSim(make_policy(name), SIMPLE_COST, cfg)  # asserts memory after every step
    res = sim.run(jobs)
    assert res.kv_peak <= cfg.kv_capacity
    for job, rec in zip(jobs, res.records, strict=True):
        assert (rec.finish is None) != (rec.cancelled_at is None), rec
        if rec.finish is not None:
            # every suspended segment was resumed and produced its tokens
            assert rec.output_tokens == job.output_len
            assert len(rec.segment_done) == len(job.segments)
    assert res.tokens_generated == sum(r.output_tokens for r in res.records)
    assert not sim._parked
    assert sim._parked_kv == 0
    assert sim.kv_device == 0
    if res.preemptions == 0 and not res.counters.get("restarts"):
        # a resumed segment never re-prefills, wherever its KV spent the pause
        done = [j for j, r in zip(jobs, res.records, strict=True) if r.finish is not None]
        if len(done) == len(jobs):
            assert sim.prefill_tokens == sum(j.request.prompt_len for j in jobs)
