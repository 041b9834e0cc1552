"""What the server tests share: the tiny model's served name, a codec of one character a
token, a length predictor for the policies that need one, the stop strings an answer
ends at, server states built on the tiny model, a wait for an engine to fall idle, and
a client that leaves after its body.

Test files import these from here rather than from each other, so that each test
file holds tests alone and can move or split without breaking another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from duetime.core.request import Job, LengthPrediction
from duetime.server.app import ServerState
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.chat_template import TURN_ENDS
from duetime.server.codec import Codec

MODEL = "duetime-tiny"
#: An id the tiny model (seed 0) often writes: as end-of-sequence, answers stop on their own.
EOS = 26


class CharCodec:
    """One character per token: id ``i`` is ``chr(i - 3)`` (ids 0-2 are pad, eos, bos).

    The end-of-sequence id is :data:`EOS`, and it is kept in the text (as
    ``"\\x17"``) so that every generated token is exactly one character.
    """

    OFFSET = 3

    def __init__(self) -> None:
        self.bos_id: int | None = 2
        self.eos_id: int | None = EOS

    def encode(self, text: str) -> list[int]:
        return [2, *(ord(c) + self.OFFSET for c in text)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - self.OFFSET) for i in ids if self.OFFSET <= i < 259)


class HalfPredictor:
    """A length predictor for policies that need one (hsf): about half of ``max_tokens``."""

    name = "half"

    def predict_job(self, job: Job) -> LengthPrediction:
        n = float(job.request.max_tokens)
        return LengthPrediction(point=(n + 1) / 2, lo=1.0, hi=n, confidence=0.5)


def answer_stops(fields: dict[str, Any], chat: bool) -> list[str]:
    """The stop strings a request's answer ends at, by the server's rule written out
    here: the client's ``stop``, and for a chat answer that need not reach its length
    (no ``ignore_eos``) the end of the assistant's turn."""
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if chat and not fields.get("ignore_eos"):
        stops += [end for end in TURN_ENDS if end not in stops]
    return stops


def turn_ended(fields: dict[str, Any], chat: bool, full: str) -> bool:
    """Whether the end-of-turn rule cuts an answer whose uncut text is ``full``: a turn
    label among its stop strings that ``full`` writes."""
    stops = answer_stops(fields, chat)
    return any(end in stops and end in full for end in TURN_ENDS)


def tiny_state(**overrides: object) -> ServerState:
    """A server state (not started) on the tiny model with its own byte codec and a
    4,096-token KV budget unless ``overrides`` say otherwise."""
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, **overrides)  # type: ignore[arg-type]
    model, codec, name = load_served_model(options)
    return build_state(options, model, codec, name)


def char_state(policy: str = "fcfs", codec: Codec | None = None, **kw: Any) -> ServerState:
    """A server state (not started) on the tiny model, by default with one character per
    token (:class:`CharCodec`)."""
    options = ServeOptions(model="tiny", predictor=None, policy=policy, **kw)
    return build_state(options, load_served_model(options)[0], codec or CharCodec(), MODEL)


def wait_idle(state: ServerState, timeout: float = 10.0) -> None:
    """Wait until the engine holds no request and no KV memory (or fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = state.engine.stats
        ex = state.engine.executor
        quiet = s.kv_used == 0 and s.running == 0 and s.waiting == 0
        if quiet and not state.engine.inbox_size and ex.kv_used == 0 and not ex.seqs:
            return
        time.sleep(0.02)
    s = state.engine.stats
    pytest.fail(f"engine not idle: {s}, seqs={list(state.engine.executor.seqs)}")


def post_and_hang_up(app: Any, path: str, body: bytes) -> list[dict]:
    """Call ``app`` as a server would for a client that sent ``body`` and then left:
    every receive after the body says the client disconnected. The messages sent back."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    return sent


def no_serving(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make ``duetime serve`` / ``gateway`` return where they would start serving; the
    dict they return gets the uvicorn ``config`` and the ``sockets`` it was handed."""
    import uvicorn

    ran: dict[str, Any] = {}

    def run(server: uvicorn.Server, sockets: list[Any] | None = None) -> None:
        ran.update(config=server.config, sockets=sockets)
        server.started = True
        for sock in sockets or ():
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return ran
