"""What structured outputs cost on the engine: time a token with and without a grammar.

``duetime bench grammar``. The same prompts are served as one batch of
concurrent requests, once unconstrained and once under each kind of grammar,
on the same model in the same process, so the ratios are side by side. Each
grammar is one no answer can finish within ``new_tokens`` (a string of at least
4,000 characters, an array of 4,000 items, 4,000 commands), so every run makes
exactly ``new_tokens`` tokens per request and the figures differ only by the
masks: llguidance computing the allowed tokens and the executor applying them
to each row of logits. Every constrained answer is checked for fitting its
grammar so far (``valid_pct``). The one-off costs are reported apart: building
the tokenizer's table for llguidance (once per process) and compiling each
grammar (once per distinct grammar; the server keeps them).

:func:`run_jump` measures jump-forward apart: a robot command's JSON, whose keys
and punctuation the grammar forces, with forced tokens one decode step each and
riding along in one chunk each, on the same requests (the answers must be the
same). :func:`run_admission` sends such commands under a deadline through the
server (in process, a fresh server an arm), judged by the steps the grammar's
answers take (``server/grammar_steps.py``) or by a step a token, as before.
:func:`run_bursts` has a fleet send them together, round after round, to see how
a burst's forecasts count its companions (``server/recent_load.py``).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from duetime.bench.engine_fit import burst_jobs, warm_up
from duetime.core.grammar import AnswerWork, GrammarSpec
from duetime.core.request import Job, LengthPrediction
from duetime.engine.executor import GRAMMAR_GATHER_MAX, EngineExecutor
from duetime.engine.grammar import GrammarCompiler
from duetime.policies import make_policy
from duetime.server.grammar_steps import GrammarSteps

__all__ = [
    "COMMAND",
    "COMMAND_PROMPTS",
    "GRAMMARS",
    "TABLE_KEYS",
    "run",
    "run_admission",
    "run_bursts",
    "run_jump",
    "table_columns",
]

_STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 4000}},
    "required": ["story"],
    "additionalProperties": False,
}
_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 4000}
_COMMANDS = 'start: cmd~4000\ncmd: "go " | "stop " | "turn left " | "wait "'

_ITEM = r'"(?:[^"\\]|\\.)*"'
#: The beginnings of a JSON array of strings written with ", " between items.
_ARRAY_PREFIX = rf'\[(?:{_ITEM}, )*(?:{_ITEM},? ?|"(?:[^"\\]|\\.)*\\?)?'

#: name → (grammar no answer finishes within a few hundred tokens, check of a prefix of it)
GRAMMARS: dict[str, tuple[GrammarSpec, Callable[[str], bool]]] = {
    "json_schema": (
        GrammarSpec.json_schema(_STORY, "bench"),
        lambda t: t.startswith('{"story": "'[: len(t)]),
    ),
    "json_array": (
        GrammarSpec.json_schema(_LIST, "bench"),
        lambda t: re.fullmatch(_ARRAY_PREFIX, t) is not None,
    ),
    "regex": (
        GrammarSpec("regex", "[a-z ,.]{4000,}", "bench"),
        lambda t: re.fullmatch("[a-z ,.]*", t) is not None,
    ),
    "lark": (
        GrammarSpec("grammar", _COMMANDS, "bench"),
        lambda t: re.fullmatch("(go |stop |turn left |wait )*[a-z ]*", t) is not None,
    ),
}


#: The label suffix of a grammar served with every row's whole logits masked (the
#: output layer's product over the vocabulary), not a gather of the allowed columns.
WHOLE = ":whole"


def _serve(
    model: Any,
    jobs: list[Job],
    compiler: GrammarCompiler,
    spec: GrammarSpec | None,
    *,
    gather: bool = True,
) -> tuple[Any, float]:
    ex = EngineExecutor(
        make_policy("fcfs"),
        model,
        kv_capacity=sum(j.request.prompt_len + j.output_len for j in jobs) + 64,
        max_num_seqs=len(jobs),
        max_batch_tokens=4096,
        check_accounting=False,
        grammar_gather_max=GRAMMAR_GATHER_MAX if gather else 0,
    )
    if spec is not None:
        for j in jobs:
            ex.grammars[j.request.rid] = compiler.grammar(spec)
    t = time.perf_counter()
    res = ex.run(jobs)
    return res, time.perf_counter() - t


def run(
    model: Any,
    compiler: GrammarCompiler,
    decode: Callable[[Sequence[int]], str],
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    kinds: Sequence[str] = tuple(GRAMMARS),
    whole_rows: bool = True,
) -> dict[str, Any]:
    """Serve ``prompts`` as one batch without a grammar and under each of ``kinds``,
    ``repeats`` times interleaved; figures JSON-ready (medians over the repeats).

    ``whole_rows``: each kind is also served with every row's whole logits masked
    (label ``<kind>:whole``), and ``gather_speedup.<kind>`` is that time over the
    default's, where rows whose grammar allows few tokens take only their logits."""
    unknown = [k for k in kinds if k not in GRAMMARS]
    if unknown:
        raise ValueError(f"unknown grammar kind(s) {unknown}; choose from {', '.join(GRAMMARS)}")
    if repeats < 1 or new_tokens < 1 or not prompts:
        raise ValueError("need prompts, new_tokens >= 1 and repeats >= 1")
    t = time.perf_counter()
    compiler.tokenizer  # noqa: B018  (built here, timed apart)
    build_s = time.perf_counter() - t
    compile_ms = {}
    for kind in kinds:
        t = time.perf_counter()
        compiler.compile(GRAMMARS[kind][0])
        compile_ms[kind] = 1e3 * (time.perf_counter() - t)
    warm_up(model)
    constrained = [*kinds, *(k + WHOLE for k in kinds if whole_rows)]
    labels = ["none", *constrained]
    walls: dict[str, list[float]] = {k: [] for k in labels}
    valid: dict[str, list[bool]] = {k: [] for k in constrained}
    tokens = len(prompts) * new_tokens
    for _ in range(repeats):
        for label in labels:  # interleaved: a noisy neighbour hits every label alike
            kind = label.removesuffix(WHOLE)
            spec = None if label == "none" else GRAMMARS[kind][0]
            jobs = burst_jobs(prompts, new_tokens)
            res, wall = _serve(model, jobs, compiler, spec, gather=not label.endswith(WHOLE))
            made = sum(len(out) for out in res.outputs.values())
            if made != tokens:
                raise RuntimeError(f"{label}: {made} tokens made, {tokens} expected")
            walls[label].append(wall)
            if label != "none":
                fits = GRAMMARS[kind][1]
                valid[label] += [fits(decode(out)) for out in res.outputs.values()]
    base = statistics.median(walls["none"])
    runs: dict[str, dict[str, Any]] = {}
    for label in labels:
        wall = statistics.median(walls[label])
        runs[label] = {
            "wall_s": wall,
            "ms_per_token": 1e3 * wall / tokens,
            "overhead_pct": 100.0 * (wall / base - 1.0),
            "valid_pct": None if label == "none" else 100.0 * statistics.fmean(valid[label]),
            "compile_ms": compile_ms.get(label.removesuffix(WHOLE)),
        }
    gather_speedup = {k: runs[k + WHOLE]["wall_s"] / runs[k]["wall_s"] for k in kinds if whole_rows}
    return {
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "tokenizer_build_s": build_s,
        "runs": runs,
        "worst_overhead_pct": max(runs[k]["overhead_pct"] for k in kinds) if kinds else 0.0,
        "gather_speedup": gather_speedup,
    }


