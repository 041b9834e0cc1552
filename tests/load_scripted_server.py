"""A fake OpenAI-compatible server whose answer to each request is scripted, and the
hypothesis strategy that draws those answers, for tests/test_load_generator_properties.py.

An :class:`Answer` says what the fake does with one request (streamed or whole, slow or
fast, HTTP errors, 429s, redirects, error events, malformed or cut-off streams, empty
answers, odd ``usage``) and what the client must make of it; :class:`ScriptedServer`
answers ``Request <rid>: ...`` as its script says, keeps every body, and records whether
duetime's own server would have accepted it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from hypothesis import strategies as st
from pydantic import ValidationError

from duetime.server.schemas import ChatCompletionRequest, CompletionRequest

KINDS = ("stream", "whole", "status", "error_event", "bad_chunk", "cut", "odd_choices")
RETRY_AFTER = [None, "2", "0", "0.5", "-1", "nan", "inf", "Wed, 21 Oct 2015 07:28:00 GMT"]


@dataclass(frozen=True)
class Answer:
    """What the fake server does with one request, and what the client must make of it."""

    kind: str
    tokens: int = 0  # text chunks streamed (whole: text or none)
    usage: Any = None  # usage.completion_tokens sent (None: no usage); may be nonsense
    done: bool = True  # the stream ends with "data: [DONE]" (else the body just ends)
    status: int = 200
    retry_after: str | None = None
    delay_s: float = 0.0  # before the answer starts
    gap_s: float = 0.0  # between chunks

    @property
    def usage_ok(self) -> bool:
        return isinstance(self.usage, int) and not isinstance(self.usage, bool) and self.usage >= 0

    def expected(self) -> tuple[str, int]:
        """(the outcome's status, its output tokens if ok)."""
        if self.kind == "status":
            return ("rejected" if self.status == 429 else "error"), 0
        if self.kind not in ("stream", "whole"):
            return "error", 0
        text_chunks = self.tokens if self.kind == "stream" else min(self.tokens, 1)
        return "ok", self.usage if self.usage_ok else text_chunks

    def retry_after_s(self) -> float | None:
        try:
            value = float(self.retry_after) if self.retry_after is not None else None
        except ValueError:
            return None
        return value if value is not None and math.isfinite(value) and value >= 0 else None


@st.composite
def answers(draw: Any) -> Answer:
    kind = draw(st.sampled_from(KINDS))
    status = 200
    if kind == "status":
        status = draw(st.sampled_from([204, 301, 302, 307, 400, 404, 413, 422, 429, 500, 503]))
    return Answer(
        kind=kind,
        tokens=draw(st.integers(0, 6)),
        usage=draw(st.one_of(st.none(), st.integers(0, 9), st.sampled_from([-1, True, 2.5, "3"]))),
        done=draw(st.booleans()),
        status=status,
        retry_after=draw(st.sampled_from(RETRY_AFTER)),
        delay_s=draw(st.sampled_from([0.0, 0.0, 0.002, 0.01])),
        gap_s=draw(st.sampled_from([0.0, 0.001, 0.004])),
    )


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ScriptedServer:
    """Answers request ``Request <rid>: ...`` as ``answers[rid]`` says; keeps every body and
    whether duetime's own server would have accepted it."""

    def __init__(self) -> None:
        self.answers: dict[int, Answer] = {}
        self.bodies: list[dict[str, Any]] = []
        self.refused: list[str] = []  # what duetime's schema says about bodies it would refuse
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.complete)
        self.app.post("/v1/chat/completions")(self.complete)

    def script(self, answers: dict[int, Answer]) -> None:
        with self.lock:
            self.answers = dict(answers)
            self.bodies.clear()
            self.refused.clear()

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def complete(self, request: Request) -> Any:
        body = await request.json()
        chat = "messages" in body
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            schema.model_validate(body)
        except ValidationError as e:
            self.refused.append(str(e))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        match = re.match(r"Request (\d+):", prompt)
        assert match, prompt
        with self.lock:
            self.bodies.append(body)
            answer = self.answers[int(match.group(1))]
        await asyncio.sleep(answer.delay_s)
        if answer.kind == "status":
            headers = {} if answer.retry_after is None else {"Retry-After": answer.retry_after}
            if answer.status == 204 or answer.tokens == 0:  # no body at all
                return Response(status_code=answer.status, headers=headers)
            # "[/INST]" (Llama 2's prompt format) in an error message is rich markup
            detail = {"error": "no [/INST]"} if answer.tokens % 2 else {"detail": "[/INST]"}
            return JSONResponse(detail, status_code=answer.status, headers=headers)
        usage = None if answer.usage is None else {"completion_tokens": answer.usage}
        if answer.kind == "whole":
            text = "w" * answer.tokens
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            whole: dict[str, Any] = {"choices": [{"index": 0, **choice}]}
            if usage is not None:
                whole["usage"] = usage
            return JSONResponse(whole)
        return StreamingResponse(self._stream(answer, chat, usage), media_type="text/event-stream")

    async def _stream(
        self, answer: Answer, chat: bool, usage: dict[str, Any] | None
    ) -> AsyncIterator[str]:
        if chat:  # a role-only first chunk, as vLLM sends: not a token
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        yield ": keep-alive\n\n"
        for i in range(answer.tokens):
            await asyncio.sleep(answer.gap_s)
            part = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield _sse({"choices": [{"index": 0, **part}]})
            yield _sse({"choices": [{"index": 0, "text": "", "delta": {}}]})  # no text: no token
            if answer.kind == "cut":
                raise RuntimeError("the fake server drops the connection")
        if answer.kind == "cut":
            raise RuntimeError("the fake server drops the connection")
        if answer.kind == "error_event":
            yield _sse({"error": {"message": "engine fell over", "code": 500}})
        elif answer.kind == "bad_chunk":
            yield "data: {not json\n\n"
        elif answer.kind == "odd_choices":
            yield _sse({"choices": {"0": {"text": "x"}}})
        yield _sse({"choices": [], **({} if usage is None else {"usage": usage})})
        if answer.done:
            yield "data: [DONE]\n\n"
