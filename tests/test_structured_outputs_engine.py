"""Structured outputs in the engine: grammar answers through the executor.

On a tiny random-weight model with the byte codec (one token per byte), whose
unconstrained answers are noise: so an answer that fits its grammar shows the
mask at work. Answers under every policy (preemptions, restarts, a prefix cache)
are compared against a reference that shares nothing with the executor: the model
stepped alone, one token at a time, each masked by a fresh grammar. Grammar rows
whose allowed tokens are few take only those tokens' logits.
"""

from __future__ import annotations

from typing import Any

import pytest

from duetime.core.grammar import GrammarSpec
from duetime.core.request import Job, Request
from duetime.core.sampling import SamplingParams
from duetime.engine.batch import SeqChunk
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.grammar import GrammarCompiler
from duetime.engine.sampling import Sampler
from duetime.policies import available_policies, make_policy
from duetime.predict.oracle import make_job_predictor
from tests.factories import SIMPLE_COST, record_evictions
from tests.grammar_cases import CODEC, SPECS, answer_text, fits
from tests.grammar_fixtures import compiler_fixture, model_fixture  # noqa: F401 (pytest fixtures)


def _reference(
    model: Gemma3,
    compiler: GrammarCompiler,
    spec: GrammarSpec,
    prompt: list[int],
    n: int,
    sampling: SamplingParams | None = None,
) -> list[int]:
    """The constrained answer of ``prompt`` made alone: one step a token, its logits
    masked by a grammar that follows the answer, stopped where the grammar is complete.
    Tokens the grammar forces are taken as it writes them, with no draw."""
    grammar = compiler.grammar(spec)
    sampler = Sampler(sampling) if sampling is not None else None
    kv = model.new_kv_cache()
    slot = kv.allocate()
    logits = model.step([SeqChunk(slot, prompt, 0)], kv)[0]
    out: list[int] = []
    queue: list[int] = []
    while len(out) < n:
        queue = queue or grammar.take_forced()
        if queue:
            tok = queue.pop(0)
        else:
            row = grammar.mask(logits)
            tok = (
                int(row.argmax())
                if sampler is None
                else sampler.pick(row, prompt + out, len(prompt))
            )
            assert grammar.accept(tok)
        out.append(tok)
        if grammar.finished and not queue:
            break
        logits = model.step([SeqChunk(slot, [tok], len(prompt) + len(out) - 1)], kv)[0]
    return out


# --- in the engine -------------------------------------------------------------------


def _jobs(n: int, max_tokens: int = 24) -> list[Job]:
    jobs = []
    for rid in range(n):
        prompt = CODEC.encode(f"request {rid}: answer " + "abc"[rid % 3] * (rid % 5))
        req = Request(
            rid=rid,
            arrival=0.0,
            prompt_len=len(prompt),
            prompt_token_ids=tuple(prompt),
            max_tokens=max_tokens if rid % 4 else 3,
        )
        jobs.append(Job(req, output_len=req.max_tokens))
    return jobs


def _run(
    model: Gemma3,
    compiler: GrammarCompiler,
    jobs: list[Job],
    policy: Any,
    sampling: dict[int, SamplingParams],
    **kwargs: Any,
) -> tuple[EngineExecutor, dict[int, list[int]], set[int]]:
    evicted = record_evictions(policy)
    ex = EngineExecutor(
        policy,
        model,
        predictor=make_job_predictor(getattr(policy, "default_predictor", None), seed=0),
        cost=SIMPLE_COST,
        **kwargs,
    )
    for j in jobs:
        rid = j.request.rid
        ex.grammars[rid] = compiler.grammar(SPECS[rid % len(SPECS)])
        if rid in sampling:
            ex.samplers[rid] = Sampler(sampling[rid])
    res = ex.run(jobs, max_wall_s=60.0)
    assert not ex.in_system
    assert ex.kv_used == 0
    assert not ex.kv.slots
    return ex, res.outputs, evicted


@pytest.mark.parametrize("cache", [0, 128])
@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_serves_grammar_answers_equal_to_the_reference(
    model: Gemma3, compiler: GrammarCompiler, policy: str, cache: int
) -> None:
    """Under memory pressure (preemptions, suspensions, chunked prefills), with and
    without a prefix cache (answers' blocks offered as they fill), every answer is its
    request's constrained answer made alone: the grammar follows recomputes and
    restarts, forced runs jump ahead where memory allows. Each ends where its grammar
    is complete or at max_tokens."""
    jobs = _jobs(10)
    _, outputs, evicted = _run(
        model,
        compiler,
        jobs,
        make_policy(policy),
        {},
        kv_capacity=90,
        max_num_seqs=4,
        max_batch_tokens=32,
        prefix_cache_tokens=cache,
    )
    assert len(outputs) == len(jobs)
    for j in jobs:
        rid, prompt = j.request.rid, list(j.request.prompt_token_ids or ())
        out = outputs[rid]
        spec = SPECS[rid % len(SPECS)]
        if rid not in evicted:
            assert out == _reference(model, compiler, spec, prompt, j.request.max_tokens), rid
        if len(out) < j.request.max_tokens:
            assert fits(spec, answer_text(out)), (rid, answer_text(out))


