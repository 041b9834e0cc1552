"""The gateway over two real Gemma 3 270M `duetime serve` backends, one thread each.

What the tiny-model tests cannot show: real step times behind the routers, the
published metrics of a loaded engine, and a TTFT bound refused at once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections import Counter

import httpx
import pytest

from duetime.server.gateway import GatewayConfig, create_gateway_app
from duetime.server.ports import free_port
from duetime.server.threaded import serve_in_thread
from tests.backend_procs import DUETIME, wait_healthy

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def _start_gemma() -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(DUETIME), "serve", "--model", "gemma", "--port", str(port), "--threads", "1"]
    cmd += ["--predictor", "none", "--log-level", "warning"]
    cmd += ["--max-num-seqs", "4", "--max-batch-tokens", "256"]  # given: no start-up sizing
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def test_a_gateway_over_two_gemma_backends_routes_answers_and_refuses() -> None:
    if not DUETIME.exists():
        pytest.skip("the duetime console script is not installed next to the interpreter")
    started = [_start_gemma(), _start_gemma()]
    try:
        for proc, url in started:
            wait_healthy(proc, url, timeout=240.0)
        urls = [u for _, u in started]
        config = GatewayConfig(max_inflight=2, health_interval_s=0.2, request_timeout_s=120.0)
        with serve_in_thread(create_gateway_app(urls, config)) as gw:
            body = {"model": "gemma-3-270m", "prompt": "The capital of France is",
                    "max_tokens": 8, "ignore_eos": True}  # fmt: skip

            async def send(n: int) -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120.0, trust_env=False) as c:
                    return list(
                        await asyncio.gather(
                            *(c.post(gw + "/v1/completions", json=body) for _ in range(n))
                        )
                    )

            answers = asyncio.run(send(6))
            assert [r.status_code for r in answers] == [200] * 6
            assert all(r.json()["usage"]["completion_tokens"] == 8 for r in answers)
            went = Counter(r.headers["x-duetime-backend"] for r in answers)
            assert set(went) == set(urls)  # 6 requests, 2 slots each: both took some
            assert all(float(r.headers["x-duetime-forecast-ms"]) > 0 for r in answers)
            # a first token due in 1 ms: no backend's forecast meets it, refused at once
            r = httpx.post(gw + "/v1/completions", json=body, headers={"x-slo-ttft-ms": "1"},
                           timeout=30.0, trust_env=False)  # fmt: skip
            assert r.status_code == 429
            assert int(r.headers["retry-after"]) >= 1
            health = httpx.get(gw + "/health", timeout=10.0, trust_env=False).json()
            kinds = [b["metrics"]["kind"] for b in health["backends"]]
            assert kinds == ["duetime", "duetime"], health
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
