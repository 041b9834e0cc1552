"""Property-based tests of the OpenAI-compatible server under concurrent, misbehaving clients.

Hypothesis draws a small engine (KV for 64 to 512 tokens, 1 to 4 sequences, a
step budget of 8 to 2048 tokens), a policy with its options, a tokenizer (one
character per token, or one UTF-8 byte per token so that characters span
tokens), the server's request timeout and queue limit, and a mix of clients
sent at once: completions and chat completions, streamed or not (with or
without ``include_usage``), text or token-id prompts, ``echo``, stop strings
and ``stop_token_ids`` (often taken from the model's own answer so that they
hit), ``max_tokens``
from 1 to more than the context leaves, deadlines, priorities, TUFs, overrun,
KV eviction, ``ignore_eos``, ``min_tokens``, segments and classes, sampling
fields (temperature, top-p/k, min-p, seed, a penalty) and log-probabilities
(with ``echo``, of the prompt too);
some bodies are malformed in one of many ways. Clients hang up before the
first byte, while queued, in the middle of a stream, or give up on a
client-side timeout.
The server runs in-process (uvicorn on a thread) on a tiny random-weight
model, never the real Gemma. What must hold:

* every client that stayed got exactly one well-formed answer (a 200 with a
  complete JSON body or SSE stream, or a JSON error object with a 4xx, or the
  504 of the server's own timeout) within a bound; bad input gets the 4xx it
  deserves, never a 5xx;
* an answer that ran to its end is the model's greedy continuation (unless it
  sampled, was penalised or had KV evicted: then only its shape is judged), cut
  where its ``finish_reason`` says ("stop" for end-of-sequence or a stop string,
  "length" at ``max_tokens``), so a streamed answer equals the non-streamed one
  for the same prompt; one the policy cut short ("abort") is a prefix of it;
  ``usage`` and the ``duetime`` object agree with the text, and so do the
  tokens of ``logprobs`` (one per token, their strings making up the text; a
  scored prompt's make up the echo, the first without a score);
* afterwards no handler runs, the engine holds no request, the KV cache no
  slot and no token, and ``/metrics`` agrees with what the clients saw: finish
  reasons, 429s by cause, tokens generated, gauges at zero, and every request
  that got past validation counted exactly once (finished or refused);
* the server logged no error (one a departed client never saw included), and
  still answers ``/health`` and one more request.

``DUETIME_FUZZ_EXAMPLES=N`` runs N examples per case instead of CI's 2.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, note, settings

from duetime.server.app import create_app
from duetime.server.threaded import serve_in_thread
from tests.server_answer_checks import check_call, same_prompt_same_answer
from tests.server_calls import MODEL, Call, Engine
from tests.server_harness import HANG_S, Handling, errors_logged, idle, run, scenario_state
from tests.server_metric_checks import check_metrics, metrics
from tests.server_scenarios import CASES, scenarios

EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "2"))


# --- the property -----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_every_client_gets_one_right_answer_and_nothing_leaks(case: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(case))
    def check(scenario: tuple[Engine, list[Call]]) -> None:
        eng, calls = scenario
        note(repr(eng))
        for c in calls:
            note(repr(c))
        state = scenario_state(eng)
        # uvicorn configures its loggers as it starts: listen to them after that.
        app = Handling(create_app(state))
        with serve_in_thread(app) as url, errors_logged() as logged:
            seen = asyncio.run(run(url, calls))
            for c, s in zip(calls, seen, strict=True):
                reason = s.final["choices"][0]["finish_reason"] if s.answered else ""
                event(f"{s.status or s.gone} {reason}")
                note(f"#{c.i}: {s.status} {s.gone} {s.text!r} {s.final.get('duetime')} {s.error}")
            problems = [
                f"#{c.i}: {p}"
                for c, s in zip(calls, seen, strict=True)
                for p in check_call(eng, c, s)
            ]
            problems += same_prompt_same_answer(eng, calls, seen)
            assert not problems, "\n".join(problems)
            idle(state, app)
            assert httpx.get(url + "/health").json()["status"] == "ok"
            issued = next(state.engine._rids) - 1  # ids handed out so far
            problems = check_metrics(calls, seen, metrics(url), issued)
            assert not problems, "\n".join(problems)
            # the server still answers: judged without the scenario's own request timeout
            # (as short as 50 ms, which a loaded machine's first step can outlast)
            state.config.request_timeout_s = HANG_S
            after = httpx.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "ignore_eos": True},
                timeout=HANG_S,
            )
            assert after.status_code == 200, after.text
            idle(state, app)
            # A crash the client never saw (it had left) is still a crash.
            assert not logged, "\n".join(logged)

    check()
