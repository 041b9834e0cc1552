"""Property-based tests of the OpenAI-compatible server under concurrent, misbehaving clients.

Hypothesis draws a small engine (KV for 64 to 512 tokens, 1 to 4 sequences, a
step budget of 8 to 2048 tokens), a policy with its options, a tokenizer (one
character per token, or one UTF-8 byte per token so that characters span
tokens), the server's request timeout and queue limit, and a mix of clients
sent at once: completions and chat completions, streamed or not (with or
without ``include_usage``), text or token-id prompts, ``echo``, stop strings
and ``stop_token_ids`` (often taken from the model's own answer so that they
hit), ``max_tokens``
from 1 to more than the context leaves, deadlines, priorities, TUFs, overrun,
KV eviction, ``ignore_eos``, ``min_tokens``, segments and classes, sampling
fields (temperature, top-p/k, min-p, seed, a penalty) and log-probabilities
(with ``echo``, of the prompt too);
some bodies are malformed in one of many ways. Clients hang up before the
first byte, while queued, in the middle of a stream, or give up on a
client-side timeout.
The server runs in-process (uvicorn on a thread) on a tiny random-weight
model, never the real Gemma. What must hold:

* every client that stayed got exactly one well-formed answer (a 200 with a
  complete JSON body or SSE stream, or a JSON error object with a 4xx, or the
  504 of the server's own timeout) within a bound; bad input gets the 4xx it
  deserves, never a 5xx;
* an answer that ran to its end is the model's greedy continuation (unless it
  sampled, was penalised or had KV evicted: then only its shape is judged), cut
  where its ``finish_reason`` says ("stop" for end-of-sequence or a stop string,
  "length" at ``max_tokens``), so a streamed answer equals the non-streamed one
  for the same prompt; one the policy cut short ("abort") is a prefix of it;
  ``usage`` and the ``duetime`` object agree with the text, and so do the
  tokens of ``logprobs`` (one per token, their strings making up the text; a
  scored prompt's make up the echo, the first without a score);
* afterwards no handler runs, the engine holds no request, the KV cache no
  slot and no token, and ``/metrics`` agrees with what the clients saw: finish
  reasons, 429s by cause, tokens generated, gauges at zero, and every request
  that got past validation counted exactly once (finished or refused);
* the server logged no error (one a departed client never saw included), and
  still answers ``/health`` and one more request.

``DUETIME_FUZZ_EXAMPLES=N`` runs N examples per case instead of CI's 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from duetime.engine.gemma3 import Gemma3
from duetime.engine.generate import greedy_generate
from duetime.server.app import ServerState, create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.chat_template import render_chat
from duetime.server.codec import ByteCodec, Codec
from duetime.server.schemas import ChatMessage
from duetime.server.threaded import serve_in_thread
from tests.factories import answer_shape_problems, byte_codec_text, prometheus_samples
from tests.served import CharCodec, HalfPredictor

EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "2"))
MODEL = "duetime-tiny"
HANG_S = 30.0  # a client still unanswered after this found a hung handler
BODY_LIMIT = 4096  # the server's body size limit in these runs (413 above it)
VOCAB = ByteCodec.vocab_size  # the tiny model's, and both codecs' (259)
#: Prompt text: ASCII, the characters the segment rules cut at, and multi-byte ones.
ALPHABET = "abcxyz .!?\n();é€😀"


@functools.cache
def _model() -> Gemma3:
    return load_served_model(ServeOptions(model="tiny", predictor=None))[0]


_GREEDY: dict[tuple[int, ...], list[int]] = {}


def _greedy(ids: tuple[int, ...], n: int) -> list[int]:
    """The model's first ``n`` greedy tokens after ``ids`` (memoised, longest kept)."""
    have = _GREEDY.get(ids, [])
    if len(have) < n:
        have = _GREEDY[ids] = greedy_generate(_model(), [list(ids)], n)[0]
    return have[:n]


def _text_after(codec: str, gen: Sequence[int], *, final: bool) -> str:
    """The text of ``gen`` a client may have: a character still missing bytes is not
    part of it until the answer ends (then it is U+FFFD); a broken byte is U+FFFD."""
    if codec == "char":
        return CharCodec().decode(gen)
    return byte_codec_text(gen, final=final)


def _codec(name: str) -> Codec:
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


# --- strategies ------------------------------------------------------------------------
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
        return min(_model().config.max_position_embeddings, self.kv_capacity - 1)


POLICY_OPTIONS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "fcfs": st.fixed_dictionaries(
        {
            "chunked_prefill": st.booleans(),
            "preempt_mode": st.sampled_from(["recompute", "swap", "restart"]),
        }
    ),
    "edf": st.fixed_dictionaries({"preempt_mode": st.sampled_from(["recompute", "swap"])}),
    "timebill": st.fixed_dictionaries(
        {
            "overrun": st.sampled_from(["kill", "skip-next"]),
            "fixed_alpha": st.sampled_from([None, None, 0.5]),
        }
    ),
    "timelyllm": st.fixed_dictionaries({"segment_tokens": st.integers(1, 12)}),
    "deferred-prefill": st.fixed_dictionaries({"k": st.integers(1, 4)}),
}
#: The cases CI runs: FCFS, EDF, TimelyLLM's PUD (segments, suspension), TimeBill (evicts
#: KV, kills at the deadline), and one more of any registered policy.
CASES = ["fcfs", "edf", "timelyllm", "timebill", "any"]
OTHERS = ["aell", "amax", "amin", "deferred-prefill", "hsf", "sjf", "spf", "vllm-stream"]


