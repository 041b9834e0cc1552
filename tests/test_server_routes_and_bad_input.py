"""End-to-end tests of `duetime serve` on a tiny random-weight model: its routes and
what it does with bad input. /health, /v1/models, /metrics and the OpenAPI schema,
trailing slashes, responses counted by route and status, malformed or out-of-range
bodies answered with a 4xx error object, the neutral values of refused fields accepted,
and fuzzed bodies that never crash the server or leak KV. These share one server (the
module-scoped ``served`` fixture).
"""

from __future__ import annotations

import json

import httpx
import pytest

from duetime.server.app import ServerState
from tests.served import MODEL, wait_idle


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


def test_routes_answer_as_clients_ask(served: tuple[str, ServerState]) -> None:
    """OpenAI's ``models.retrieve`` (GET /v1/models/ID) was a 404; HEAD /health a 405;
    an unknown route or method said only "Not Found" / "Method Not Allowed"."""
    url = served[0]
    r = httpx.get(f"{url}/v1/models/{MODEL}")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == MODEL
    r = httpx.get(url + "/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert httpx.head(url + "/health").status_code == 200
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no route GET /v1/nothing"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["message"] == "GET /v1/completions: method not allowed; use POST"


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
        # pydantic's own words named nothing a client wrote: "body: Field required",
        # "Input should be a valid dictionary", "at least 1 item after validation"
        (b"", 400, "the body is empty"),
        (b"[1, 2]", 400, "the body must be a JSON object"),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": [""]}).encode(), 400, "non-empty"),
        # the two names of one field with two values: one was ignored without a word
        (
            json.dumps(
                {"model": MODEL, "prompt": "x", "deadline_ms": 5000, "time_budget_ms": 1}
            ).encode(),
            400,
            "the same field under two names",
        ),
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


def test_a_body_sent_without_a_json_content_type_is_named(
    served: tuple[str, ServerState],
) -> None:
    """curl's -d sends a form: "body: Input should be a valid dictionary or object"."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1})
    r = httpx.post(served[0] + "/v1/completions", content=body)
    assert r.status_code == 400, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]


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
        # pydantic said "messages.0.content.0.text: Field required"
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0: 'image_url' content parts are not supported",
        ),
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


def test_null_is_the_default_of_an_optional_field(served: tuple[str, ServerState]) -> None:
    """OpenAI's API takes null for its optional fields and clients send it; each of these
    was a 400 ("Input should be a valid integer"). A required field's null is refused."""
    url, state = served
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty"))
    text = {"model": MODEL, "prompt": "ab", "max_tokens": None, "echo": None, **nulls}
    r = httpx.post(url + "/v1/completions", json=text, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16  # the default max_tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **nulls}
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": None}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    wait_idle(state)


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