#: A robot's command as OpenAI's SDK sends a pydantic model (strict): most of its text is
#: keys and punctuation the grammar forces, a few tokens are the model's choices.
COMMAND = {
    "type": "object",
    "properties": {
        "action": {"enum": ["move", "grasp", "release", "stop"]},
        "target": {"enum": ["cup", "plate", "bottle", "door"]},
        "speed": {"enum": ["slow", "normal", "fast"]},
        "confirm_before_acting": {"type": "boolean"},
    },
    "required": ["action", "target", "speed", "confirm_before_acting"],
    "additionalProperties": False,
}


def run_jump(
    model: Any,
    compiler: GrammarCompiler,
    prompts: Sequence[Sequence[int]],
    *,
    repeats: int = 3,
    schema: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The same requests under a command schema with jump-forward off and on (forced
    tokens one decode step each, or riding along in one chunk), interleaved: the same answers
    (checked), in how many steps and how long. Figures JSON-ready."""
    spec = GrammarSpec.json_schema(COMMAND if schema is None else schema, "bench")
    warm_up(model)
    walls: dict[bool, list[float]] = {False: [], True: []}
    figs: dict[bool, dict[str, Any]] = {}
    outputs: dict[bool, Any] = {}
    for _ in range(repeats):
        for jump in (False, True):
            jobs = burst_jobs(prompts, 256)  # (the grammar ends each answer long before)
            ex = EngineExecutor(
                make_policy("fcfs"), model, max_num_seqs=len(jobs), check_accounting=False
            )
            ex.jump_forward = jump
            for j in jobs:
                ex.grammars[j.request.rid] = compiler.grammar(spec)
            t = time.perf_counter()
            res = ex.run(jobs)
            walls[jump].append(time.perf_counter() - t)
            outputs[jump] = res.outputs
            figs[jump] = {
                "engine_steps": res.engine_steps,
                "tokens": sum(len(o) for o in res.outputs.values()),
                "forced_tokens_jumped": ex.counters.get("forced_tokens_jumped", 0),
            }
    for jump in (False, True):
        figs[jump]["wall_s"] = statistics.median(walls[jump])
    off, on = figs[False], figs[True]
    return {
        "requests": len(prompts),
        "off": off,
        "on": on,
        "answers_identical": outputs[False] == outputs[True],
        "speedup": off["wall_s"] / on["wall_s"],
        "steps_ratio": off["engine_steps"] / max(1, on["engine_steps"]),
    }


#: What a robot's client asks under :data:`COMMAND` (:func:`run_admission`).
COMMAND_PROMPTS = (
    "Pick up the cup now.",
    "Open the door slowly.",
    "Stop!",
    "Grab the bottle fast, then stop.",
    "Put the plate down.",
)


def run_admission(
    make_state: Callable[[], Any],
    model_name: str,
    *,
    requests: int = 10,
    deadline_ms: float = 500.0,
    learn: bool = True,
) -> dict[str, Any]:
    """``requests`` robot commands under ``deadline_ms``, one after another, through a
    fresh server from ``make_state`` (no answer under the schema before them): judged
    by the steps the grammar's answers take (``learn``) or by a step a token. How many
    were accepted and met, and each accepted one's forecast and actual end-to-end."""
    state = make_state()
    if not learn:
        state.grammar_steps = _StepPerToken()
    forecast, actual, refused = [], [], 0
    met = 0
    with _client(state) as client:
        _warm_up(client, model_name)
        for i in range(requests):
            timing = _command(client, model_name, i, deadline_ms)
            if timing is None:
                refused += 1
                continue
            met += bool(timing["deadline_met"])
            forecast.append(timing.get("predicted_e2e_ms"))
            actual.append(timing["e2e_ms"])
    ratios = [f / a for f, a in zip(forecast, actual, strict=True) if f is not None and a > 0]
    return {
        "requests": requests,
        "deadline_ms": deadline_ms,
        "accepted": requests - refused,
        "met": met,
        "forecast_e2e_ms": forecast,
        "e2e_ms": actual,
        # how far the forecasts were from the answers' end (1: on time; the forced rows
        # riding in a structured answer's steps are what a step a row misses)
        "forecast_to_actual_e2e_median": statistics.median(ratios) if ratios else None,
    }


#: How `run_bursts` sends its fleet's commands: seconds between the rounds' starts.
BURST_PERIOD_S = 2.0


def run_bursts(
    make_state: Callable[[], Any],
    model_name: str,
    *,
    size: int = 6,
    rounds: int = 5,
    period_s: float = BURST_PERIOD_S,
    deadline_ms: float = 5000.0,
) -> dict[str, Any]:
    """A fleet of ``size`` robots, each sending a command under ``deadline_ms`` at the
    start of every round, ``period_s`` apart (open loop: a round starts on time whether
    or not the last is answered), through a fresh server from ``make_state`` that has
    learned the schema from three commands sent alone. How many were accepted and met;
    each accepted command's forecast and end-to-end; per round the smallest forecast's
    ratio to its e2e (the first judged, before the others) and the largest's."""
    from concurrent.futures import ThreadPoolExecutor

    state = make_state()
    timings: list[list[dict[str, Any] | None]] = []
    with _client(state) as client, ThreadPoolExecutor(size) as pool:
        _warm_up(client, model_name)
        for i in range(3):
            _command(client, model_name, i, deadline_ms)
        start = time.perf_counter()
        for r in range(rounds):
            time.sleep(max(0.0, start + r * period_s - time.perf_counter()))
            sent = [pool.submit(_command, client, model_name, i, deadline_ms) for i in range(size)]
            timings.append([f.result() for f in sent])
    return _burst_figures(timings, size, period_s, deadline_ms)


def _burst_figures(
    rounds: list[list[dict[str, Any] | None]], size: int, period_s: float, deadline_ms: float
) -> dict[str, Any]:
    """What the rounds' commands' timings (None: refused) come to."""
    smallest, largest, every = [], [], []
    for timings in rounds:
        seen = sorted(
            (t["predicted_e2e_ms"], t["e2e_ms"])
            for t in timings
            if t is not None and t.get("predicted_e2e_ms") and t["e2e_ms"] > 0
        )
        if seen:
            smallest.append(seen[0][0] / seen[0][1])
            largest.append(seen[-1][0] / seen[-1][1])
            every += [f / a for f, a in seen]
    accepted = [t for timings in rounds for t in timings if t is not None]
    met = sum(bool(t["deadline_met"]) for t in accepted)
    return {
        "size": size,
        "rounds": len(rounds),
        "period_s": period_s,
        "deadline_ms": deadline_ms,
        "accepted": len(accepted),
        "met": met,
        "hit_rate_of_accepted": met / len(accepted) if accepted else None,
        "accepted_per_round": [sum(t is not None for t in timings) for timings in rounds],
        "forecast_e2e_ms": [[t and t.get("predicted_e2e_ms") for t in ts] for ts in rounds],
        "e2e_ms": [[t and t["e2e_ms"] for t in ts] for ts in rounds],
        "smallest_forecast_to_e2e": smallest,
        "largest_forecast_to_e2e": largest,
        "forecast_to_e2e_median": statistics.median(every) if every else None,
    }


class _StepPerToken(GrammarSteps):
    """What admission assumed before it learned a grammar's work: a step a token, and
    the predictor's length capped at the grammar's bound."""

    def most(self, spec: GrammarSpec) -> AnswerWork | None:
        return None

    def lengths(self, spec: GrammarSpec, most: int) -> LengthPrediction | None:
        return None


def _client(state: Any) -> Any:
    from fastapi.testclient import TestClient

    from duetime.server.app import create_app

    return TestClient(create_app(state))


def _warm_up(client: Any, model_name: str) -> None:
    """The engine and its step-time fit warm up on free text, as a server that has run."""
    for _ in range(3):
        client.post(
            "/v1/completions", json={"model": model_name, "prompt": "Hello.", "max_tokens": 32}
        )


_COMMAND_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "cmd", "schema": COMMAND, "strict": True},
}


def _command(client: Any, model_name: str, i: int, deadline_ms: float) -> dict[str, Any] | None:
    """Command ``i`` (of :data:`COMMAND_PROMPTS`, in turn) under ``deadline_ms``: the
    answer's ``duetime`` timing, or None where it was refused (429)."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": COMMAND_PROMPTS[i % len(COMMAND_PROMPTS)]}],
        "max_tokens": 128,
        "response_format": _COMMAND_FORMAT,
        "deadline_ms": deadline_ms,
    }
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code == 429:
        return None
    if r.status_code != 200:
        raise RuntimeError(f"the server answered {r.status_code}: {r.text[:200]}")
    timing: dict[str, Any] = r.json()["duetime"]
    return timing


TABLE_KEYS = ("ms_per_token", "overhead_pct", "valid_pct", "compile_ms", "wall_s")


def table_columns(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One ``render_table`` column per run (rows: :data:`TABLE_KEYS`)."""
    return dict(fig["runs"])
