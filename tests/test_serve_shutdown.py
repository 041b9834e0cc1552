"""`duetime serve` under SIGTERM (a rolling update, Ctrl-C): answers in flight finish whole.

Uvicorn's graceful shutdown closes the listening socket, waits for open
connections, and only then runs the app's lifespan end, which stops the
engine; this pins that order, which an engine stopped from a signal handler
would break (every streamed answer cut with "server shutting down").
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.test_gateway import DUETIME, _start_backend, _wait_healthy


def test_sigterm_lets_a_streamed_answer_finish_then_exits() -> None:
    if not DUETIME.exists():
        pytest.skip("the duetime console script is not installed next to the interpreter")
    proc, url = _start_backend()
    try:
        _wait_healthy(proc, url)
        body = {
            "model": "duetime-tiny",
            "prompt": "hi",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[dict] = []
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, timeout=60, trust_env=False
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    events.append({"done": True})
                    break
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == {"done": True}
        assert not any("error" in e for e in events), events[-3:]
        finals = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
        assert events[-2]["usage"]["completion_tokens"] == 1000
        # SIGTERM is re-raised once the shutdown is done (uvicorn): killed by it, or 0
        assert proc.wait(30) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2, trust_env=False)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
