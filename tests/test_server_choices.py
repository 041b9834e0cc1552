"""``n`` > 1: one request, several choices, each a sequence of its own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from duetime.server.app import ServerState, create_app
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, tiny_state, wait_idle


def _one(client: openai.OpenAI, seed: int, prompt: str = "Once upon") -> str:
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        extra_body={"ignore_eos": True, "temperature": 1.0, "seed": seed},
    )
    return resp.choices[0].text


def test_choice_i_is_the_answer_seed_plus_i_gives(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=12,
        n=3,
        extra_body={"ignore_eos": True, "temperature": 1.0, "seed": 40},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.text for c in resp.choices]
    assert texts == [_one(client, 40 + i) for i in range(3)]
    assert len(set(texts)) > 1  # sampled: the seeds differ, so do (some of) the answers
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len("Once upon") + 1  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * 12
    body = resp.to_dict()
    assert all(c["duetime"]["completion_tokens"] == 12 for c in body["choices"])  # type: ignore[index]
    assert body["duetime"] == body["choices"][0]["duetime"]  # type: ignore[index]
    wait_idle(served[1])


def test_the_choices_of_a_long_prompt_compute_it_once(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    """Handed to the engine in one round and admitted in one step, the copies borrow
    the first choice's prompt rows (all but their last token's): each choice is still
    the answer its own seed gives alone."""
    prompt = "The robot arm moves slowly towards the red cup on the table and then"
    ex = served[1].engine.executor
    before = ex.prefill_shared_tokens
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,  # as _one's
        n=3,
        extra_body={"ignore_eos": True, "temperature": 1.0, "seed": 40},
    )
    assert resp.usage is not None
    assert ex.prefill_shared_tokens - before == 2 * (resp.usage.prompt_tokens - 1)
    texts = [c.text for c in resp.choices]
    assert texts == [_one(client, 40 + i, prompt) for i in range(3)]
    assert len(set(texts)) > 1
    wait_idle(served[1])


def test_greedy_choices_are_the_same_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count: one two"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2)  # type: ignore[arg-type]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert [c.message.content for c in resp.choices] == [one.choices[0].message.content] * 2


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_add_up_to_the_whole_ones(
    served: tuple[str, ServerState], chat: bool
) -> None:
    url, state = served
    sampling = {"temperature": 1.0, "seed": 7, "ignore_eos": True, "max_tokens": 10, "n": 3}
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "Once upon", "logprobs": 1}
    body = {"model": MODEL, **body, **sampling}
    whole = httpx.post(url + path, json=body, timeout=30).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + path, json=stream, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events: list[dict[str, Any]] = [json.loads(line[6:]) for line in lines[:-1]]
    texts = dict.fromkeys(range(3), "")
    finals: dict[int, dict[str, Any]] = {}
    tokens: dict[int, list[str]] = {i: [] for i in range(3)}
    for e in events[:-1]:
        (choice,) = e["choices"]
        i = choice["index"]
        piece = choice["delta"].get("content") if chat else choice["text"]
        texts[i] += piece or ""
        if choice["logprobs"]:
            tokens[i] += choice["logprobs"]["tokens"]
        if choice["finish_reason"]:
            assert i not in finals  # one finish chunk per choice
            finals[i] = e
    assert sorted(finals) == [0, 1, 2]
    assert all("duetime" in f for f in finals.values())
    for c in whole["choices"]:
        i = c["index"]
        assert texts[i] == (c["message"]["content"] if chat else c["text"])
        if not chat:  # each chunk carried its own choice's tokens
            assert tokens[i] == c["logprobs"]["tokens"]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 30 == whole["usage"]["completion_tokens"]
    wait_idle(state)


def test_a_client_gone_mid_stream_frees_every_choice(served: tuple[str, ServerState]) -> None:
    url, state = served
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
        "n": 4,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]
        assert any(line.startswith("data: ") for line in got)
        assert state.engine.stats.running + state.engine.stats.waiting >= 2
    wait_idle(state)


def test_too_many_choices_are_refused_and_admission_judges_each() -> None:
    """n counts against the queue: a server with room for two more sequences refuses
    n = 3 outright (429, nothing queued) and serves n = 2."""
    state = tiny_state(max_waiting=2)
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "n": 17}, timeout=30)
        assert r.status_code == 400
        assert "n" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "n": 3}, timeout=30)
        assert r.status_code == 429, r.text
        assert "choice 3 of 3" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "n": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        wait_idle(state)
