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
same). The same commands through the server, under a deadline, are
:mod:`duetime.bench.grammar_server`'s (re-exported here).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from duetime.bench.engine_fit import burst_jobs, warm_up
from duetime.bench.grammar_server import (
    BURST_PERIOD_S,
    COMMAND,
    COMMAND_PROMPTS,
    run_admission,
    run_bursts,
)
from duetime.core.grammar import GrammarSpec
from duetime.core.request import Job
from duetime.engine.executor import GRAMMAR_GATHER_MAX, EngineExecutor
from duetime.engine.grammar import GrammarCompiler
from duetime.policies import make_policy

__all__ = [
    "BURST_PERIOD_S",
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


TABLE_KEYS = ("ms_per_token", "overhead_pct", "valid_pct", "compile_ms", "wall_s")


def table_columns(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One ``render_table`` column per run (rows: :data:`TABLE_KEYS`)."""
    return dict(fig["runs"])
