"""A fake OpenAI-compatible server for the `duetime load` tests, and small helpers to
build a request plan and to invoke `duetime load`.

The fake server (FastAPI + uvicorn on a free loopback port, in a background
thread) streams a few tokens with small sleeps. Its answers depend only on
the order requests reach it, so counts are exact whatever the timing:
every 5th request (n % 5 == 4) gets 429, every 7th (n % 7 == 6, if not 429)
gets 500. A request asking for >= 1000 tokens streams one token a second, so
the drain timeout has something to cut off.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from duetime.cli import app
from duetime.server.load_workload import LoadRequest

runner = CliRunner()
TOKEN_SLEEP_S = 0.004


class FakeServer:
    """Counts requests, keeps their bodies, answers as the module docstring says."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.slo_headers: list[str | None] = []  # each request's x-slo-ttft-ms
        self.lock = threading.Lock()
        self.max_model_len: int | None = None
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.completions)

    def reset(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.slo_headers.clear()
        self.max_model_len: int | None = None  # listed in /v1/models where set

    async def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": "fake-model", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return {"object": "list", "data": [card]}

    async def completions(self, request: Request) -> Any:
        body = await request.json()
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(body)
            self.slo_headers.append(request.headers.get("x-slo-ttft-ms"))
        if n % 5 == 4:
            return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": "2"})
        if n % 7 == 6:
            return JSONResponse({"error": "boom"}, status_code=500)
        chat = "messages" in body
        tokens = min(int(body["max_tokens"]), 4)
        gap = 1.0 if body["max_tokens"] >= 1000 else TOKEN_SLEEP_S

        async def stream() -> AsyncIterator[str]:
            if chat:  # a role-only first chunk, as vLLM sends: not a token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(tokens):
                await asyncio.sleep(gap)
                part = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield _sse({"choices": [{"index": 0, **part}]})
            last: dict[str, Any] = {"choices": [], "usage": {"completion_tokens": tokens}}
            system = (chat and body["messages"][0]["role"] == "system") or (
                not chat and body["prompt"].startswith("SYS")
            )
            if system:  # a prefix cache served 8 of its 10 prompt tokens
                details = {"cached_tokens": 8}
                last["usage"].update(prompt_tokens=10, prompt_tokens_details=details)
            if "deadline_ms" in body:
                last["duetime"] = {"ttft_ms": 1.0, "e2e_ms": 20.0, "deadline_met": True}
            yield _sse(last)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def plan_requests(
    n: int, *, gap: float = 0.002, max_tokens: int = 4, **kw: Any
) -> list[LoadRequest]:
    return [
        LoadRequest(
            rid=i, arrival=i * gap, prompt=f"p{i}", prompt_len=4, max_tokens=max_tokens, **kw
        )
        for i in range(n)
    ]


def invoke_load(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, ["load", *args])
    return res.exit_code, res.output
