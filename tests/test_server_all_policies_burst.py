"""Every registered policy serves real HTTP traffic correctly (tiny random model).

A policy never knows whether it drives the simulator or the engine, so each one
is put behind `duetime serve` and sent one burst of concurrent requests:
completions and chats, streamed and not, short and long answers, tight and
loose deadlines, priorities, ``ignore_eos``, stop strings, segments, KV
eviction, and clients that disconnect mid-stream or give up before the first
token. The engine is small (KV for 192 tokens, 3 sequences, 48 tokens a step),
so requests are preempted, restarted, swapped and cancelled.

Each request must get exactly one well-formed answer (a 200 or a 429 with an
error object; never a 5xx, never a hang); a finished answer is the model's own
greedy continuation cut where its finish reason says, and an answer the policy
cut short is a prefix of it (a client never sees a token change); the usage and
``duetime`` fields agree with what was sent; afterwards the engine holds no
request and no KV.

The server runs here with :class:`CharCodec`, one character per token id, so
that text and tokens can be compared one to one (the byte codec turns this
model's answers into U+FFFD).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from duetime.engine.gemma3 import Gemma3
from duetime.policies.registry import available_policies
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, load_served_model
from duetime.server.threaded import serve_in_thread
from tests.serve_burst_traffic import (
    Reference,
    Result,
    burst_specs,
    check_answer,
    metric_value,
    policy_state,
    send_spec,
    wait_drained,
)
from tests.served import MODEL, CharCodec, HalfPredictor


@pytest.fixture(scope="module")
def model() -> Gemma3:
    options = ServeOptions(model="tiny", predictor=None)
    return load_served_model(options)[0]


@dataclass(frozen=True)
class Case:
    policy: str
    kwargs: dict[str, Any] | None = None
    seed: int = 0

    def __str__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in (self.kwargs or {}).items())
        return self.policy + (f"[{args}]" if args else "")


CASES = [Case(p, seed=i) for i, p in enumerate(available_policies())] + [
    Case("fcfs", {"preempt_mode": "restart"}, seed=101),
    Case("edf", {"preempt_mode": "swap"}, seed=102),
    Case("deferred-prefill", {"k": 3}, seed=103),
    Case("timebill", {"overrun": "skip-next"}, seed=104),
]


def test_every_registered_policy_is_covered() -> None:
    assert {c.policy for c in CASES} == set(available_policies())
    assert len(available_policies()) >= 12


@pytest.fixture(scope="module")
def reference(model: Gemma3) -> Reference:
    return Reference(model)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_burst_of_mixed_requests_is_served_correctly(
    model: Gemma3, reference: Reference, case: Case
) -> None:
    # hsf schedules by predicted lengths and refuses to be served without a predictor
    predictor = HalfPredictor() if case.policy == "hsf" else None
    state = policy_state(
        model,
        case.policy,
        case.kwargs,
        predictor,
        kv_capacity=192,
        max_num_seqs=3,
        max_batch_tokens=48,
    )
    specs = burst_specs(case.seed, CharCodec(), state.config.max_context, n=24)
    with serve_in_thread(create_app(state)) as url:

        async def burst() -> list[Result]:
            timeout = httpx.Timeout(30.0)
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                return await asyncio.gather(*(send_spec(client, url, s) for s in specs))

        results = asyncio.run(burst())
        wait_drained(state)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        metrics = httpx.get(url + "/metrics").text
        for gauge in (
            "duetime_queue_length",
            "duetime_running",
            "duetime_suspended",
            "duetime_kv_used_tokens",
        ):
            assert metric_value(metrics, gauge) == 0, gauge
        assert metric_value(metrics, "duetime_engine_errors_total") == 0
        assert "# TYPE duetime_engine_errors_total counter" in metrics
        assert metric_value(metrics, "duetime_engine_steps_total") > 0
        assert 'reason="error"' not in metrics
        # The server still answers: one more request, after the burst.
        after = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "ignore_eos": True},
            timeout=30,
        )
        assert after.status_code == 200, after.text
        # The step times are known by now: a deadline no step could meet is refused.
        hopeless = httpx.post(
            url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "abc",
                "max_tokens": 60,
                "ignore_eos": True,
                "deadline_ms": 1,
            },
        )
        assert hopeless.status_code == 429, hopeless.text
        assert int(hopeless.headers["Retry-After"]) >= 1
        assert hopeless.json()["error"]["code"] == "deadline_unreachable"
        wait_drained(state)
    problems = [
        f"#{s.i} {s.body}: {p}"
        for s, r in zip(specs, results, strict=True)
        for p in check_answer(s, r, reference)
    ]
    assert not problems, "\n".join(problems)
    assert sum(r.status == 200 for r in results) >= len(specs) // 2
