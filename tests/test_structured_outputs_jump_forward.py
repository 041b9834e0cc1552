"""Structured outputs: jump-forward, the tokens a grammar forces fed in one chunk.

On the tiny byte-codec model under a schema with long keys: forced runs take far
fewer steps with the same answers, the grammar's walk counts the steps and riding
rows its answers take, a stop token ends an answer before a forced run, concurrent
jumps share the free memory, and a jumped answer's blocks reach the prefix cache.
"""

from __future__ import annotations

import pytest

from duetime.core.grammar import GrammarSpec
from duetime.core.request import Job, Request
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.grammar import GrammarCompiler
from duetime.policies import make_policy
from duetime.server.codec import ByteCodec
from tests.factories import SIMPLE_COST
from tests.grammar_cases import CODEC, SPECS, answer_text, fits
from tests.grammar_fixtures import compiler_fixture, model_fixture  # noqa: F401 (pytest fixtures)


def _count_extra_rows(ex: EngineExecutor, into: list[int]) -> None:
    """Have ``ex`` append to ``into`` each step's rows beyond its prefill and decoders."""
    log_step = ex._log_step

    def count_rows(
        computed: int, attn: float, n_dec: int, kv: int, dt: float, chunks: list[tuple[int, int]]
    ) -> None:
        assert ex.last_step is not None
        into.append(ex.last_step[1] - computed)  # (its P: computed rows + riding rows)
        log_step(computed, attn, n_dec, kv, dt, chunks)

    ex._log_step = count_rows  # type: ignore[method-assign]


def test_forced_runs_jump_ahead_in_fewer_steps_with_the_same_answers(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """Jump-forward: the tokens a grammar forces (the long keys, the JSON punctuation)
    are fed in one chunk each instead of one decode step each; the answers are the
    same as one step a token, in far fewer steps."""
    jobs = _long_key_jobs(4, "call")
    runs = {}
    extra_rows: list[int] = []  # each step's rows beyond its prefill and its decoders
    for jump in (False, True):
        ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
        ex.jump_forward = jump
        for j in jobs:
            ex.grammars[j.request.rid] = compiler.grammar(SPECS[4])
        if jump:
            _count_extra_rows(ex, extra_rows)
        runs[jump] = (ex.run(jobs), ex)
    (step_res, _), (jump_res, jump_ex) = runs[False], runs[True]
    assert jump_res.outputs == step_res.outputs
    assert all(fits(SPECS[4], answer_text(out)) for out in jump_res.outputs.values())
    assert jump_ex.counters["forced_tokens_jumped"] > 0.8 * sum(
        len(o) for o in jump_res.outputs.values()
    )
    # each answer's own count, which a server learns its grammar's steps from
    assert sum(jump_ex.jumped.values()) == jump_ex.counters["forced_tokens_jumped"]
    assert set(jump_ex.jumped) == set(jump_res.outputs)
    # of those, the ones that rode as rows of a step are the rows the steps computed
    # beyond their prefill and decoders (the rest ended an answer: never fed back)
    assert sum(jump_ex.rode.values()) == sum(extra_rows) > 0
    assert all(0 < jump_ex.rode[rid] < jump_ex.jumped[rid] for rid in jump_res.outputs)
    assert jump_res.engine_steps < step_res.engine_steps / 4, (
        jump_res.engine_steps,
        step_res.engine_steps,
    )


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[3], SPECS[4]], ids=str)
def test_the_grammar_walk_counts_at_least_the_steps_its_answers_take(
    model: Gemma3, compiler: GrammarCompiler, spec: GrammarSpec
) -> None:
    """``choice_steps`` walks a grammar without the model (its forced runs, the choices
    left, where they are few): for these grammars no answer the engine made under them
    took more steps (tokens less those that jumped), and the walk is at most one step
    over the most; its riding rows are the most any answer's forced runs computed, to
    a token (the walk's path and the model's may tokenise a choice differently). Free
    text (the regex's digits) it does not count."""
    prior = compiler.grammar(spec).choice_steps()
    assert prior is not None
    jobs = _long_key_jobs(6, "walk")
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
    for j in jobs:
        ex.grammars[j.request.rid] = compiler.grammar(spec)
    res = ex.run(jobs)
    steps = [len(out) - ex.jumped.get(rid, 0) for rid, out in res.outputs.items()]
    rode = [ex.rode.get(rid, 0) for rid in res.outputs]
    assert all(fits(spec, answer_text(out)) for out in res.outputs.values())
    assert max(steps) <= prior.steps <= max(steps) + 1, (steps, prior)
    assert abs(prior.rows - max(rode)) <= 1, (rode, prior)


