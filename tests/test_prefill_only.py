"""``Decision.prefill_only``: a step that prefills while every decoder holds.

Holding the batch must be what suspending it for the step and resuming it right
after was (deferred prefill's stall, before the flag), at no per-decoder cost:
same finish times in the simulator, same tokens on the engine.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from duetime import workloads as wl
from duetime.bench.engine_fit import with_synthetic_ids
from duetime.core.cost import LinearStepCost
from duetime.core.decision import Decision
from duetime.core.policy import PolicyError
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies.base import QueuePolicy
from duetime.sim.profiles import load_profile
from duetime.sim.simulator import SimConfig, Simulator

COST, _ = load_profile()


class _PrefillsAlone(QueuePolicy):
    """FCFS whose admission steps run alone: the decoders hold (``prefill_only``) or,
    with ``suspend``, are suspended for the step and those the base class would
    resume stay suspended (it resumes them, ready, at a call that admits nothing)."""

    name = "prefills-alone"

    def __init__(self, suspend: bool) -> None:
        super().__init__(chunked_prefill=False)
        self.suspend = suspend
        self.held_steps = 0

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        decoders = [s.rid for s in snap.running if s.prefill_done and s.rid not in dec.preempt]
        if dec.prefill and (decoders or dec.resume):
            self.held_steps += 1
            if self.suspend:
                dec.suspend = decoders
                dec.resume = []
            else:
                dec.prefill_only = True
        return dec


def _jobs(n: int) -> list[Job]:
    return wl.build_jobs(
        n, source=wl.SyntheticSource((16, 600), (8, 200)), arrivals=wl.Poisson(rate=20), seed=5
    )


def test_holding_the_batch_times_every_request_as_suspending_it() -> None:
    jobs = _jobs(400)
    runs = {}
    for suspend in (False, True):
        policy = _PrefillsAlone(suspend)
        sim = Simulator(policy, COST, SimConfig(max_num_seqs=32))
        res = sim.run(copy.deepcopy(jobs))
        runs[suspend] = [(r.request.rid, r.first_token, r.finish) for r in res.records]
        assert policy.held_steps > 100
    assert runs[False] == runs[True]


def test_a_held_step_costs_the_prefill_alone_and_the_decoders_make_no_token() -> None:
    cost = LinearStepCost(c0=0.01, a1=1e-4, b=1e-3)
    sim = Simulator(_PrefillsAlone(suspend=False), cost, SimConfig(max_num_seqs=8))
    first = Job(Request(rid=0, arrival=0.0, prompt_len=10, max_tokens=50), output_len=50)
    later = Job(Request(rid=1, arrival=0.2, prompt_len=40, max_tokens=5), output_len=5)
    sim.run([first, later])
    rec0, rec1 = sim.records[0], sim.records[1]
    assert rec0.finish is not None
    assert rec1.first_token is not None
    # Request 0 decodes alone (one step of c0 + b each) until request 1 arrives; its
    # admission step is the prefill alone (c0 + 40·a1), then the two decode together.
    t0 = cost.step_time(10, 10 * 10, 0, 0)  # request 0's prefill: its first token
    alone, pair = cost.step_time(0, 0.0, 1, 0), cost.step_time(0, 0.0, 2, 0)
    k = math.ceil((0.2 - t0) / alone)  # its decode steps before request 1 is seen
    held = t0 + k * alone + cost.step_time(40, 40 * 40, 0, 0)  # not the b of a decoder
    assert rec1.first_token == pytest.approx(held, rel=1e-9)
    # Request 0 made no token while held: its other 49 - k come after, 4 of them beside
    # request 1's 4.
    assert rec0.finish == pytest.approx(held + 4 * pair + (49 - k - 4) * alone, rel=1e-9)
    assert rec0.output_tokens == 50


def test_a_prefill_only_step_needs_a_prefill() -> None:
    class _Empty(QueuePolicy):
        def schedule(self, snap: EngineSnapshot) -> Decision:
            dec = super().schedule(snap)
            dec.prefill_only = bool(snap.num_decoding)
            if dec.prefill_only:
                dec.prefill = []
            return dec

    job = Job(Request(rid=0, arrival=0.0, prompt_len=8, max_tokens=4), output_len=4)
    with pytest.raises(PolicyError, match="prefill-only step without a prefill"):
        Simulator(_Empty(), COST).run([job])


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=4))


def test_the_engine_holds_the_batch_for_a_prefill_and_writes_the_same_tokens(
    model: Any, tmp_path: Path
) -> None:
    jobs = with_synthetic_ids(_jobs(12), 256, 2, seed=2)
    outputs = {}
    for suspend in (False, True):
        tel = tmp_path / f"steps-{suspend}.jsonl"
        policy = _PrefillsAlone(suspend)
        ex = EngineExecutor(policy, model, kv_capacity=1 << 16, max_num_seqs=4, telemetry=tel)
        res = ex.run(copy.deepcopy(jobs))
        assert all(r.completed for r in res.records)
        assert ex.kv.total_tokens == 0
        assert policy.held_steps > 0
        steps = [json.loads(line) for line in tel.read_text().splitlines()]
        held = [s for s in steps if s["prefill_tokens"] > 0 and s["decode_seqs"] == 0]
        assert len(held) >= policy.held_steps
        outputs[suspend] = res.outputs
    assert outputs[False] == outputs[True]
