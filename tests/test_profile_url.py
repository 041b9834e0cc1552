"""`duetime profile --url`: the step-cost model of an OpenAI-compatible server, black-box."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.core.cost import LinearStepCost
from duetime.server.app import create_app
from duetime.server.ports import free_port
from duetime.server.probe_http import StreamTiming, base_url, discover, negotiate
from duetime.server.probe_profile import ProbeGrid, decode_samples
from duetime.server.threaded import serve_in_thread
from duetime.sim.profiles import load_profile
from tests.served import tiny_state

#: A grid small enough for a test on a busy 2-core machine (the CLI's --quick is larger).
TINY_GRID = ProbeGrid(prompts=(8, 24, 48), concurrencies=(2, 3), output_tokens=8, reps=3)


def _fake(*, refuse_ignore_eos: bool) -> FastAPI:
    """An OpenAI-compatible server that streams one token an event at a fixed pace:
    2 ms + 20 µs a prompt word to the first token, then 3 ms a token. With
    ``refuse_ignore_eos`` it answers 400 to a body with ``ignore_eos``, as a strict
    server does."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []
    app.state.seen = seen

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        if refuse_ignore_eos and "ignore_eos" in body:
            err = {"message": "ignore_eos: extra inputs are not permitted", "type": "bad"}
            return JSONResponse({"error": err}, status_code=400)
        words = len(str(body["prompt"]).split()) + 1
        n = int(body["max_tokens"])

        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.002 + 2e-5 * words)
            for _ in range(n):
                yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                await asyncio.sleep(0.003)
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": words, "completion_tokens": n}
                yield ("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_decode_samples_read_steps_off_streams_sent_together() -> None:
    # two streams, one token every 10 ms from t=1.0 (20 tokens each), prompts of 100
    ev = [1.0 + 0.01 * k for k in range(20)]
    group = [StreamTiming(0.9, list(ev)), StreamTiming(0.95, list(ev))]
    got = decode_samples(group, [100, 100], [20, 20], splits=2)
    assert len(got) == 2
    for s in got:
        assert s.decode_seqs == 2
        assert s.kind == "decode"
        assert s.prefill_tokens == 0
        assert s.seconds == pytest.approx(0.01)
    assert got[0].kv_tokens < got[1].kv_tokens  # the cache grows over the window
    assert got[0].kv_tokens == pytest.approx(2 * (100 + 1 + 19 / 4), abs=1)
    # a server sending 4 tokens an event: the same mean step
    batched = [StreamTiming(0.9, [1.0 + 0.04 * k for k in range(5)]) for _ in range(2)]
    got = decode_samples(batched, [100, 100], [17, 17], splits=1)
    assert [round(s.seconds, 6) for s in got] == [0.01]
    # streams that never decode together give nothing
    apart = [StreamTiming(0, [1.0, 1.1]), StreamTiming(0, [2.0, 2.1])]
    assert decode_samples(apart, [10, 10], [2, 2]) == []


def test_urls_as_users_paste_them() -> None:
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert base_url(" http://h:1 ") == "http://h:1"
    assert base_url("http://h:1/api/v1") == "http://h:1/api"


def test_a_refused_ignore_eos_is_dropped_and_probing_goes_on(tmp_path: Path, monkeypatch) -> None:
    fake = _fake(refuse_ignore_eos=True)
    with serve_in_thread(fake) as url:
        with httpx.Client(trust_env=False) as client:
            info = negotiate(client, discover(client, url + "/v1"), "1 hello")
        assert "ignore_eos" not in info.extras
        assert "stream_options" in info.extras
        monkeypatch.setattr(ProbeGrid, "quick", classmethod(lambda cls: TINY_GRID))
        out, report = tmp_path / "fake.json", tmp_path / "report.json"
        args = ["profile", "--url", url, "--quick", "--out", str(out), "--json", str(report)]
        res = CliRunner().invoke(cli_app, args)
    assert res.exit_code == 0, res.output
    assert "refused ignore_eos" in res.output
    # the report named too (whitespace dropped: a console folds a long path mid-name)
    assert f"wrote{out},{report}" in "".join(res.output.split())
    # one refusal each time the fields were negotiated (here, then by the CLI), no more
    assert sum("ignore_eos" in b for b in fake.state.seen) == 2
    profile = json.loads(out.read_text())
    assert profile["probe"]["ignore_eos"] is False
    assert json.loads(report.read_text())["ignore_eos"] is False
    LinearStepCost.from_profile(out)


@pytest.mark.parametrize("args", [("--served-model", "x"), ("--timeout", "5")])
def test_a_probe_option_without_url_is_refused(args: tuple[str, str]) -> None:
    """They were ignored, and the embedded engine was timed in their place."""
    res = CliRunner().invoke(cli_app, ["profile", "--quick", *args])
    assert res.exit_code == 2, res.output
    assert f"{args[0]}: only with --url (a server to probe)" in res.output


def test_profile_url_fits_a_tiny_duetime_serve(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ProbeGrid, "quick", classmethod(lambda cls: TINY_GRID))
    state = tiny_state()
    out, report = tmp_path / "tiny.json", tmp_path / "report.json"
    with serve_in_thread(create_app(state)) as url:
        args = ["profile", "--url", url, "--quick", "--out", str(out), "--json", str(report)]
        res = CliRunner().invoke(cli_app, args)
    assert res.exit_code == 0, res.output
    assert "held-out MAPE" in res.output
    cost = LinearStepCost.from_profile(out)
    assert cost.decode_step(4, 400) > 0
    assert cost.prefill_time(32) > 0
    assert cost.bands == ()  # a black box reports no kernel regimes
    profile = json.loads(out.read_text())
    assert profile["probe"]["ignore_eos"] is True
    assert profile["probe"]["usage_reported"]
    assert profile["heldout"]["batch_model_mape_pct"] is not None
    assert profile["noise_floor_pct"] is not None
    kinds = {m["decoders"] for m in profile["misses"]}
    assert kinds <= {"0", "1-32"}
    rep = json.loads(report.read_text())
    assert rep["batch_model_mape_pct"] == profile["heldout"]["batch_model_mape_pct"]
    assert rep["samples"] == profile["samples"] >= 8
    # the simulator runs on it
    load_profile(str(out))
    res = CliRunner().invoke(
        cli_app, ["sim", "--profile", str(out), "--requests", "20", "--rate", "2"]
    )
    assert res.exit_code == 0, res.output


def test_unreachable_and_foreign_servers_are_clear_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    dead = f"http://127.0.0.1:{free_port()}"
    res = runner.invoke(cli_app, ["profile", "--url", dead, "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 2
    assert dead in res.output
    assert "cannot reach" in res.output
    assert not (tmp_path / "p.json").exists()
    with serve_in_thread(FastAPI()) as url:  # answers 404 everywhere
        res = runner.invoke(cli_app, ["profile", "--url", url, "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 2
    assert f"{url} is not an OpenAI-compatible server" in res.output
    res = runner.invoke(cli_app, ["profile", "--url", "ftp://x", "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 2
    assert "--url must be" in res.output