def test_the_grammar_walk_gives_up_on_free_text(compiler: GrammarCompiler) -> None:
    free = GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}}, "s"
    )
    assert compiler.grammar(free).choice_steps() is None
    assert compiler.grammar(SPECS[1]).choice_steps(fanout=5) is None  # ten digits to choose from


def test_a_stop_token_ends_the_answer_before_a_forced_run(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """The model picks "a" or "b", then the grammar forces "xyz": where the client's stop
    ids hold "a" and "b", the answer ends at the one picked (jumped or not)."""
    from duetime.engine.executor import StopRule

    a, b = ord("a") + ByteCodec.OFFSET, ord("b") + ByteCodec.OFFSET
    for jump in (True, False):
        jobs = _long_key_jobs(3, "stop")
        ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
        ex.jump_forward = jump
        for j in jobs:
            ex.grammars[j.request.rid] = compiler.grammar(GrammarSpec("regex", "(a|b)xyz", "r"))
            ex.stop_tokens[j.request.rid] = StopRule(frozenset({a, b}))
        res = ex.run(jobs)
        assert all(out in ([a], [b]) for out in res.outputs.values()), (jump, res.outputs)


def test_concurrent_jumps_share_the_free_memory(model: Gemma3, compiler: GrammarCompiler) -> None:
    """Four answers' forced runs (40-odd tokens each) at once, with room for about 110:
    together they take no more than is free; the rest come later, and every answer
    still fits its grammar with the books and the cache agreeing after every step."""
    jobs = _long_key_jobs(4, "call")
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST, kv_capacity=150)
    for j in jobs:
        ex.grammars[j.request.rid] = compiler.grammar(SPECS[4])
    res = ex.run(jobs)
    assert ex.counters["forced_tokens_jumped"] > 0
    assert res.kv_peak <= ex.kv_capacity
    assert all(fits(SPECS[4], answer_text(out)) for out in res.outputs.values())


def test_a_jumped_answer_offers_its_blocks_to_the_prefix_cache(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """A forced run crosses cache blocks (16 tokens) many times the tiny model's sliding
    window (4): each block it fills is offered before its KV can be trimmed, so the next
    turn (prompt + this answer) finds the answer's blocks in the cache."""
    first = _long_key_jobs(1, "a conversation that goes on")[0]
    ex = _ChainChecked(
        make_policy("fcfs"), model, cost=SIMPLE_COST, prefix_cache_tokens=1024, eviction="streaming"
    )
    ex.grammars[0] = compiler.grammar(SPECS[4])
    res = ex.run([first])
    answer = res.outputs[0]
    assert ex.counters["forced_tokens_jumped"] > 32
    ids = (*(first.request.prompt_token_ids or ()), *answer, *CODEC.encode(" next")[1:])
    nxt = Request(rid=1, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=1)
    assert ex.cached_prefix_len(ids) >= (len(ids) - 1) // 16 * 16 - 16
    again = ex.run([Job(nxt, output_len=1)])
    assert again.records[0].cached_prompt_tokens >= 48


class _ChainChecked(EngineExecutor):
    """Checks after every step that each decoder has offered the prefix cache every
    block its KV holds (none waits for a later step, when its KV may be trimmed)."""

    def _check_kv(self) -> None:
        super()._check_kv()
        assert self.prefix_cache is not None
        size = self.prefix_cache.block_size
        for seq in self.running.values():
            chain = self._chains.get(seq.rid)
            if chain is not None and seq.decoding:
                assert chain[0] == self._kv_positions(seq) // size, (seq, chain)


def _long_key_jobs(n: int, text: str) -> list[Job]:
    jobs = []
    for rid in range(n):
        ids = CODEC.encode(f"{text} {rid}")
        req = Request(
            rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=tuple(ids), max_tokens=120
        )
        jobs.append(Job(req, output_len=120))
    return jobs
