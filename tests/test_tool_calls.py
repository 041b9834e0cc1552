"""Forced tool calls: ``tool_choice`` "required" or a named function makes the chat
answer a call whose arguments fit the tool's schema, returned in OpenAI's shapes
(through the OpenAI SDK, whole and streamed), on the tiny random-weight model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.chat_template import render_chat
from duetime.server.schemas import ChatMessage, ToolDef
from duetime.server.threaded import serve_in_thread

TARGETS = ["cup", "plate", "bottle"]
MOVE = {
    "type": "function",
    "function": {
        "name": "move_arm",
        "description": "Move the arm to an object.",
        "parameters": {
            "type": "object",
            "properties": {"target": {"enum": TARGETS}, "fast": {"type": "boolean"}},
            "required": ["target", "fast"],
            "additionalProperties": False,
        },
    },
}
STOP = {"type": "function", "function": {"name": "stop_arm"}}
TOOLS = [MOVE, STOP]
ASK = [{"role": "user", "content": "Move to the cup."}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, seed=1)
    m, codec, name = load_served_model(options)
    with serve_in_thread(create_app(build_state(options, m, codec, name))) as url:
        yield url, name


@pytest.fixture(scope="module")
def client(served: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def _fits(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "stop_arm":
        return args == {}
    return (
        set(args) == {"target", "fast"}
        and args["target"] in TARGETS
        and (isinstance(args["fast"], bool))
    )


NAMED = {"type": "function", "function": {"name": "move_arm"}}


def _ask(client: openai.OpenAI, name: str, tool_choice: Any, **fields: Any) -> Any:
    """A chat request for the move to the cup, the tools offered and ``tool_choice``."""
    return client.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, tool_choice=tool_choice, **fields
    )  # type: ignore[call-overload]


def test_a_named_function_is_called_with_arguments_that_fit_its_schema(
    client: openai.OpenAI, served: tuple[str, str]
) -> None:
    choice = _ask(client, served[1], NAMED, max_tokens=60).choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "move_arm"  # type: ignore[union-attr]
    assert _fits("move_arm", call.function.arguments)  # type: ignore[union-attr]
    # the same call streamed: one tool-call delta with the whole call, then the finish
    chunks = list(_ask(client, served[1], NAMED, max_tokens=60, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices]
    sent = [d for d in deltas if d]
    assert len(sent) == 1
    streamed = sent[0][0]
    assert streamed.index == 0
    assert streamed.function.name == "move_arm"  # type: ignore[union-attr]
    assert streamed.function.arguments == call.function.arguments  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_makes_calls_to_the_tools_and_one_without_parallel_calls(
    client: openai.OpenAI, served: tuple[str, str]
) -> None:
    choice = _ask(client, served[1], "required", parallel_tool_calls=False, max_tokens=80)
    choice = choice.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    fn = calls[0].function  # type: ignore[union-attr]
    assert fn.name in ("move_arm", "stop_arm")
    assert _fits(fn.name, fn.arguments)
    # the ids of several choices' calls differ, each a call of its own
    r = _ask(
        client,
        served[1],
        "required",
        parallel_tool_calls=False,
        max_tokens=80,
        n=2,
        temperature=1.0,
        seed=3,
    )
    ids = [c.message.tool_calls[0].id for c in r.choices]  # type: ignore[index]
    assert len(set(ids)) == 2


def test_an_answer_cut_by_max_tokens_comes_back_as_text(
    client: openai.OpenAI, served: tuple[str, str]
) -> None:
    for stream in (False, True):
        r = _ask(client, served[1], NAMED, max_tokens=5, stream=stream)
        if stream:
            chunks = [c for c in r if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
            assert r.choices[0].message.tool_calls is None
        assert reason == "length"
        assert text == '{"tar'  # a byte a token


def test_streamed_logprobs_of_a_tool_call_cover_every_token(served: tuple[str, str]) -> None:
    url, name = served
    body = {
        "model": name,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "stop_arm"}},
        "max_tokens": 30,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x[6:] not in ("", "[DONE]")]
    entries = [
        e
        for ev in events
        for ch in ev["choices"]
        for e in ((ch.get("logprobs") or {}).get("content") or [])
    ]
    calls = [
        ch["delta"]["tool_calls"]
        for ev in events
        for ch in ev["choices"]
        if ch["delta"].get("tool_calls")
    ]
    assert calls[0][0]["function"] == {"name": "stop_arm", "arguments": "{}"}
    assert len(entries) == events[-1]["usage"]["completion_tokens"] == 2  # "{" "}"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": TOOLS}, "tool_choice", "'auto' is not supported"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "'auto' is not supported"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [MOVE, MOVE], "tool_choice": "required"}, "tools", "move_arm is given twice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
            "no tool is named 'fly'",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            None,
            "one constraint",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
            "tools.0.function.name",
            "",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "messages": [{"role": "assistant", "content": None}],
            },
            "messages.0",
            "needs content",
        ),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_the_field(
    served: tuple[str, str], fields: dict[str, Any], param: str | None, words: str
) -> None:
    url, name = served
    body = {"model": name, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err


def test_tools_ignored_with_none_and_a_conversation_with_calls_goes_on(
    served: tuple[str, str],
) -> None:
    url, name = served
    body = {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    assert isinstance(r["choices"][0]["message"]["content"], str)
    assert "tool_calls" not in r["choices"][0]["message"]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "move_arm", "arguments": '{"target": "cup", "fast": true}'},
    }
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "arrived"},
        {"role": "user", "content": "Now stop."},
    ]
    body = {
        **body,
        "messages": turns,
        "tool_choice": "required",
        "max_tokens": 80,
        "parallel_tool_calls": False,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_the_prompt_shows_the_tools_and_the_calls_made() -> None:
    turns = [
        ChatMessage(role="user", content="Move to the cup."),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "function": {"name": "move_arm", "arguments": '{"fast": true}'}}
                ],
            }
        ),
        ChatMessage(role="tool", content="arrived", tool_call_id="c"),
    ]
    text = render_chat(turns, [ToolDef.model_validate(t) for t in TOOLS])
    lines = text.split("\n")
    assert lines[0].startswith('Tool available: {"name": "move_arm", "description": "Move')
    assert lines[1] == 'Tool available: {"name": "stop_arm"}'
    assert lines[2:] == [
        "User: Move to the cup.",
        'Assistant: [{"name": "move_arm", "arguments": "{\\"fast\\": true}"}]',
        "Tool: arrived",
        "Assistant:",
    ]
    assert render_chat(turns[:1]) == "User: Move to the cup.\nAssistant:"  # no tools shown
