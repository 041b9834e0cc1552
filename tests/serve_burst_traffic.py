"""What the all-policies server tests share: a server state of the tiny model with
:class:`CharCodec` (one character per token) under a given policy, a wait until the
engine holds no request, KV or per-request state, the reference answer a request must
get (the model's greedy continuation), the random burst of mixed requests, the client
that sends one of them, and the checks of what it got back.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from duetime.engine.gemma3 import Gemma3
from duetime.engine.generate import greedy_generate
from duetime.server.app import ServerState
from duetime.server.build import ServeOptions, build_state
from duetime.server.chat_template import render_chat
from duetime.server.schemas import ChatMessage
from tests.factories import answer_shape_problems
from tests.served import EOS, MODEL, CharCodec, answer_stops, turn_ended


def policy_state(
    model: Gemma3,
    policy: str,
    policy_kwargs: dict[str, Any] | None = None,
    predictor: Any = None,
    **kw: Any,
) -> ServerState:
    """A server state; ``predictor`` (an object: the server builds only named ones) is
    installed before the policy checks that it has what it needs."""
    options = ServeOptions(
        model="tiny", predictor=None, policy=policy, policy_kwargs=policy_kwargs, **kw
    )
    with pytest.MonkeyPatch.context() as mp:
        if predictor is not None:
            mp.setattr("duetime.server.build._predictor", lambda _options: predictor)
        return build_state(options, model, CharCodec(), MODEL)


def wait_drained(state: ServerState, timeout: float = 15.0) -> None:
    """Wait until the engine holds no request, no KV and no per-request state (or fail)."""
    deadline = time.monotonic() + timeout
    engine = state.engine
    while time.monotonic() < deadline:
        s, ex = engine.stats, engine.executor
        quiet = not (s.kv_used or s.running or s.waiting or s.suspended or engine.inbox_size)
        held = ex.kv_used or ex.kv_device or ex.seqs or ex.records or ex.tokens or ex.slots
        kept = engine._live or ex.stop_tokens or ex.segmenters
        if quiet and not held and not kept:
            return
        time.sleep(0.02)
    ex = engine.executor
    status = {rid: seq.status.name for rid, seq in ex.seqs.items()}
    pytest.fail(f"engine not idle: {engine.stats}, seqs={status}, live={list(engine._live)}")


# --- what the answer must be ----------------------------------------------------------
class Reference:
    """The engine's greedy continuation of a prompt, and the answer a request must get."""

    def __init__(self, model: Gemma3) -> None:
        self.model = model
        self.codec = CharCodec()
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, ids: Sequence[int], n: int) -> list[int]:
        key = tuple(ids)
        have = self._cache.get(key, [])
        if len(have) < n:
            have = self._cache[key] = greedy_generate(self.model, [list(ids)], n)[0]
        return have[:n]

    def answer(
        self, ids: Sequence[int], body: dict[str, Any], max_tokens: int, chat: bool
    ) -> tuple[str, str, int]:
        """(text, finish reason, tokens sent) of a request that ran to its end.

        A stop string is found when its last token arrives: the tokens sent reach
        its end, the text stops before it."""
        gen = self.tokens(ids, max_tokens)
        reason = "length"
        if not body.get("ignore_eos"):
            floor = max(body.get("min_tokens", 0), 1)
            for i, tok in enumerate(gen):
                if tok == EOS and i + 1 >= floor:
                    gen, reason = gen[: i + 1], "stop"
                    break
        text = self.codec.decode(gen)
        stops = [s for s in answer_stops(body, chat) if s in text]
        if stops:
            cut = min(text.find(s) for s in stops)
            return text[:cut], "stop", min(text.find(s) + len(s) for s in stops)
        return text, reason, len(gen)


# --- the burst ----------------------------------------------------------------------
PROMPTS = ["f", "v", "P", "U", "a", "e", "w", "abc", "zz", "Count: one two", "x" * 30]
STOPS = ["?", "x", "u", "\u00d2", "??", "cu", "\x14", " "]


