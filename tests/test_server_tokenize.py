"""vLLM's /tokenize and /detokenize: the server's own tokenizer, without a forward pass.
A client counts a prompt's tokens against the context or a deadline before sending it;
the counts must be those the answers' ``usage`` reports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.codec import ByteCodec

TOOLS = [{"type": "function", "function": {"name": "stop_arm"}}]


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[TestClient, str]]:
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096)
    m, codec, name = load_served_model(options)
    with TestClient(create_app(build_state(options, m, codec, name))) as c:
        yield c, name


def test_a_prompt_counts_as_the_completion_counts_it(client: tuple[TestClient, str]) -> None:
    c, name = client
    prompt = "Grip the cup: é"
    tok = c.post("/tokenize", json={"model": name, "prompt": prompt}).json()
    answer = c.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 1})
    assert tok["count"] == len(tok["tokens"]) == answer.json()["usage"]["prompt_tokens"]
    assert tok["max_model_len"] > tok["count"]
    assert tok["token_strs"] is None
    bare = c.post(
        "/tokenize", json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert bare["tokens"] == tok["tokens"][1:]  # without BOS
    assert bare["tokens"][0] == ord("G") + ByteCodec.OFFSET
    assert len(bare["token_strs"]) == bare["count"]
    back = c.post("/detokenize", json={"model": name, "tokens": bare["tokens"]}).json()
    assert back == {"prompt": prompt}


def test_messages_count_as_the_chat_route_counts_them(client: tuple[TestClient, str]) -> None:
    c, name = client
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Stop."}]
    for extra in (
        {},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": "none"},
    ):
        tok = c.post("/tokenize", json={"messages": turns, **extra}).json()
        chat = c.post(
            "/v1/chat/completions",
            json={"model": name, "messages": turns, "max_tokens": 1, **extra},
        )
        assert chat.status_code == 200, chat.text
        assert tok["count"] == chat.json()["usage"]["prompt_tokens"], extra
    shown = c.post(
        "/tokenize", json={"messages": turns, "tools": TOOLS, "tool_choice": "required"}
    ).json()["count"]
    plain = c.post("/tokenize", json={"messages": turns}).json()["count"]
    assert shown > plain  # the forced call's tools are part of the prompt


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            400,
            "not both",
        ),
        ("/tokenize", {}, 400, "give a prompt or messages: neither is here"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [ByteCodec.vocab_size]}, 400, "tokens must be <"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_input_is_a_4xx_naming_it(
    client: tuple[TestClient, str], path: str, body: dict[str, Any], status: int, words: str
) -> None:
    c, _ = client
    r = c.post(path, json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.text
    metrics = c.get("/metrics").text
    route = path
    assert f'duetime_http_responses_total{{route="{route}",status="{status}"}}' in metrics
