"""`duetime serve` and `duetime gateway` under SIGTERM (a rolling update, Ctrl-C).

Uvicorn's graceful shutdown closes the listening socket, waits for open
connections, and only then runs the app's lifespan end, which stops the
engine; this pins that order, which an engine stopped from a signal handler
would break (every streamed answer cut with "server shutting down"). The wait
is bounded by ``--shutdown-timeout``: a client that sent half a request kept
either server running forever.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import httpx
import pytest

from duetime.server.ports import free_port
from tests.backend_procs import DUETIME, start_backend, wait_healthy

#: Headers and the start of a body that never comes: the connection stays open.
_HALF_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 100\r\n\r\n{"model":'
)


def test_sigterm_lets_a_streamed_answer_finish_then_exits() -> None:
    if not DUETIME.exists():
        pytest.skip("the duetime console script is not installed next to the interpreter")
    proc, url = start_backend()
    try:
        wait_healthy(proc, url)
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


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_half_sent_request_delays_shutdown_only_by_the_shutdown_timeout(command: str) -> None:
    if not DUETIME.exists():
        pytest.skip("the duetime console script is not installed next to the interpreter")
    port = free_port()
    cmd = [str(DUETIME), command, "--port", str(port), "--shutdown-timeout", "1"]
    if command == "serve":
        cmd += ["--model", "tiny", "--predictor", "none", "--threads", "1"]
    else:  # a gateway starts with its backend down; it probes on
        cmd += ["--backend", f"http://127.0.0.1:{free_port()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # a gateway with no backend up answers /health with 503: up is enough
            assert proc.poll() is None, f"{command} exited with {proc.returncode}"
            try:
                httpx.get(url + "/health", timeout=0.5, trust_env=False)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, f"{command} did not start"
                time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as half:
            half.sendall(_HALF_REQUEST)
            time.sleep(0.2)  # the server has read the headers
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) in (0, -signal.SIGTERM)  # without the bound: never
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
