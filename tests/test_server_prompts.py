"""Several prompts in one ``/v1/completions`` request (OpenAI's list of prompts).

Each prompt gets ``n`` choices, numbered prompt by prompt; each choice is the
answer that prompt alone gets; usage counts every prompt once. This is how an
evaluation harness sends a batch (lm-evaluation-harness's ``local-completions``
with ``batch_size`` > 1: a list of id lists, each scored with ``echo`` and
``logprobs``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from duetime.server.app import ServerState
from duetime.server.schemas import MAX_PROMPTS
from tests.served import MODEL, wait_idle

PROMPTS = ["Once upon", "The cat sat on", "1, 2, 3,"]


def _alone(url: str, prompt: Any, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60).json()


def test_each_prompt_gets_its_own_answers_numbered_prompt_by_prompt(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    url, state = served
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, n=2)
    assert [c.index for c in resp.choices] == list(range(6))
    alone = [_alone(url, p, max_tokens=6)["choices"][0]["text"] for p in PROMPTS]
    assert [c.text for c in resp.choices] == [a for a in alone for _ in range(2)]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(state.codec.encode(p)) for p in PROMPTS)
    body = resp.to_dict()
    completions = [c["duetime"]["completion_tokens"] for c in body["choices"]]  # type: ignore[index]
    assert resp.usage.completion_tokens == sum(completions)
    wait_idle(state)


def test_a_harness_batch_of_id_prompts_is_scored_prompt_by_prompt(
    served: tuple[str, ServerState],
) -> None:
    """lm-evaluation-harness's loglikelihood batch: each choice scores its own prompt,
    as the prompt alone would be scored (the batch shares steps: the last bits may
    differ); streamed, the chunks of every choice add up to the whole ones."""
    url, state = served
    ids = [state.codec.encode(p) for p in PROMPTS]
    fields = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    whole = _alone(url, ids, **fields)
    choices = whole["choices"]
    assert len(choices) == len(ids)
    for one, choice in zip(ids, choices, strict=True):
        alone = _alone(url, [one], **fields)["choices"][0]["logprobs"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(one) + 1
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(alone["token_logprobs"][1:], abs=1e-4)
        assert choice["text"] == state.codec.decode(one) + "".join(lp["tokens"][len(one) :])
    events = []
    body = {"model": MODEL, "prompt": ids, **fields, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    for i, choice in enumerate(choices):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert sum(c["finish_reason"] is not None for c in mine) == 1
        scores = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert scores[0] is None
        assert scores[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-4)
    wait_idle(state)


def test_bad_prompts_in_a_list_are_named(served: tuple[str, ServerState]) -> None:
    url, state = served
    cases = [
        (["a", ""], "prompt 1 must not be empty"),
        (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
        ([[5, 6], [7, 10**6]], "prompt 1: prompt token ids must be <"),
        (["ok", "x" * 5000], "prompt 1: the prompt"),
        (["a", [5, 6]], "prompt"),  # text and ids mixed: neither list type
    ]
    for prompt, words in cases:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400, prompt
        assert words in r.json()["error"]["message"], r.json()
    wait_idle(state)


def test_prompts_count_against_the_queue_and_a_refusal_queues_none() -> None:
    """Room for three sequences: two prompts × two choices is refused whole at the
    fourth (429, nothing queued, nothing generated), two × one is served."""
    from duetime.server.app import create_app
    from duetime.server.threaded import serve_in_thread
    from tests.served import tiny_state

    state = tiny_state(max_waiting=3)
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "n": 2}, timeout=30)
        assert r.status_code == 429, r.text
        assert "prompt 2 of 2, choice 2 of 2: " in r.json()["error"]["message"]
        assert state.engine.executor.tokens_generated == 0
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        wait_idle(state)
