"""A policy is told each request's end as it ends, in the simulator and on the engine alike
(it was told only by the server, so a policy's books grew through a simulated run)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies.fcfs import FCFS
from duetime.sim import SimConfig, simulate
from tests.engine_checks import engine_job, random_prompt


class _Counting(FCFS):
    """FCFS that keeps one entry per live request, as a policy with books would."""

    name = "counting"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.live: set[int] = set()
        self.forgotten: list[int] = []

    def waiting_key(self, seq: Any) -> Any:
        self.live.add(seq.rid)
        return super().waiting_key(seq)

    def forget(self, rid: int) -> None:
        self.live.discard(rid)
        self.forgotten.append(rid)


def _jobs(n: int) -> list[Job]:
    r = random.Random(3)
    return [
        engine_job(i, (2, *random_prompt(r, r.randint(3, 11))), r.randint(2, 10), max_tokens=10)
        for i in range(n)
    ]


@pytest.mark.parametrize("executor", ["sim", "engine"])
def test_every_request_is_forgotten_once_as_it_ends(executor: str) -> None:
    policy = _Counting()
    limits: dict[str, int] = {"kv_capacity": 4096, "max_num_seqs": 4, "max_batch_tokens": 64}
    if executor == "sim":
        res = simulate(_jobs(12), policy, LinearStepCost(c0=1.0), SimConfig(**limits))
    else:
        model = engine_from_hf(tiny_hf_model(seed=2))
        res = EngineExecutor(policy, model, **limits).run(_jobs(12))
    assert all(r.finish is not None for r in res.records)
    assert sorted(policy.forgotten) == list(range(12))
    assert policy.live == set()
    # each as it ended, not all at the end of the run: the first is an earliest finisher
    first_end = min(r.finish for r in res.records if r.finish is not None)
    assert policy.forgotten[0] in {r.request.rid for r in res.records if r.finish == first_end}