def test_a_restart_replays_the_answer_through_its_grammar(
    model: Gemma3, compiler: GrammarCompiler
) -> None:
    """Restart preemption voids the answer and replays it: the grammar is reset and
    walked through the same tokens, so sampled answers equal an uninterrupted run's."""
    jobs = _jobs(10)
    rids = [j.request.rid for j in jobs]
    sampling = {rid: SamplingParams(temperature=1.0, seed=7 + rid) for rid in rids}
    _, roomy, _ = _run(model, compiler, jobs, make_policy("fcfs"), sampling)
    tight_ex, tight, _ = _run(
        model,
        compiler,
        jobs,
        make_policy("fcfs", preempt_mode="restart"),
        sampling,
        kv_capacity=70,
        max_batch_tokens=32,
    )
    assert tight_ex.counters.get("restarts", 0) > 0  # the point of the test
    assert tight_ex.counters.get("forced_tokens_jumped", 0) > 0  # with forced runs
    assert tight == roomy
    for j in jobs:
        rid = j.request.rid
        spec = SPECS[rid % len(SPECS)]
        prompt = list(j.request.prompt_token_ids or ())
        assert roomy[rid] == _reference(
            model, compiler, spec, prompt, j.request.max_tokens, sampling[rid]
        )


def test_without_a_grammar_the_tiny_model_answers_noise(model: Gemma3) -> None:
    """The control: unconstrained answers fit none of the grammars."""
    ex = EngineExecutor(make_policy("fcfs"), model, cost=SIMPLE_COST)
    res = ex.run(_jobs(8, max_tokens=12), max_wall_s=60.0)
    texts = [answer_text(out) for out in res.outputs.values()]
    assert not any(fits(spec, t) for spec in SPECS for t in texts)


def test_logits_of_allowed_rows_are_exact_at_their_tokens_and_minus_inf_elsewhere(
    model: Gemma3,
) -> None:
    import torch

    kv = model.new_kv_cache()
    a, b = kv.allocate(), kv.allocate()
    hidden, batch = model.hidden_states(
        [SeqChunk(a, CODEC.encode("one prompt"), 0), SeqChunk(b, CODEC.encode("two"), 0)], kv
    )
    last = hidden[batch.last_rows]
    full = model.logits(last)
    ids = torch.tensor([5, 70, 200])
    got = model.logits(last, allowed=[ids, None])
    assert torch.allclose(got[0, ids], full[0, ids], atol=1e-5)
    assert int(got[0].isfinite().sum()) == 3
    assert torch.allclose(got[1], full[1], atol=1e-5)  # a row without a list: the whole row
    assert torch.equal(model.logits(last, allowed=[None, None]), full)
    with pytest.raises(ValueError, match="allowed has 1 entries for 2 rows"):
        model.logits(last, allowed=[ids])


@pytest.mark.parametrize("sampled", [False, True])
def test_grammar_rows_take_their_few_allowed_logits_and_answer_as_with_whole_rows(
    model: Gemma3, compiler: GrammarCompiler, sampled: bool
) -> None:
    """A grammar row whose next tokens are few gets only their logits (the output
    layer's product over the vocabulary skipped); answers, greedy or sampled, are those
    of the masked whole rows (gathering turned off)."""
    jobs = _jobs(6)
    sampling = {rid: SamplingParams(temperature=0.9, seed=rid) for rid in (1, 4)} if sampled else {}

    def run(**kw: Any) -> tuple[dict[int, list[int]], list[bool]]:
        gathered: list[bool] = []
        step = model.step

        def spy(chunks: Any, kv: Any, **kw: Any) -> Any:
            gathered.append(kw.get("allowed") is not None)
            return step(chunks, kv, **kw)

        model.step = spy  # type: ignore[method-assign]
        try:
            _, outputs, _ = _run(model, compiler, jobs, make_policy("fcfs"), sampling, **kw)
        finally:
            del model.step
        return outputs, gathered

    with_gather, gathered = run()
    assert any(gathered)
    whole_rows, gathered_off = run(grammar_gather_max=0)
    assert not any(gathered_off)
    assert with_gather == whole_rows
