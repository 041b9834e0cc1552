"""End-to-end tests of `duetime serve` on a tiny random-weight model, through the openai
client: what an answer holds. Timing and deadlines, streaming against the one-shot
answer, seeded sampling, logprobs, stop strings and stop token ids, logit_bias, the
default max_tokens, echo, a client that disconnects, and the prompt tokens the prefix
cache served. These share one server (the module-scoped ``served`` and ``client``
fixtures).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from duetime.server.app import ServerState, create_app
from duetime.server.codec import ByteCodec
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, tiny_state, wait_idle


def test_completion_reports_timing_and_meets_deadline(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=6,
        extra_body={"deadline_ms": 60_000, "priority": 3, "ignore_eos": True},
    )
    body = resp.to_dict()
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens == len("Hello there") + 1  # bytes + BOS
    timing = body["duetime"]
    assert timing["deadline_met"] is True
    assert 0 < timing["ttft_ms"] <= timing["e2e_ms"]
    assert timing["predicted_tokens"] == 6  # ignore_eos: the length is known exactly
    wait_idle(served[1])


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    """Greedy decoding: the streamed deltas concatenate to the one-shot answer."""
    messages = [{"role": "user", "content": "Count: one two"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    text = whole.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert "duetime" in finals[0].to_dict()
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_sampling_is_seeded_per_request_and_greedy_stays_the_default(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    def answer(stream: bool = False, **sampling: object) -> str:
        kw = {"model": MODEL, "prompt": "Once upon", "max_tokens": 16}
        extra = {"ignore_eos": True, **sampling}
        if not stream:
            return client.completions.create(**kw, extra_body=extra).choices[0].text  # type: ignore[call-overload,no-any-return]
        chunks = client.completions.create(**kw, stream=True, extra_body=extra)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices)

    greedy = answer()
    assert answer(temperature=0, top_p=0.5, seed=3) == greedy  # temperature 0: the arg-max
    seeded = answer(temperature=1.0, seed=42)
    assert seeded != greedy
    assert answer(temperature=1.0, seed=42) == seeded
    assert answer(stream=True, temperature=1.0, seed=42) == seeded
    assert answer(temperature=1.0, seed=43) != seeded
    assert answer(temperature=1.0, top_k=1, seed=43) == greedy  # top_k 1: the arg-max
    assert answer(temperature=1.0, min_p=1.0, seed=43) == greedy  # only the likeliest left
    penalised = answer(frequency_penalty=2.0, repetition_penalty=1.5)
    assert penalised != greedy
    assert answer(frequency_penalty=2.0, repetition_penalty=1.5) == penalised  # still greedy
    assert answer(presence_penalty=0, frequency_penalty=0, repetition_penalty=1) == greedy
    wait_idle(served[1])
    assert not served[1].engine.executor.samplers  # each one left with its request


@pytest.mark.parametrize("stop", [None, "a"])
def test_completion_logprobs_cover_the_answer_streamed_or_not(
    served: tuple[str, ServerState], stop: str | None
) -> None:
    url, state = served
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 24, "logprobs": 2, "stop": stop}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]  # the pieces make up the text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    if stop is None:
        assert len(lp["tokens"]) == whole["usage"]["completion_tokens"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy: the likeliest token
        assert 1 <= len(top) <= 3
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [v for p in parts for v in p["token_logprobs"]] == lp["token_logprobs"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]
    wait_idle(state)


def test_chat_logprobs_list_the_top_tokens(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: one two"}],
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert bytes(t.bytes or []) == t.token.encode()
        assert len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count: one two"}], max_tokens=12
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == resp.choices[0].message.content


def test_stop_token_ids_end_the_answer_with_that_token(served: tuple[str, ServerState]) -> None:
    """vLLM's stop_token_ids: the answer ends at (and holds) the first such token past
    min_tokens, as "stop", even with ignore_eos."""
    from duetime.engine.generate import greedy_generate

    url, state = served
    ids = greedy_generate(state.engine.executor.model, [state.codec.encode("Hello there")], 16)[0]
    k = max(i for i in range(16) if ids[i] not in ids[:i])  # the last first occurrence
    assert k >= 2  # (5 on this model) else the cut says little
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    cut = httpx.post(
        url + "/v1/completions", json={**body, "stop_token_ids": [ids[k]]}, timeout=30
    ).json()
    assert cut["usage"]["completion_tokens"] == k + 1
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert full["choices"][0]["text"].startswith(cut["choices"][0]["text"])
    later = httpx.post(
        url + "/v1/completions",
        json={**body, "stop_token_ids": [ids[k]], "min_tokens": k + 2},
        timeout=30,
    ).json()
    assert later["usage"]["completion_tokens"] > k + 1  # not before min_tokens
    wait_idle(state)


def test_stop_string_cuts_the_answer(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=24, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    probe = next((i for i in range(2, len(full) - 2) if full.find(full[i : i + 2]) == i), None)
    if probe is None:
        pytest.skip("the random model's answer repeats itself: no unique stop string")
    stop = full[probe : probe + 2]
    cut = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=24, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == full[:probe]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=24,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:probe]


def test_an_answer_ended_by_a_stop_string_is_complete(served: tuple[str, ServerState]) -> None:
    """Its deadline is judged and it counts as "stop" (it was an "abort" and a missed deadline)."""
    url, state = served
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 24, "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[:2]
    if not stop.isascii():
        pytest.skip("the random model's answer starts with a partial character")
    metrics = state.metrics
    aborts, stops = (metrics.requests.labels(r)._value.get() for r in ("abort", "stop"))
    r = httpx.post(
        url + "/v1/completions", json={**body, "stop": [stop], "deadline_ms": 60_000}
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == ""
    assert r["duetime"]["deadline_met"] is True
    assert r["usage"]["completion_tokens"] <= len(stop)  # nothing generated after the stop
    wait_idle(state)
    assert metrics.requests.labels("abort")._value.get() == aborts
    assert metrics.requests.labels("stop")._value.get() == stops + 1


def test_logit_bias_steers_the_answer(served: tuple[str, ServerState]) -> None:
    """OpenAI's logit_bias: +100 on one token makes the random model say only it;
    -100 on the greedy answer's first token makes it start with another."""
    url, state = served
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 6, "ignore_eos": True}
    z = ord("z") + ByteCodec.OFFSET
    r = httpx.post(url + "/v1/completions", json={**body, "logit_bias": {str(z): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "z" * 6
    plain = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    first = str(plain.encode()[0] + ByteCodec.OFFSET)
    banned = httpx.post(url + "/v1/completions", json={**body, "logit_bias": {first: -100}})
    assert banned.json()["choices"][0]["text"][0] != plain[0]
    for bad, words in [
        ({"x": 1}, "token ids"),
        ({"05": 1}, "token ids"),
        ({"5": 100.5}, "[-100, 100]"),
        ({"5": True}, "logit_bias"),
        ({str(ByteCodec.vocab_size): 1}, "must be <"),
    ]:
        r = httpx.post(url + "/v1/completions", json={**body, "logit_bias": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].startswith("logit_bias"), r.text
        assert words in r.json()["error"]["message"], r.text
    wait_idle(state)


def test_a_chat_answer_starts_at_its_first_non_space_character(
    served: tuple[str, ServerState],
) -> None:
    """The transcript's ``Assistant:`` is continued with a space: a chat answer leaves
    it out (streamed or not), a completion keeps every character it generated."""
    url, state = served
    space = str(ord(" ") + ByteCodec.OFFSET)
    bias = {"logit_bias": {space: 100}, "max_tokens": 3, "ignore_eos": True, "model": MODEL}
    chat = {**bias, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ""
    assert r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(url + "/v1/completions", json={**bias, "prompt": "hi"})
    assert r.json()["choices"][0]["text"] == "   "
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any(c["choices"][0]["delta"].get("content") for c in events)
    wait_idle(state)


def test_chat_without_max_tokens_fits_what_the_context_leaves(
    served: tuple[str, ServerState],
) -> None:
    """The default cap (256) shrinks to the room left, as vLLM's does, instead of a 400."""
    url, state = served
    context = state.config.max_context
    content = "y" * (context - 60)  # one token per byte: ~40 tokens of room with the template
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(url + "/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == context
    full = {"model": MODEL, "messages": [{"role": "user", "content": "y" * context}]}
    r = httpx.post(url + "/v1/chat/completions", json=full)
    assert r.status_code == 400
    assert "leaves no room" in r.json()["error"]["message"]
    wait_idle(state)


def test_echo_repeats_a_token_id_prompt(served: tuple[str, ServerState]) -> None:
    url, state = served
    ids = state.codec.encode("abc")
    body = {"model": MODEL, "max_tokens": 3, "echo": True}
    by_ids = httpx.post(url + "/v1/completions", json={**body, "prompt": ids}).json()
    by_text = httpx.post(url + "/v1/completions", json={**body, "prompt": "abc"}).json()
    assert by_ids["choices"][0]["text"].startswith("abc")
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_client_disconnect_frees_the_sequence(served: tuple[str, ServerState]) -> None:
    url, state = served
    before = state.metrics.requests.labels("abort")._value.get()
    body = {"model": MODEL, "prompt": "go", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert state.engine.stats.running + state.engine.stats.waiting >= 1
    wait_idle(state)
    assert state.metrics.requests.labels("abort")._value.get() == before + 1


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(
    client: openai.OpenAI, served: tuple[str, ServerState]
) -> None:
    """The second chat with the same long system prompt reports the cached prompt
    tokens in usage (OpenAI's prompt_tokens_details) and in /metrics, and answers as
    the first one would have without the cache."""
    url, state = served
    system = {"role": "system", "content": "You are a careful robot arm. " * 8}
    ask = [system, {"role": "user", "content": "Pick up the red cube."}]
    first = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8)
    second = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8)
    assert first.usage is not None
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    # every whole 16-token block but those holding the last 32 tokens (SnapKV's window)
    assert details.cached_tokens == (second.usage.prompt_tokens - 32) // 16 * 16 > 200
    assert second.choices[0].message.content == first.choices[0].message.content
    text = httpx.get(url + "/metrics").text
    hits = next(ln for ln in text.splitlines() if ln.startswith("duetime_prefix_cache_hits_total"))
    assert float(hits.split()[-1]) >= details.cached_tokens
    assert "duetime_prefix_cache_tokens " in text
    wait_idle(state)

    off = tiny_state(prefix_cache_tokens=0)
    with serve_in_thread(create_app(off)) as url_off:
        plain = openai.OpenAI(base_url=url_off + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            again = plain.chat.completions.create(model=MODEL, messages=ask, max_tokens=8)
            assert again.usage is not None
            assert again.usage.prompt_tokens_details is not None
            assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == first.choices[0].message.content