@dataclass
class Spec:
    i: int
    chat: bool
    body: dict[str, Any]
    ids: list[int]
    max_tokens: int
    kind: str = "normal"  # or "disconnect" (a stream dropped after `cut` events), "cancel"
    cut: int = 0
    after: float = 0.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Result:
    status: int | str  # an HTTP status, or "gone" for a client that left
    text: str = ""
    final: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def burst_specs(seed: int, codec: CharCodec, max_context: int, n: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        chat = rng.random() < 0.35
        stream = rng.random() < 0.5
        p = rng.choice(PROMPTS)
        if chat:
            messages = [{"role": "user", "content": p}]
            ids = codec.encode(render_chat([ChatMessage(**m) for m in messages]))
            body: dict[str, Any] = {"model": MODEL, "messages": messages}
        else:
            ids = codec.encode(p)
            prompt: Any = ids if rng.random() < 0.15 else p
            body = {"model": MODEL, "prompt": prompt}
            if rng.random() < 0.1:
                body["echo"] = True
                if rng.random() < 0.5:  # score the prompt too
                    body["logprobs"] = rng.choice([0, 2])
        room = max_context - len(ids)
        long = rng.random() < 0.2
        mt = rng.randint(room // 2, room) if long else rng.randint(1, 20)
        if chat and rng.random() < 0.2:
            mt = min(256, room)  # the default cap: none sent
        elif chat and rng.random() < 0.3:
            body["max_completion_tokens"] = mt
        else:
            body["max_tokens"] = mt
        body["stream"] = stream
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        r = rng.random()
        if r < 0.2:
            body["deadline_ms"] = rng.choice([1, 30, 200])
        elif r < 0.45:
            body["deadline_ms"] = 60_000
        if rng.random() < 0.3:
            body["priority"] = rng.randint(-5, 5)
        body["ignore_eos"] = rng.random() < 0.4
        if rng.random() < 0.35:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.1:
            body["min_tokens"] = min(mt, 3)
        if rng.random() < 0.12:
            body["segment"] = rng.choice(["sentence", "action"])
        if rng.random() < 0.1:
            body["kv_eviction"] = rng.choice(["auto", 0.5])
        if rng.random() < 0.1:
            body["tuf"] = {"ert_ms": rng.choice([10, 500])}
        if rng.random() < 0.1:
            body["overrun"] = rng.choice(["kill", "skip_next"])
        if rng.random() < 0.2:
            body["klass"] = rng.choice(["a", "b"])
        spec = Spec(i, chat, body, ids, mt)
        x = rng.random()
        if stream and x < 0.2:
            spec.kind, spec.cut = "disconnect", rng.randint(0, 4)
        elif not stream and x < 0.12:
            spec.kind, spec.after = "cancel", rng.choice([0.0, 0.005, 0.1])
        specs.append(spec)
    return specs


async def send_spec(client: httpx.AsyncClient, url: str, spec: Spec) -> Result:
    if spec.kind == "cancel":
        task = asyncio.ensure_future(client.post(url + spec.path, json=spec.body))
        await asyncio.sleep(spec.after)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return Result("gone")
        return _whole(spec, task.result())
    if not spec.body["stream"]:
        return _whole(spec, await client.post(url + spec.path, json=spec.body))
    async with client.stream("POST", url + spec.path, json=spec.body) as r:
        if r.status_code != 200:
            return _whole(spec, r, await r.aread())
        res = Result(200)
        events = []
        async for line in r.aiter_lines():
            if not line:
                continue
            if spec.kind == "disconnect" and len(events) >= spec.cut:
                return Result("gone")
            events.append(line)
        if not events or events[-1] != "data: [DONE]" or events.count("data: [DONE]") != 1:
            res.problems.append(f"stream does not end with one [DONE]: {events[-2:]}")
        finals = []
        for line in events[:-1]:
            assert line.startswith("data: "), line
            obj = json.loads(line.removeprefix("data: "))
            if "error" in obj:
                res.error = obj["error"]
                continue
            for c in obj["choices"]:
                res.text += (c["delta"].get("content") or "") if spec.chat else c["text"]
                if c["finish_reason"] is not None:
                    finals.append(obj)
            if obj.get("usage"):
                res.usage = obj["usage"]
        if res.error is not None:
            res.problems.append(f"SSE error event: {res.error}")
        elif len(finals) != 1:
            res.problems.append(f"{len(finals)} chunks with a finish_reason")
        else:
            res.final = finals[0]
        if spec.body.get("stream_options") and res.usage is None and res.error is None:
            res.problems.append("include_usage but no usage chunk")
        return res


def _whole(spec: Spec, r: httpx.Response, content: bytes | None = None) -> Result:
    data = json.loads(content if content is not None else r.content)
    if r.status_code != 200:
        return Result(r.status_code, error=data.get("error"), headers=dict(r.headers))
    c = data["choices"][0]
    text = c["message"]["content"] if spec.chat else c["text"]
    return Result(200, text=text, final=data, usage=data.get("usage"))


def check_answer(spec: Spec, res: Result, ref: Reference) -> list[str]:
    """What is wrong with one request's answer (empty: nothing)."""
    bad = list(res.problems)
    if res.status == "gone":
        return bad
    if res.status != 200:
        if res.status != 429:
            return [*bad, f"status {res.status}: {res.error}"]
        if not (res.error and res.error.get("message") and res.error.get("type")):
            bad.append(f"429 without an error object: {res.error}")
        if int(res.headers.get("retry-after", "0")) < 1:
            bad.append("429 without Retry-After")
        return bad
    if not res.final:
        return bad
    choice = res.final["choices"][0]
    reason = choice["finish_reason"]
    timing = res.final.get("duetime")
    if timing is None:
        return [*bad, "no duetime object"]
    n = timing["completion_tokens"]
    if res.usage is not None and res.usage["completion_tokens"] != n:
        bad.append(f"usage {res.usage} but duetime.completion_tokens {n}")
    if res.usage is not None and res.usage["prompt_tokens"] != len(spec.ids):
        bad.append(f"usage {res.usage} for a prompt of {len(spec.ids)} tokens")
    text = res.text
    lp = choice.get("logprobs")
    scored = spec.body.get("echo") and lp is not None and not spec.body.get("stream")
    if scored:  # a whole answer's scored prompt (a stream's last chunk has its own tokens)
        p = len(spec.ids)
        if lp["token_logprobs"][0] is not None or len(lp["tokens"]) < p:
            bad.append(f"scored prompt of {p} tokens: {lp['token_logprobs'][:3]}...")
        elif n and None in lp["token_logprobs"][1:]:  # its prefill ran: every score is in
            bad.append("a prompt position without a score after the prefill")
        if "".join(lp["tokens"]) != text:
            bad.append(f"scored tokens {lp['tokens']!r} do not make up {text!r}")
    if spec.body.get("echo"):
        echo = CharCodec().decode(spec.ids[1:])
        if not text.startswith(echo):
            return [*bad, f"echo missing: {text!r}"]
        text = text[len(echo) :]
    want, want_reason, want_n = ref.answer(spec.ids, spec.body, spec.max_tokens, spec.chat)
    if reason not in ("stop", "length", "abort"):
        bad.append(f"finish_reason {reason!r}")
    elif timing["kv_eviction_ratio"] > 0:  # evicting KV changes the answer
        pass
    elif reason != "abort":
        if (text, reason, n) != (want, want_reason, want_n):
            bad.append(
                f"answer {text!r} {reason} ({n} tokens), the model's is {want!r} "
                f"{want_reason} ({want_n} tokens)"
            )
    elif not want.startswith(text):  # cut short by the policy: what was sent stands
        bad.append(f"aborted answer {text!r} is not a prefix of {want!r}")
    full = ref.codec.decode(ref.tokens(spec.ids, spec.max_tokens))
    turn_end_cut = turn_ended(spec.body, spec.chat, full)
    cut = spec.body.get("stop") or turn_end_cut  # a stop string's tokens count, not its text
    if not cut and len(text) != n:  # one character per token
        bad.append(f"{len(text)} characters sent but completion_tokens {n}")
    bad += answer_shape_problems(n, reason, spec.max_tokens, timing)
    e2e = timing["e2e_ms"]
    budget = spec.body.get("deadline_ms")
    met = timing["deadline_met"]
    if budget is None:
        if met is not None:
            bad.append(f"deadline_met {met} without a deadline")
    elif abs(e2e - budget) > 0.01 and met != (reason in ("stop", "length") and e2e <= budget):
        bad.append(f"deadline_met {met}: {reason}, e2e {e2e} ms, deadline {budget} ms")
    return bad


def metric_value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))
