"""What the server property test (``tests/test_server_properties.py``) is about: one
client's call (what it sends, what it should get, when it gives up), what the client
saw, the engine a scenario runs, and the tiny model's greedy answers to judge them by.

Scenario generation, the server harness and the answer and metric checks all use these,
so they live here, apart from the test file and from each other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from duetime.engine.gemma3 import Gemma3
from duetime.engine.generate import greedy_generate
from duetime.server.build import ServeOptions, load_served_model
from duetime.server.codec import ByteCodec, Codec
from tests.served import CharCodec

MODEL = "duetime-tiny"
BODY_LIMIT = 4096  # the server's body size limit in these runs (413 above it)


@functools.cache
def model() -> Gemma3:
    return load_served_model(ServeOptions(model="tiny", predictor=None))[0]


_GREEDY: dict[tuple[int, ...], list[int]] = {}


def greedy(ids: tuple[int, ...], n: int) -> list[int]:
    """The model's first ``n`` greedy tokens after ``ids`` (memoised, longest kept)."""
    have = _GREEDY.get(ids, [])
    if len(have) < n:
        have = _GREEDY[ids] = greedy_generate(model(), [list(ids)], n)[0]
    return have[:n]


def make_codec(name: str) -> Codec:
    return CharCodec() if name == "char" else ByteCodec()


# --- what one client does ------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One client: what it sends, what it should get, and when it gives up."""

    i: int
    path: str
    stream: bool
    body: bytes
    #: The status a malformed body must get; None for a well-formed request (200, 429, 504).
    expect: int | None
    fields: dict[str, Any]  # the JSON body (empty where it is not a JSON object)
    ids: tuple[int, ...] = ()
    max_tokens: int = 0
    delay_s: float = 0.0
    #: "stay", "cancel" (hang up after leave_s), "drop" (a stream read for `events`
    #: events, then closed) or "timeout" (a client-side read timeout of leave_s).
    leave: str = "stay"
    leave_s: float = 0.0
    events: int = 0
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)

    @property
    def chat(self) -> bool:
        return self.route.endswith("chat/completions")

    @property
    def route(self) -> str:
        """The route /metrics counts it under (a trailing slash reaches the same one)."""
        route = self.path.rstrip("/")
        return route if route in ("/v1/completions", "/v1/chat/completions") else "other"

    def __repr__(self) -> str:  # hypothesis prints it: the body says it all
        body = self.body if len(self.body) < 300 else self.body[:300] + b"..."
        how = f"{self.leave}/{self.leave_s}/{self.events} after {self.delay_s}"
        kind = dict(self.headers)["Content-Type"]
        return f"#{self.i} {self.path} {how} expect={self.expect} {kind} {body!r}"


@dataclass
class Seen:
    """What one client saw."""

    status: int | None = None  # None: it left (or its connection failed)
    gone: str = ""  # why it left, where it did
    text: str = ""
    final: dict[str, Any] = field(default_factory=dict)  # the body, or the finish chunk
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the tokens' strings in logprobs
    scores: list[float | None] = field(default_factory=list)  # completions' token_logprobs

    @property
    def answered(self) -> bool:
        return self.status == 200 and bool(self.final)


# --- the engine a scenario runs -------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    policy: str
    options: dict[str, Any]
    codec: str
    kv_capacity: int
    max_num_seqs: int
    max_batch_tokens: int
    max_waiting: int
    request_timeout_s: float
    prefix_cache_tokens: int = 4096

    @property
    def max_context(self) -> int:
        return min(model().config.max_position_embeddings, self.kv_capacity - 1)
