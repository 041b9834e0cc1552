"""A policy that schedules nothing and asks to be woken now gets the same answer from
both executors: the run would never end (the engine spun until its wall-time limit)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.sim import SimConfig, simulate


class _WakeNow:
    name = "wake-now"
    default_predictor = None

    def waiting_key(self, seq: Any) -> Any:
        return seq.order

    def schedule(self, snap: EngineSnapshot) -> Decision:
        return Decision(wake_at=snap.now)


def _jobs() -> list[Job]:
    req = Request(rid=0, arrival=0.0, prompt_len=3, prompt_token_ids=(2, 4, 5), max_tokens=4)
    return [Job(req, 4)]


def _run(executor: str) -> None:
    if executor == "sim":
        simulate(_jobs(), _WakeNow(), LinearStepCost(c0=1.0), SimConfig(kv_capacity=64))
    else:
        model = engine_from_hf(tiny_hf_model(seed=2))
        EngineExecutor(_WakeNow(), model, kv_capacity=64).run(_jobs(), max_wall_s=30)


@pytest.mark.parametrize("executor", ["sim", "engine"])
def test_waking_now_forever_is_a_run_that_would_never_end(executor: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"scheduled nothing .* the run would never end"):
        _run(executor)
    assert time.monotonic() - t0 < 20
