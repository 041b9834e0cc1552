"""The gateway's own answers, in process in front of fake backends: bodies no backend
could read answered with the server's 400s (a deeply nested body was a 500) and counted
in /metrics (a 400 was missing there), OpenAI's ``models.retrieve`` and HEAD probes,
and transport errors told in words."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from duetime.server.gateway import Gateway, GatewayConfig
from tests.gateway_fakes import MODEL, FakeBackend, Fate, call
from tests.gateway_runs import outcome, request_body, with_fakes


def test_a_refused_body_is_counted_inmetrics() -> None:
    """/metrics counted every outcome but a 400 for a bad body (the sum fell short)."""

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", request_body(max_tokens=10**12))
        assert seen.status == 400
        seen = await call(app, "POST", "/v1/completions", b"{not json")
        assert seen.status == 400
        assert outcome(gw, "http_400") == 2

    asyncio.run(with_fakes([FakeBackend("b0")], GatewayConfig(), scenario))


@pytest.mark.parametrize(
    ("body", "headers", "words"),
    [
        # nested past Python's recursion limit: json.loads raised RecursionError, a 500
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested not too deeply"),
        (b"", None, "the body is empty"),
        (b"[1, 2]", None, "the body must be a JSON object"),
        # curl's plain -d: the server refuses it, and the gateway relayed it (a 200)
        (request_body(), {"content-type": "application/x-www-form-urlencoded"}, "Content-Type"),
    ],
)
def test_a_body_no_backend_could_read_is_the_servers_400(
    body: bytes, headers: dict[str, str] | None, words: str
) -> None:
    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", body, headers=headers)
        assert seen.status == 400, seen.body
        error = json.loads(seen.body)["error"]
        assert words in error["message"]
        assert error["type"] == "invalid_request_error"
        assert outcome(gw, "http_400") == 1

    asyncio.run(with_fakes([FakeBackend("b0")], GatewayConfig(), scenario))


def test_the_gateway_answers_models_retrieve_and_head_probes() -> None:
    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "GET", f"/v1/models/{MODEL}")
        assert seen.status == 200, seen.body
        assert json.loads(seen.body)["id"] == MODEL
        seen = await call(app, "GET", "/v1/models/gpt-4")
        assert seen.status == 404
        assert json.loads(seen.body)["error"]["code"] == "model_not_found"
        assert (await call(app, "HEAD", "/health")).status == 200
        seen = await call(app, "GET", "/v1/completions")
        assert seen.status == 405
        assert "use POST" in json.loads(seen.body)["error"]["message"]

    asyncio.run(with_fakes([FakeBackend("b0")], GatewayConfig(), scenario))


def test_a_transport_error_is_told_in_words_not_class_names() -> None:
    """A client read "failed: _UnansweredError: ..." and "(RemoteProtocolError)"."""
    from duetime.server.gateway_wire import _head_error, transport_words

    reset = _head_error(ConnectionResetError(104, "Connection reset by peer"))
    assert transport_words(reset) == "Connection reset by peer"
    assert transport_words(httpx.RemoteProtocolError("")) == "the answer broke HTTP"
    assert transport_words(httpx.ConnectTimeout("")) == "no connection in time"

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", request_body())
        assert seen.status == 502, seen.body
        message = json.loads(seen.body)["error"]["message"]
        assert "closed before the headers" in message
        assert "Error" not in message

    broken = [FakeBackend(f"b{i}", fates=[Fate("break_before")]) for i in range(2)]
    asyncio.run(with_fakes(broken, GatewayConfig(health_interval_s=60.0), scenario))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "x"),
        ("max_tokens", 0),
        ("deadline_ms", -5),
        ("priority", 1.5),
        ("stream", "yes"),
        ("model", 3),
    ],
)
def test_a_field_the_gateway_reads_is_typed_as_a_backend_would(field: str, value: object) -> None:
    """Read leniently, a wrong type was relayed for the backend to refuse, or answered
    503 when none was up: now the 400 a backend gives, naming the field."""

    async def scenario(app: Any, gw: Gateway) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hi", field: value}).encode()
        seen = await call(app, "POST", "/v1/completions", body)
        assert seen.status == 400, seen.body
        assert json.loads(seen.body)["error"]["param"] == field

    down = FakeBackend("b0", down=(0.0, 1e9))  # no backend up: it was a 503
    asyncio.run(with_fakes([down], GatewayConfig(health_interval_s=60.0), scenario))


def test_null_fields_are_the_defaults_at_the_gateway() -> None:
    async def scenario(app: Any, gw: Gateway) -> None:
        nulls = dict.fromkeys(("max_tokens", "deadline_ms", "priority", "stream"))
        body = json.dumps({"model": MODEL, "prompt": "hi", **nulls}).encode()
        assert (await call(app, "POST", "/v1/completions", body)).status == 200

    asyncio.run(with_fakes([FakeBackend("b0")], GatewayConfig(), scenario))
