"""Every registered policy serves real HTTP traffic correctly (tiny random model).

A policy never knows whether it drives the simulator or the engine, so each one
is put behind `duetime serve` and sent one burst of concurrent requests:
completions and chats, streamed and not, short and long answers, tight and
loose deadlines, priorities, ``ignore_eos``, stop strings, segments, KV
eviction, and clients that disconnect mid-stream or give up before the first
token. The engine is small (KV for 192 tokens, 3 sequences, 48 tokens a step),
so requests are preempted, restarted, swapped and cancelled.

Each request must get exactly one well-formed answer (a 200 or a 429 with an
error object; never a 5xx, never a hang); a finished answer is the model's own
greedy continuation cut where its finish reason says, and an answer the policy
cut short is a prefix of it (a client never sees a token change); the usage and
``duetime`` fields agree with what was sent; afterwards the engine holds no
request and no KV.

The server runs here with :class:`CharCodec`, one character per token id, so
that text and tokens can be compared one to one (the byte codec turns this
model's answers into U+FFFD).
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

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, LengthPrediction, Request
from duetime.engine.gemma3 import Gemma3
from duetime.engine.generate import greedy_generate
from duetime.policies.registry import available_policies, make_policy
from duetime.server.app import ServerState, create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.chat_template import render_chat
from duetime.server.schemas import ChatMessage
from duetime.server.threaded import serve_in_thread
from duetime.sim import SimConfig, Simulator
from tests.factories import answer_shape_problems
from tests.served import EOS, MODEL, CharCodec, HalfPredictor


@pytest.fixture(scope="module")
def model() -> Gemma3:
    options = ServeOptions(model="tiny", predictor=None)
    return load_served_model(options)[0]


def _state(
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


def _idle(state: ServerState, timeout: float = 15.0) -> None:
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
        self, ids: Sequence[int], body: dict[str, Any], max_tokens: int
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
        stops = [s for s in body.get("stop") or [] if s in text]
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


def _specs(seed: int, codec: CharCodec, max_context: int, n: int) -> list[Spec]:
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


async def _send(client: httpx.AsyncClient, url: str, spec: Spec) -> Result:
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


def _check(spec: Spec, res: Result, ref: Reference) -> list[str]:
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
    want, want_reason, want_n = ref.answer(spec.ids, spec.body, spec.max_tokens)
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
    if not spec.body.get("stop") and len(text) != n:  # one character per token
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


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


@dataclass(frozen=True)
class Case:
    policy: str
    kwargs: dict[str, Any] | None = None
    seed: int = 0

    def __str__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in (self.kwargs or {}).items())
        return self.policy + (f"[{args}]" if args else "")


CASES = [Case(p, seed=i) for i, p in enumerate(available_policies())] + [
    Case("fcfs", {"preempt_mode": "restart"}, seed=101),
    Case("edf", {"preempt_mode": "swap"}, seed=102),
    Case("deferred-prefill", {"k": 3}, seed=103),
    Case("timebill", {"overrun": "skip-next"}, seed=104),
]


def test_every_registered_policy_is_covered() -> None:
    assert {c.policy for c in CASES} == set(available_policies())
    assert len(available_policies()) >= 12


@pytest.fixture(scope="module")
def reference(model: Gemma3) -> Reference:
    return Reference(model)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_burst_of_mixed_requests_is_served_correctly(
    model: Gemma3, reference: Reference, case: Case
) -> None:
    # hsf schedules by predicted lengths and refuses to be served without a predictor
    predictor = HalfPredictor() if case.policy == "hsf" else None
    state = _state(
        model,
        case.policy,
        case.kwargs,
        predictor,
        kv_capacity=192,
        max_num_seqs=3,
        max_batch_tokens=48,
    )
    specs = _specs(case.seed, CharCodec(), state.config.max_context, n=24)
    with serve_in_thread(create_app(state)) as url:

        async def burst() -> list[Result]:
            timeout = httpx.Timeout(30.0)
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                return await asyncio.gather(*(_send(client, url, s) for s in specs))

        results = asyncio.run(burst())
        _idle(state)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        metrics = httpx.get(url + "/metrics").text
        for gauge in (
            "duetime_queue_length",
            "duetime_running",
            "duetime_suspended",
            "duetime_kv_used_tokens",
        ):
            assert _metric(metrics, gauge) == 0, gauge
        assert _metric(metrics, "duetime_engine_errors") == 0
        assert 'reason="error"' not in metrics
        # The server still answers: one more request, after the burst.
        after = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "ignore_eos": True},
            timeout=30,
        )
        assert after.status_code == 200, after.text
        # The step times are known by now: a deadline no step could meet is refused.
        hopeless = httpx.post(
            url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "abc",
                "max_tokens": 60,
                "ignore_eos": True,
                "deadline_ms": 1,
            },
        )
        assert hopeless.status_code == 429, hopeless.text
        assert int(hopeless.headers["Retry-After"]) >= 1
        assert hopeless.json()["error"]["code"] == "deadline_unreachable"
        _idle(state)
    problems = [
        f"#{s.i} {s.body}: {p}"
        for s, r in zip(specs, results, strict=True)
        for p in _check(s, r, reference)
    ]
    assert not problems, "\n".join(problems)
    assert sum(r.status == 200 for r in results) >= len(specs) // 2


# --- regressions found by the burst ------------------------------------------------------
def test_a_request_the_policy_cannot_queue_leaves_nothing_behind() -> None:
    """hsf orders its queue by a length prediction and raises without one (served on a
    tiny model without a predictor, it did): the request failed, but its sequence stayed
    in the executor for good, WAITING in no queue, and the server went on with it."""
    sim = Simulator(make_policy("hsf"), LinearStepCost(c0=0.01, name="unit"), SimConfig())
    job = Job(Request(rid=0, arrival=0.0, prompt_len=3), 4)
    with pytest.raises(ValueError, match="length prediction"):
        sim.admit_arrival(job)
    assert not sim.seqs
    assert not sim.records
    assert len(sim.waiting) == 0
    job.request.predicted = LengthPrediction.exact(4)  # the same id, now queueable
    sim.admit_arrival(job)
    assert list(sim.seqs) == [0]


def test_a_policy_that_needs_predictions_is_refused_without_a_predictor(model: Gemma3) -> None:
    """Served without one, hsf failed every request without ignore_eos with a 500 telling
    the client to use --predictor oracle, which a server refuses."""
    with pytest.raises(ValueError, match=r"hsf.*--predictor learned"):
        _state(model, "hsf")


def test_ttft_is_when_the_client_got_its_first_token_even_after_a_restart(model: Gemma3) -> None:
    """A restart voids the executor's first-token time, but the client keeps the tokens it
    has: its TTFT was reported as the time of the re-run's first token, long after the
    client had read it (and as none at all when the request ended before the re-run)."""
    state = _state(model, "fcfs", {"preempt_mode": "restart"}, kv_capacity=64, max_batch_tokens=64)
    body = {"model": MODEL, "prompt": "P", "max_tokens": 55, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, url: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        first = None
        final: dict[str, Any] = {}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line.removeprefix("data: "))
                if first is None and obj["choices"][0]["text"]:
                    first = (time.perf_counter() - t0) * 1000
                if "duetime" in obj:
                    final = obj["duetime"]
        assert first is not None
        return first, final

    with serve_in_thread(create_app(state)) as url:

        async def both() -> list[tuple[float, dict[str, Any]]]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(one(client, url), one(client, url))

        answers = asyncio.run(both())
        _idle(state)
    assert any(timing["preemptions"] for _, timing in answers)  # one of them was restarted
    for seen_ms, timing in answers:
        assert timing["completion_tokens"] == 55
        # The server's clock starts after the client's and stops before the client reads.
        assert timing["ttft_ms"] <= seen_ms, (timing, seen_ms)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "ignore_eos", "reason", "tokens"),
    [
        ("a", 1, False, "stop", 1),  # the first token is EOS
        ("U", 2, False, "stop", 2),  # the second token is EOS
        ("U", 5, False, "stop", 2),
        ("U", 2, True, "length", 2),  # EOS is only a token here
        ("P", 2, False, "length", 2),
    ],
)
def test_an_answer_whose_last_allowed_token_is_eos_ends_with_stop(
    model: Gemma3, prompt: str, max_tokens: int, ignore_eos: bool, reason: str, tokens: int
) -> None:
    """The model ended the answer, so it is complete: "stop", as in vLLM and OpenAI. When
    EOS was also the max_tokens-th token, the answer was reported as cut ("length")."""
    state = _state(model, "fcfs", kv_capacity=256)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    with serve_in_thread(create_app(state)) as url:
        for stream in (False, True):
            r = httpx.post(url + "/v1/completions", json={**body, "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x[6:7] == "{"]
                final = next(e for e in events if e["choices"][0]["finish_reason"])
            else:
                final = r.json()
            assert final["choices"][0]["finish_reason"] == reason
            assert final["duetime"]["completion_tokens"] == tokens
        _idle(state)


def test_timebill_cancels_a_job_that_is_both_killed_and_skipped_once() -> None:
    """Requests choose their own overrun strategy: in one class, a job whose request says
    "kill" is past its deadline while an earlier one says "skip_next" and overran too. It
    was cancelled twice in one decision, an illegal step, which on the server failed every
    request in flight with a 500 (found by the burst above)."""

    def job(rid: int, output: int, deadline: float, overrun: str) -> Job:
        req = Request(
            rid=rid,
            arrival=0.0,
            prompt_len=10,
            max_tokens=100,
            deadline=deadline,
            klass="t",
            overrun=overrun,
        )
        return Job(request=req, output_len=output)

    cost = LinearStepCost.timebill(a=1e-9, b=5e-5, c=0.02, p=2e-6, q=0.01)
    sim = Simulator(make_policy("timebill"), cost, SimConfig(kv_capacity=1000, max_num_seqs=1))
    jobs = [job(0, 50, 0.05, "skip-next"), job(1, 5, 0.001, "skip-next"), job(2, 5, 0.001, "kill")]
    records = {r.request.rid: r for r in sim.run(jobs).records}
    assert records[2].cancelled_at is not None  # killed (and skipped), once
    assert records[0].finish is not None  # skip-next never kills
    assert records[1].finish is not None
