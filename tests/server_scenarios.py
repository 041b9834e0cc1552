"""The hypothesis strategies of the server property test: an engine (KV, batch limits,
policy and its options, codec, request timeout, queue limit) and a mix of concurrent
clients, malformed bodies among them, with what each must get.

Kept apart from ``tests/test_server_properties.py`` so that the test file holds the
property alone; what a call and an engine are lives in ``tests/server_calls.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from duetime.server.chat_template import render_chat
from duetime.server.codec import ByteCodec
from duetime.server.schemas import ChatMessage
from tests.server_calls import BODY_LIMIT, MODEL, Call, Engine, greedy, make_codec

VOCAB = ByteCodec.vocab_size  # the tiny model's, and both codecs' (259)
#: Prompt text: ASCII, the characters the segment rules cut at, and multi-byte ones.
ALPHABET = "abcxyz .!?\n();é€😀"


# --- strategies ------------------------------------------------------------------------
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
    codec = make_codec(eng.codec)
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
                answer = make_codec(eng.codec).decode(greedy(tuple(ids), 24))
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
        answer = greedy(tuple(ids), 24)
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
