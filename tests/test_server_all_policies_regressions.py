"""Regressions the all-policies burst (``test_server_all_policies_burst.py``) found, each
pinned down on its own: a request the policy cannot queue, a policy that needs length
predictions served without a predictor, the TTFT of a restarted request, an answer
whose last allowed token is EOS, and timebill cancelling a job twice in one decision.

The server runs here with :class:`CharCodec`, one character per token id (tiny random
model).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, LengthPrediction, Request
from duetime.engine.gemma3 import Gemma3
from duetime.policies.registry import make_policy
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, load_served_model
from duetime.server.threaded import serve_in_thread
from duetime.sim import SimConfig, Simulator
from tests.serve_burst_traffic import policy_state, wait_drained
from tests.served import MODEL


@pytest.fixture(scope="module")
def model() -> Gemma3:
    options = ServeOptions(model="tiny", predictor=None)
    return load_served_model(options)[0]


# --- regressions found by the burst ------------------------------------------------------
def test_a_request_the_policy_cannot_queue_leaves_nothing_behind() -> None:
    """hsf orders its queue by a length prediction and raises without one (served on a
    tiny model without a predictor, it did): the request failed, but its sequence stayed
    in the executor for good, WAITING in no queue, and the server went on with it."""
    sim = Simulator(make_policy("hsf"), LinearStepCost(c0=0.01, name="unit"), SimConfig())
    job = Job(Request(rid=0, arrival=0.0, prompt_len=3), 4)
    with pytest.raises(ValueError, match="length prediction"):
        sim.admit_arrival(job)
    assert not sim.seqs
    assert not sim.records
    assert len(sim.waiting) == 0
    job.request.predicted = LengthPrediction.exact(4)  # the same id, now queueable
    sim.admit_arrival(job)
    assert list(sim.seqs) == [0]


def test_a_policy_that_needs_predictions_is_refused_without_a_predictor(model: Gemma3) -> None:
    """Served without one, hsf failed every request without ignore_eos with a 500 telling
    the client to use --predictor oracle, which a server refuses."""
    with pytest.raises(ValueError, match=r"hsf.*--predictor learned"):
        policy_state(model, "hsf")


def test_ttft_is_when_the_client_got_its_first_token_even_after_a_restart(model: Gemma3) -> None:
    """A restart voids the executor's first-token time, but the client keeps the tokens it
    has: its TTFT was reported as the time of the re-run's first token, long after the
    client had read it (and as none at all when the request ended before the re-run)."""
    state = policy_state(
        model, "fcfs", {"preempt_mode": "restart"}, kv_capacity=64, max_batch_tokens=64
    )
    body = {"model": MODEL, "prompt": "P", "max_tokens": 55, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, url: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        first = None
        final: dict[str, Any] = {}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line.removeprefix("data: "))
                if first is None and obj["choices"][0]["text"]:
                    first = (time.perf_counter() - t0) * 1000
                if "duetime" in obj:
                    final = obj["duetime"]
        assert first is not None
        return first, final

    with serve_in_thread(create_app(state)) as url:

        async def both() -> list[tuple[float, dict[str, Any]]]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(one(client, url), one(client, url))

        answers = asyncio.run(both())
        wait_drained(state)
    assert any(timing["preemptions"] for _, timing in answers)  # one of them was restarted
    for seen_ms, timing in answers:
        assert timing["completion_tokens"] == 55
        # The server's clock starts after the client's and stops before the client reads.
        assert timing["ttft_ms"] <= seen_ms, (timing, seen_ms)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "ignore_eos", "reason", "tokens"),
    [
        ("a", 1, False, "stop", 1),  # the first token is EOS
        ("U", 2, False, "stop", 2),  # the second token is EOS
        ("U", 5, False, "stop", 2),
        ("U", 2, True, "length", 2),  # EOS is only a token here
        ("P", 2, False, "length", 2),
    ],
)
def test_an_answer_whose_last_allowed_token_is_eos_ends_with_stop(
    model: Gemma3, prompt: str, max_tokens: int, ignore_eos: bool, reason: str, tokens: int
) -> None:
    """The model ended the answer, so it is complete: "stop", as in vLLM and OpenAI. When
    EOS was also the max_tokens-th token, the answer was reported as cut ("length")."""
    state = policy_state(model, "fcfs", kv_capacity=256)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    with serve_in_thread(create_app(state)) as url:
        for stream in (False, True):
            r = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x[6:7] == "{"]
                final = next(e for e in events if e["choices"][0]["finish_reason"])
            else:
                final = r.json()
            assert final["choices"][0]["finish_reason"] == reason
            assert final["duetime"]["completion_tokens"] == tokens
        wait_drained(state)


def test_timebill_cancels_a_job_that_is_both_killed_and_skipped_once() -> None:
    """Requests choose their own overrun strategy: in one class, a job whose request says
    "kill" is past its deadline while an earlier one says "skip_next" and overran too. It
    was cancelled twice in one decision, an illegal step, which on the server failed every
    request in flight with a 500 (found by the burst above)."""

    def job(rid: int, output: int, deadline: float, overrun: str) -> Job:
        req = Request(
            rid=rid,
            arrival=0.0,
            prompt_len=10,
            max_tokens=100,
            deadline=deadline,
            klass="t",
            overrun=overrun,
        )
        return Job(request=req, output_len=output)

    cost = LinearStepCost.timebill(a=1e-9, b=5e-5, c=0.02, p=2e-6, q=0.01)
    sim = Simulator(make_policy("timebill"), cost, SimConfig(kv_capacity=1000, max_num_seqs=1))
    jobs = [job(0, 50, 0.05, "skip-next"), job(1, 5, 0.001, "skip-next"), job(2, 5, 0.001, "kill")]
    records = {r.request.rid: r for r in sim.run(jobs).records}
    assert records[2].cancelled_at is not None  # killed (and skipped), once
    assert records[0].finish is not None  # skip-next never kills
    assert records[1].finish is not None