@st.composite
def _engine(draw: Any, case: str) -> Engine:
    policy = draw(st.sampled_from(OTHERS + CASES[:4])) if case == "any" else case
    return Engine(
        policy=policy,
        options=draw(POLICY_OPTIONS.get(policy, st.just({}))),
        codec=draw(st.sampled_from(["char", "char", "byte"])),
        kv_capacity=draw(st.sampled_from([64, 128, 192, 512])),
        max_num_seqs=draw(st.sampled_from([1, 2, 4])),
        max_batch_tokens=draw(st.sampled_from([8, 48, 2048])),
        max_waiting=draw(st.sampled_from([2, 256, 256])),
        request_timeout_s=draw(st.sampled_from([0.05, 0.4, 600.0, 600.0, 600.0])),
        # off, room for two blocks (so blocks are dropped as others come), the default
        prefix_cache_tokens=draw(st.sampled_from([0, 32, 4096, 4096])),
    )


def _malformed(draw: Any, chat: bool, base: dict[str, Any]) -> tuple[bytes, int] | None:
    """A body broken in one way and the status it must get, or None for a good one."""
    kind = draw(st.integers(0, 180))  # small values (the ones hypothesis tries first) are good
    # The NaN goes in front of a body without its own temperature: JSON's last duplicate
    # key wins, so a sampled request's "temperature": 0.0 made the NaN body a good one.
    unsampled = {k: v for k, v in base.items() if k != "temperature"}
    cases: list[tuple[bytes, int]] = [
        (b"{not json", 400),
        (json.dumps(unsampled).encode().replace(b"{", b'{"temperature": NaN, ', 1), 400),
        (json.dumps(base).encode().replace(b"{", b'{"user": Infinity, ', 1), 400),
        (b"", 400),
        (b"[1, 2]", 400),
        (b'{"model": "duetime-tiny", "prompt": "\xff\xfe"}', 400),
        (json.dumps({**base, "max_tokens": "3"}).encode(), 400),
        (json.dumps({**base, "max_tokens": 0}).encode(), 400),
        (json.dumps({**base, "max_tokens": 10**9}).encode(), 400),
        (json.dumps({**base, "n": 0}).encode(), 400),
        (json.dumps({**base, "model": "gpt-4"}).encode(), 404),
        (json.dumps({**base, "stream": "yes"}).encode(), 400),
        (json.dumps({**base, "deadline_ms": -1}).encode(), 400),
        (json.dumps({**base, "priority": 10**6}).encode(), 400),
        (json.dumps({**base, "kv_eviction": 1.5}).encode(), 400),
        (json.dumps({**base, "stop": ["a", "b", "c", "d", "e"]}).encode(), 400),
        (json.dumps({**base, "stop": [""]}).encode(), 400),
        (json.dumps({**base, "tuf": {"ert_ms": -5}}).encode(), 400),
        (json.dumps({**base, "segment": "chapter"}).encode(), 400),
        (json.dumps({**base, "klass": "\udc80"}).encode(), 400),
        (json.dumps({**base, "user": "x" * (BODY_LIMIT + 10)}).encode(), 413),
        (b'{"model": "duetime-tiny", "user": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400),
    ]
    if chat:
        cases += [
            (json.dumps({**base, "messages": []}).encode(), 400),
            (json.dumps({**base, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400),
            (json.dumps({**base, "messages": "hello"}).encode(), 400),
            (json.dumps({**base, "logprobs": False, "top_logprobs": 2}).encode(), 400),
        ]
    else:
        cases += [
            (json.dumps({**base, "prompt": ""}).encode(), 400),
            (json.dumps({**base, "prompt": 5}).encode(), 400),
            (json.dumps({**base, "prompt": ["a", ""]}).encode(), 400),
            (json.dumps({**base, "prompt": ["a", [5]]}).encode(), 400),
            (json.dumps({**base, "prompt": [2, -1]}).encode(), 400),
            (json.dumps({**base, "prompt": [2, 10**6]}).encode(), 400),
            (json.dumps({**base, "echo": 1}).encode(), 400),
            (json.dumps({**base, "best_of": 3}).encode(), 400),
            (json.dumps({**base, "logprobs": 6}).encode(), 400),
        ]
    return cases[180 - kind] if 180 - kind < len(cases) else None


@st.composite
def _call(draw: Any, i: int, eng: Engine) -> Call:
    codec = _codec(eng.codec)
    chat = draw(st.integers(0, 2)) == 0
    stream = draw(st.booleans())
    fields: dict[str, Any] = {"model": MODEL}
    # Characters past U+00FF have no id in the one-character codec (its prompts are a 400).
    alphabet = ALPHABET if eng.codec == "byte" else ALPHABET.replace("€😀", "")
    if draw(st.integers(0, 5)) == 5:  # near the context length
        long = max(1, eng.max_context - 60)
        text = draw(st.text(alphabet, min_size=long, max_size=long + 30))
    else:
        text = draw(st.text(alphabet, min_size=1, max_size=24))
    if chat:
        messages = [{"role": draw(st.sampled_from(["user", "system"])), "content": text}]
        if draw(st.booleans()):
            messages.append({"role": "user", "content": [{"type": "text", "text": "go"}]})
        fields["messages"] = messages
        ids = tuple(codec.encode(render_chat([ChatMessage(**m) for m in messages])))
    else:
        form = draw(st.integers(0, 5))
        if form == 0:  # token ids (some past the vocabulary: a 400)
            raw = draw(st.lists(st.integers(0, VOCAB), min_size=1, max_size=20))
            fields["prompt"] = raw
            ids = tuple(raw)
        else:
            fields["prompt"] = [text] if form == 1 else text
            ids = tuple(codec.encode(text))
        if draw(st.integers(0, 7)) == 0:
            fields["echo"] = True
    if draw(st.integers(0, 3)) == 0:  # log-probabilities (with echo: the prompt's too)
        if chat:
            fields["logprobs"] = True
            if draw(st.booleans()):
                fields["top_logprobs"] = draw(st.integers(0, 20))
        else:
            fields["logprobs"] = draw(st.integers(0, 5))
    room = eng.max_context - len(ids)
    how = draw(st.sampled_from(["none", "small", "1", "small", "room", "small", "1", "over"]))
    if how == "none":
        max_tokens = max(1, min(256, room)) if chat else 16
    else:
        max_tokens = {
            "1": 1,
            "small": draw(st.integers(1, 24)),
            "room": max(1, room),
            "over": max(1, room + draw(st.integers(1, 50))),
        }[how]
        key = "max_tokens"
        if chat and draw(st.booleans()):
            key = "max_completion_tokens"
        fields[key] = max_tokens
    fields["stream"] = stream
    if stream and draw(st.booleans()):
        fields["stream_options"] = {"include_usage": True}
    fields.update(_extensions(draw, ids, max_tokens, eng))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    expect: int | None = None
    bad = _malformed(draw, chat, fields)
    if bad is not None:
        body, expect = bad
    else:
        body = json.dumps(fields).encode()
        if len(body) > BODY_LIMIT:
            expect = 413
        elif _refused(ids, max_tokens, fields.get("min_tokens", 0), eng.max_context):
            expect = 400
    headers = {"Content-Type": "application/json"}
    misdirected = draw(st.integers(0, 40))
    if misdirected >= 39:  # sent as text (a 400), or to a route that does not exist
        fields = {}
        expect = 413 if len(body) > BODY_LIMIT else (400, 404)[misdirected - 39]
        if misdirected == 39:
            headers["Content-Type"] = "text/plain"
        else:
            path = path.replace("completions", "complete")
    if draw(st.integers(0, 7)) == 0:
        path += "/"  # served as the route itself (was a bare 307)
    leave = draw(st.sampled_from(["stay"] * 6 + ["cancel", "timeout"] + ["drop"] * stream))
    return Call(
        i=i,
        path=path,
        stream=stream,
        body=body,
        expect=expect,
        headers=tuple(headers.items()),
        fields=fields if bad is None else {},  # the body, where the server must take it
        ids=ids,
        max_tokens=max_tokens,
        delay_s=draw(st.sampled_from([0.0, 0.0, 0.005, 0.03, 0.1])),
        leave=leave,
        leave_s=draw(st.sampled_from([0.0, 0.002, 0.02, 0.1, 0.3])),
        events=draw(st.integers(0, 5)),
    )


def _refused(ids: Sequence[int], max_tokens: int, min_tokens: int, context: int) -> bool:
    """Whether a well-formed request asks for what the server cannot do (a 400): token ids
    past the vocabulary, no room in the context, or min_tokens over max_tokens."""
    if any(t >= VOCAB for t in ids) or len(ids) + max_tokens > context:
        return True
    return len(ids) >= context or min_tokens > max_tokens


def _extensions(draw: Any, ids: Sequence[int], max_tokens: int, eng: Engine) -> dict[str, Any]:
    """duetime's fields, and stop strings (often cut from the model's own answer)."""
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        key = draw(st.sampled_from(["deadline_ms", "deadline_ms", "time_budget_ms"]))
        out[key] = draw(st.sampled_from([1, 30, 300, 60_000]))
    if draw(st.booleans()):
        out["priority"] = draw(st.integers(-3, 3))
    if draw(st.integers(0, 4)) == 0:
        out["tuf"] = {"ert_ms": draw(st.sampled_from([5.0, 200.0])), "alpha": -1.0}
    if draw(st.integers(0, 4)) == 0:
        out["overrun"] = draw(st.sampled_from(["kill", "skip_next"]))
    if draw(st.integers(0, 3)) == 0:
        out["kv_eviction"] = draw(st.sampled_from(["auto", "off", 0.0, 0.5]))
    if draw(st.booleans()):
        out["ignore_eos"] = True
    if draw(st.integers(0, 5)) == 0:
        out["min_tokens"] = draw(st.integers(0, 4))
    if draw(st.integers(0, 6)) == 0:
        out["segment"] = draw(st.sampled_from(["action", "sentence", "paragraph"]))
    if draw(st.integers(0, 4)) == 0:
        out["klass"] = draw(st.sampled_from(["a", "b"]))
    if draw(st.integers(0, 2)) == 0 and all(t < VOCAB for t in ids) and ids:
        stops = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                # Without U+FFFD: the server cannot tell half a character from a broken
                # byte, so it holds a U+FFFD back for up to 3 tokens, and where a stop
                # string holding one matches (past min_tokens or not, and how many
                # tokens were made by then) depends on that. No client sends one.
                answer = _codec(eng.codec).decode(_greedy(tuple(ids), 24))
                answer = answer.replace("\ufffd", "")
                at = draw(st.integers(0, max(0, len(answer) - 1)))
                stop = answer[at : at + draw(st.integers(1, 3))]
            else:
                stop = draw(st.text("ab.\n é€", min_size=1, max_size=3))
            if stop:
                stops.append(stop)
        if stops:
            out["stop"] = stops[0] if len(stops) == 1 and draw(st.booleans()) else stops
    if draw(st.integers(0, 5)) == 0 and all(t < VOCAB for t in ids) and ids:
        # often a token of the model's own answer, so that it ends there
        answer = _greedy(tuple(ids), 24)
        pool = st.sampled_from(answer) if answer and draw(st.booleans()) else st.integers(3, 255)
        out["stop_token_ids"] = draw(st.lists(pool, min_size=1, max_size=3))
    if draw(st.integers(0, 5)) == 0:  # sampling fields, often ones that leave it greedy
        out["temperature"] = draw(st.sampled_from([0.0, 0.7, 1.3]))
        for key, values in (
            ("top_p", [0.5, 0.95]),
            ("top_k", [-1, 1, 5]),
            ("min_p", [0.0, 0.1]),
            ("seed", [0, 1]),
            ("frequency_penalty", [0.0, 1.0]),
        ):
            if draw(st.booleans()):
                out[key] = draw(st.sampled_from(values))
    return out


def _greedy_request(c: Call) -> bool:
    """Whether ``c``'s answer is the model's plain greedy one (the reference's)."""
    f = c.fields
    argmax = f.get("temperature", 0.0) == 0 or f.get("top_k") == 1
    return argmax and not f.get("frequency_penalty")


@st.composite
def scenarios(draw: Any, case: str) -> tuple[Engine, list[Call]]:
    eng = draw(_engine(case))
    calls = [draw(_call(i, eng)) for i in range(draw(st.integers(1, 14)))]
    # The same greedy request streamed and not, sent together: the answers must be equal.
    twins = [c for c in calls if c.expect is None and draw(st.integers(0, 3)) == 0]
    for c in twins:
        fields = {k: v for k, v in c.fields.items() if k != "stream_options"}
        fields["stream"] = not c.stream
        if fields["stream"] and draw(st.booleans()):
            fields["stream_options"] = {"include_usage": True}
        body = json.dumps(fields).encode()
        calls.append(
            dataclasses.replace(
                c, i=len(calls), stream=not c.stream, body=body, fields=fields, leave="stay"
            )
        )
    return eng, calls


# --- the server -------------------------------------------------------------------------
def _state(eng: Engine) -> ServerState:
    options = ServeOptions(
        model="tiny",
        predictor=None,
        policy=eng.policy,
        policy_kwargs=eng.options,
        kv_capacity=eng.kv_capacity,
        max_num_seqs=eng.max_num_seqs,
        max_batch_tokens=eng.max_batch_tokens,
        max_waiting=eng.max_waiting,
        request_timeout_s=eng.request_timeout_s,
        prefix_cache_tokens=eng.prefix_cache_tokens,
    )
    with pytest.MonkeyPatch.context() as mp:
        if eng.policy == "hsf":  # it orders by predicted lengths and needs a predictor
            mp.setattr("duetime.server.build._predictor", lambda _options: HalfPredictor())
        state: ServerState = build_state(options, _model(), _codec(eng.codec), MODEL)
    state.config.max_body_bytes = BODY_LIMIT
    return state


class _Handling:
    """The app, counting the HTTP requests it is handling. A client that hung up may have
    left its whole request in the server's socket, to be handled after the client is gone:
    the server is done only when no handler runs."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.active = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _idle(state: ServerState, app: _Handling, timeout: float = 15.0) -> None:
    """Wait until no request is being handled and the engine holds no request, no KV and
    no per-request state, for 50 ms on end (or fail)."""
    deadline = time.monotonic() + timeout
    engine = state.engine
    since = None
    while time.monotonic() < deadline:
        s, ex = engine.stats, engine.executor
        quiet = not (s.kv_used or s.running or s.waiting or s.suspended or engine.inbox_size)
        held = ex.kv_used or ex.kv_device or ex.seqs or ex.records or ex.tokens or ex.slots
        cache = ex.kv.slots or ex.kv.total_tokens or ex._spooled
        kept = engine._live or ex.stop_tokens or ex.segmenters or ex._replay
        kept = kept or ex.samplers or ex.logprob_logs
        if quiet and not held and not cache and not kept and not ex.in_system and not app.active:
            since = since or time.monotonic()
            if time.monotonic() - since >= 0.05:
                return
        else:
            since = None
        time.sleep(0.02)
    ex = engine.executor
    status = {rid: seq.status.name for rid, seq in ex.seqs.items()}
    pytest.fail(
        f"engine not idle: {engine.stats}, seqs={status}, live={list(engine._live)}, "
        f"cache slots={ex.kv.slots}, {app.active} requests in handling"
    )


# --- the clients ------------------------------------------------------------------------
async def _talk(client: httpx.AsyncClient, url: str, c: Call) -> Seen:
    timeout = httpx.Timeout(HANG_S, read=c.leave_s + 0.001 if c.leave == "timeout" else HANG_S)
    request = client.build_request(
        "POST", url + c.path, content=c.body, headers=dict(c.headers), timeout=timeout
    )
    r = await client.send(request, stream=True)
    try:
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            return _whole(c, r.status_code, await r.aread(), r.headers)
        return await _events(c, r)
    finally:
        await r.aclose()


def _whole(c: Call, status: int, content: bytes, headers: httpx.Headers) -> Seen:
    seen = Seen(status, headers=dict(headers))
    try:
        data = json.loads(content)
    except ValueError:
        seen.problems.append(f"status {status} with a body that is not JSON: {content[:200]!r}")
        return seen
    if status != 200:
        seen.error = data.get("error") if isinstance(data, dict) else None
        return seen
    if c.stream:
        seen.problems.append("a stream was asked for and a JSON body came")
    seen.final = data
    choice = data["choices"][0]
    seen.text = choice["message"]["content"] if c.chat else choice["text"]
    seen.pieces = _pieces(c, choice)
    seen.scores = _scores(c, choice)
    seen.usage = data.get("usage")
    if data["object"] != ("chat.completion" if c.chat else "text_completion"):
        seen.problems.append(f"object {data['object']!r}")
    if c.chat and choice["message"]["role"] != "assistant":
        seen.problems.append(f"role {choice['message']['role']!r}")
    return seen


def _scores(c: Call, choice: dict[str, Any]) -> list[float | None]:
    """A completion choice's ``token_logprobs`` (none for chat or where not asked)."""
    lp = choice.get("logprobs")
    return [] if not lp or c.chat else list(lp["token_logprobs"])


def _pieces(c: Call, choice: dict[str, Any]) -> list[str]:
    """The answer tokens' strings a choice's ``logprobs`` lists (none where not asked)."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    return [t["token"] for t in lp["content"]] if c.chat else list(lp["tokens"])


async def _events(c: Call, r: httpx.Response) -> Seen:
    """Read an SSE stream and check its shape: chunks, one finish chunk, usage, [DONE]."""
    seen = Seen(200, headers=dict(r.headers))
    events: list[str] = []
    buf = ""
    async for piece in r.aiter_text():
        buf += piece
        while "\n\n" in buf:
            line, buf = buf.split("\n\n", 1)
            events.append(line)
            if c.leave == "drop" and len(events) > c.events:
                seen.status, seen.gone = None, "dropped"
                return seen
    if buf:
        seen.problems.append(f"the stream ends inside an event: {buf[-200:]!r}")
    if not events or events[-1] != "data: [DONE]" or events.count("data: [DONE]") != 1:
        seen.problems.append(f"the stream does not end with one [DONE]: {events[-2:]}")
        return seen
    ids = set()
    finals = []
    for n, line in enumerate(events[:-1]):
        if not line.startswith("data: {"):
            seen.problems.append(f"event {n} is not 'data: {{json}}': {line[:200]!r}")
            continue
        obj = json.loads(line.removeprefix("data: "))
        if "error" in obj:
            seen.error = obj["error"]
            if n != len(events) - 2:
                seen.problems.append("an error event that is not the last")
            continue
        ids.add(obj["id"])
        want = "chat.completion.chunk" if c.chat else "text_completion"
        if obj["object"] != want:
            seen.problems.append(f"chunk object {obj['object']!r}")
        if obj.get("usage"):
            if obj["choices"] or seen.usage is not None or not finals:
                seen.problems.append(f"a usage chunk with choices, twice or early: {obj}")
            seen.usage = obj["usage"]
            continue
        if finals:
            seen.problems.append(f"a chunk after the finish chunk: {obj}")
        (choice,) = obj["choices"]
        if c.chat:
            delta = choice["delta"]
            if n == 0 and delta.get("role") != "assistant":
                seen.problems.append(f"first chat chunk without the role: {obj}")
            seen.text += delta.get("content") or ""
        else:
            seen.text += choice["text"]
        seen.pieces += _pieces(c, choice)
        seen.scores += _scores(c, choice)
        if choice["finish_reason"] is not None:
            finals.append(obj)
    if len(ids) > 1:
        seen.problems.append(f"chunks with {len(ids)} ids")
    include_usage = bool((c.fields.get("stream_options") or {}).get("include_usage"))
    if seen.error is not None:
        seen.status = 504 if "timed out" in str(seen.error.get("message")) else 500
        if finals:
            seen.problems.append("an error event after a finish chunk")
        seen.final = {}
    elif len(finals) != 1:
        seen.problems.append(f"{len(finals)} chunks with a finish_reason")
    else:
        seen.final = finals[0]
        if include_usage and seen.usage is None:
            seen.problems.append("include_usage but no usage chunk")
        if not include_usage and seen.usage is not None:
            seen.problems.append("a usage chunk nobody asked for")
    return seen


async def _one(client: httpx.AsyncClient, url: str, c: Call) -> Seen:
    await asyncio.sleep(c.delay_s)
    work = asyncio.ensure_future(_talk(client, url, c))
    if c.leave == "cancel":
        await asyncio.wait({work}, timeout=c.leave_s)
        if not work.done():
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                return Seen(gone="cancelled")
    try:
        return await asyncio.wait_for(work, HANG_S)
    except TimeoutError:
        return Seen(problems=[f"no answer within {HANG_S} s"])
    except httpx.TimeoutException:
        if c.leave == "timeout":
            return Seen(gone="client timeout")
        return Seen(problems=["an httpx timeout of a client that meant to stay"])
    except httpx.HTTPError as e:
        return Seen(problems=[f"the connection failed: {e!r}"])


async def _run(url: str, calls: list[Call]) -> list[Seen]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(_one(client, url, c) for c in calls))


# --- what the answers must be ----------------------------------------------------------
def _reference(eng: Engine, c: Call) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of the answer to ``c`` run to its end.

    The greedy continuation ends at the first end-of-sequence it may end at
    (not before ``min_tokens``, never with ``ignore_eos``), and before the first
    stop string that begins after the first ``min_tokens`` tokens; the tokens
    counted are those up to the end of that stop."""
    codec = _codec(eng.codec)
    gen = _greedy(c.ids, c.max_tokens)
    reason = "length"
    min_tokens = c.fields.get("min_tokens", 0)
    ends = set(c.fields.get("stop_token_ids") or ())  # kept in the answer, as vLLM does
    if not c.fields.get("ignore_eos"):
        ends.add(codec.eos_id)
    for k, tok in enumerate(gen):
        if tok in ends and k + 1 >= max(min_tokens, 1):
            gen, reason = gen[: k + 1], "stop"
            break
    stop = c.fields.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    floor = len(_text_after(eng.codec, gen[:min_tokens], final=False))
    # A stop string is found once its last token is in: scan the answer token by token.
    for k in range(max(min_tokens, 1), len(gen) + 1):
        text = _text_after(eng.codec, gen[:k], final=k == len(gen))
        hits = [text.find(s, floor) for s in stops if s in text[floor:]]
        if hits:
            return text[: min(hits)], "stop", k
    return codec.decode(gen), reason, len(gen)


def _check(eng: Engine, c: Call, s: Seen) -> list[str]:
    """What is wrong with one client's answer (empty: nothing)."""
    bad = list(s.problems)
    if s.gone:
        return bad
    if s.status is None:
        return [*bad, "no status"]
    if c.expect is not None:  # a body the server must refuse, and how
        if s.status != c.expect:
            bad.append(f"status {s.status}, expected {c.expect}: {s.error}")
        return bad + _error_object(s)
    if s.status == 429:
        bad += _error_object(s)
        if int(s.headers.get("retry-after", "0")) < 1:
            bad.append("429 without Retry-After")
        code = (s.error or {}).get("code")
        if code == "deadline_unreachable" and not _judged(c):
            bad.append("deadline_unreachable for a request that cannot be refused for it")
        if code not in ("queue_full", "deadline_unreachable"):
            bad.append(f"429 with code {code!r}")
        return bad
    if s.status == 504:
        if eng.request_timeout_s > 60:
            bad.append("504 under a 600 s timeout")
        return bad + _error_object(s)
    if s.status != 200:
        return [*bad, f"status {s.status}: {s.error}"]
    if not s.final:
        return bad
    return bad + _check_answer(eng, c, s)


def _asks_logprobs(c: Call) -> bool:
    v = c.fields.get("logprobs")  # chat: true; completions: 0 to 5 (0 asks too)
    return v is not None and v is not False


def _judged(c: Call) -> bool:
    """Whether admission may refuse ``c`` for its deadline."""
    has = "deadline_ms" in c.fields or "time_budget_ms" in c.fields
    kv = c.fields.get("kv_eviction", "off")
    return has and (kv == "off" or kv == 0.0)


def _error_object(s: Seen) -> list[str]:
    e = s.error
    if not isinstance(e, dict) or not isinstance(e.get("message"), str) or not e.get("type"):
        return [f"status {s.status} without an OpenAI error object: {e}"]
    return []


def _check_answer(eng: Engine, c: Call, s: Seen) -> list[str]:
    bad: list[str] = []
    choice = s.final["choices"][0]
    reason = choice["finish_reason"]
    timing = s.final.get("duetime")
    if timing is None:
        return ["no duetime object"]
    n = timing["completion_tokens"]
    if s.usage is not None:
        want = {"prompt_tokens": len(c.ids), "completion_tokens": n, "total_tokens": len(c.ids) + n}
        usage = dict(s.usage)
        cached = (usage.pop("prompt_tokens_details", None) or {}).get("cached_tokens")
        if usage != want:
            bad.append(f"usage {s.usage}, expected {want}")
        # whole 16-token blocks of the prompt; all of it only for a prefill recomputed after
        # a preemption, whose last computed token is then one of the answer's
        if not (
            isinstance(cached, int)
            and 0 <= cached <= len(c.ids)
            and (cached % 16 == 0 or cached == len(c.ids))
        ):
            bad.append(f"usage {s.usage}: cached_tokens not whole blocks of the prompt")
    text = s.text
    pieces = s.pieces
    if c.fields.get("echo"):
        codec = _codec(eng.codec)
        prompt = c.fields["prompt"]
        echo = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt
        if not isinstance(echo, str) or _asks_logprobs(c):  # a scored prompt: its ids decoded
            echo = codec.decode(c.ids)
        if not text.startswith(echo):
            return [*bad, f"echo {echo!r} missing: {text!r}"]
        text = text[len(echo) :]
        if _asks_logprobs(c):  # the prompt's tokens come first, the first without a score
            scored, pieces = s.pieces[: len(c.ids)], s.pieces[len(c.ids) :]
            if "".join(scored) != echo or len(scored) != len(c.ids):
                bad.append(f"scored prompt {scored} does not make up the echo {echo!r}")
            if not s.scores or s.scores[0] is not None:
                bad.append(f"the prompt's first token has a score: {s.scores[:2]}")
            elif n and None in s.scores[1 : len(c.ids)]:
                bad.append("a prompt token without a score after the prefill")
    want_text, want_reason, want_n = _reference(eng, c)
    # Evicted KV or sampling (or a penalty) leave the greedy reference: shape checks only.
    unlike_ref = timing["kv_eviction_ratio"] > 0 or not _greedy_request(c)
    if reason not in ("stop", "length", "abort"):
        bad.append(f"finish_reason {reason!r}")
    elif reason == "abort":  # cut short by the policy: what was sent stands
        # Text held back as the possible start of a stop string is sent at the end: the
        # stop never came. A half character at the cut is sent as U+FFFD.
        full = _text_after(eng.codec, _greedy(c.ids, c.max_tokens), final=True)
        stops = c.fields.get("stop") or []
        if not unlike_ref and not full.startswith(text.rstrip("\ufffd")):
            bad.append(f"aborted answer {text!r} is not a prefix of {full!r}")
        if any(stop in text for stop in ([stops] if isinstance(stops, str) else stops)):
            bad.append(f"aborted answer {text!r} holds a stop string of {stops}")
    elif not unlike_ref and (text, reason, n) != (want_text, want_reason, want_n):
        bad.append(
            f"answer {text!r} {reason} ({n} tokens); the model's is {want_text!r} "
            f"{want_reason} ({want_n} tokens)"
        )
    if _asks_logprobs(c):  # one entry per token, whose strings make up the text
        if "".join(pieces) != text:
            bad.append(f"logprobs' tokens {pieces} do not make up the text {text!r}")
        if len(pieces) > n or (not c.fields.get("stop") and len(pieces) != n):
            bad.append(f"{len(pieces)} logprobs entries for {n} tokens")
    elif s.pieces:
        bad.append("logprobs nobody asked for")
    if eng.codec == "char" and len(text) > n:  # one character per token (none for ids < 3)
        bad.append(f"{len(text)} characters but completion_tokens {n}")
    bad += answer_shape_problems(n, reason, c.max_tokens, timing)
    e2e = timing["e2e_ms"]
    budget = c.fields.get("deadline_ms", c.fields.get("time_budget_ms"))
    met = timing["deadline_met"]
    if (budget is None) != (met is None):
        bad.append(f"deadline_met {met} with deadline {budget}")
    elif met and (reason == "abort" or e2e > budget + 0.01):
        bad.append(f"deadline_met with {reason}, e2e {e2e} ms, deadline {budget} ms")
    return bad


def _same_prompt_same_answer(eng: Engine, calls: list[Call], seen: list[Seen]) -> list[str]:
    """A streamed and a non-streamed answer to the same greedy request are the same text."""
    keys = ("ignore_eos", "min_tokens", "stop", "echo")
    texts: dict[Any, set[tuple[bool, str, str]]] = {}
    for c, s in zip(calls, seen, strict=True):
        if not s.answered or c.expect is not None:
            continue
        reason = s.final["choices"][0]["finish_reason"]
        if reason == "abort" or s.final["duetime"]["kv_eviction_ratio"] > 0:
            continue
        if not _greedy_request(c):
            continue
        key = (c.route, c.ids, c.max_tokens, json.dumps([c.fields.get(k) for k in keys]))
        texts.setdefault(key, set()).add((c.stream, s.text, reason))
    return [
        f"{key}: different answers {sorted(v)}"
        for key, v in texts.items()
        if len({(t, r) for _, t, r in v}) > 1
    ]


def _metrics(url: str) -> dict[str, float]:
    return prometheus_samples(httpx.get(url + "/metrics").text)


def _check_metrics(
    calls: list[Call], seen: list[Seen], m: dict[str, float], issued: int
) -> list[str]:
    """/metrics agrees with the clients: what a client that stayed saw is counted as it saw
    it; a client that left may or may not have reached the engine. ``issued``: requests
    the server gave an id (past validation), each counted once: finished or refused."""
    bad = []
    for gauge in ("queue_length", "running", "suspended", "kv_used_tokens", "engine_errors"):
        if m[f"duetime_{gauge}"] != 0:
            bad.append(f"duetime_{gauge} = {m[f'duetime_{gauge}']}")
    reasons: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    tokens = 0
    unknown = 0  # clients whose request may have reached the engine without them seeing how
    exact_tokens = True
    for c, s in zip(calls, seen, strict=True):
        if c.expect is not None:
            continue
        if s.gone or s.status is None:
            unknown += 1
            exact_tokens = False
        elif s.status == 429:
            why = (s.error or {}).get("code")
            rejected["queue" if why == "queue_full" else "deadline"] += 1
        elif s.status == 504:  # aborted, unless the engine ended it as the time ran out
            unknown += 1
            exact_tokens = False
        elif s.answered:
            reason = s.final["choices"][0]["finish_reason"]
            reasons[reason] += 1
            tokens += s.final["duetime"]["completion_tokens"]
            if c.fields.get("stop") and reason == "stop":
                exact_tokens = False  # the engine may have made tokens past the stop string
    counted = {
        r: int(m.get(f'duetime_requests_total{{reason="{r}"}}', 0))
        for r in ("stop", "length", "abort", "error")
    }
    refused = {
        w: int(m.get(f'duetime_rejected_total{{why="{w}"}}', 0)) for w in ("queue", "deadline")
    }
    extra = (
        sum(counted.values())
        - sum(reasons.values())
        + sum(refused.values())
        - sum(rejected.values())
    )
    if any(counted[r] < reasons[r] for r in counted) or not 0 <= extra <= unknown:
        bad.append(f"requests_total {counted} but clients saw {dict(reasons)} ({unknown} left)")
    if sum(counted.values()) + sum(refused.values()) != issued:
        bad.append(f"{issued} requests took an id, but {counted} ended and {refused} refused")
    if any(refused[w] < rejected[w] for w in refused):
        bad.append(f"rejected_total {refused} but clients saw {dict(rejected)}")
    generated = m["duetime_generated_tokens_total"]
    if generated < tokens or (exact_tokens and generated != tokens):
        bad.append(f"generated_tokens_total {generated}, clients got {tokens}")
    return bad + _check_response_counts(calls, seen, m)


def _check_response_counts(calls: list[Call], seen: list[Seen], m: dict[str, float]) -> list[str]:
    """``duetime_http_responses_total`` holds each status a client saw on its route; a
    client that left was answered something or nothing, so it adds at most one."""
    saw: Counter[tuple[str, int]] = Counter()
    left: Counter[str] = Counter()
    for c, s in zip(calls, seen, strict=True):
        if s.status is None:
            left[c.route] += 1
        elif s.headers.get("content-type", "").startswith("text/event-stream"):
            saw[c.route, 200] += 1  # a stream's status line; a 504 came as an error event
        else:
            saw[c.route, s.status] += 1
    bad = []
    for (route, status), n in saw.items():
        got = m.get(f'duetime_http_responses_total{{route="{route}",status="{status}"}}', 0)
        if got < n:
            bad.append(f"{route} {status}: counted {got}, clients saw {n}")
    for route in {c.route for c in calls}:
        prefix = f'duetime_http_responses_total{{route="{route}",'
        total = sum(v for k, v in m.items() if k.startswith(prefix))
        seen_here = sum(n for (r, _), n in saw.items() if r == route)
        if not seen_here <= total <= seen_here + left[route]:
            bad.append(f"{route}: {total} responses counted, {seen_here} seen, {left[route]} left")
    return bad


@contextlib.contextmanager
def _errors_logged() -> Iterator[list[str]]:
    """Errors the server logs meanwhile (its own, uvicorn's, asyncio's), as text."""
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if record.exc_info is not None:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
            logged.append(f"{record.name}: {text}")

    keep = Keep(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("duetime.server", "uvicorn.error", "asyncio")]
    for log in loggers:
        log.addHandler(keep)
    try:
        yield logged
    finally:
        for log in loggers:
            log.removeHandler(keep)


# --- the property -----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_every_client_gets_one_right_answer_and_nothing_leaks(case: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(case))
    def check(scenario: tuple[Engine, list[Call]]) -> None:
        eng, calls = scenario
        note(repr(eng))
        for c in calls:
            note(repr(c))
        state = _state(eng)
        # uvicorn configures its loggers as it starts: listen to them after that.
        app = _Handling(create_app(state))
        with serve_in_thread(app) as url, _errors_logged() as logged:
            seen = asyncio.run(_run(url, calls))
            for c, s in zip(calls, seen, strict=True):
                reason = s.final["choices"][0]["finish_reason"] if s.answered else ""
                event(f"{s.status or s.gone} {reason}")
                note(f"#{c.i}: {s.status} {s.gone} {s.text!r} {s.final.get('duetime')} {s.error}")
            problems = [
                f"#{c.i}: {p}" for c, s in zip(calls, seen, strict=True) for p in _check(eng, c, s)
            ]
            problems += _same_prompt_same_answer(eng, calls, seen)
            assert not problems, "\n".join(problems)
            _idle(state, app)
            assert httpx.get(url + "/health").json()["status"] == "ok"
            issued = next(state.engine._rids) - 1  # ids handed out so far
            problems = _check_metrics(calls, seen, _metrics(url), issued)
            assert not problems, "\n".join(problems)
            # the server still answers: judged without the scenario's own request timeout
            # (as short as 50 ms, which a loaded machine's first step can outlast)
            state.config.request_timeout_s = HANG_S
            after = httpx.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "ignore_eos": True},
                timeout=HANG_S,
            )
            assert after.status_code == 200, after.text
            _idle(state, app)
            # A crash the client never saw (it had left) is still a crash.
            assert not logged, "\n".join(logged)

    check()
