"""Per-request sampling: the draws follow the cut softmax, seeds reproduce them, greedy is
untouched, and a restarted request continues its draws where an uninterrupted run would."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
import torch

from duetime.core.request import Job, Request
from duetime.core.sampling import SamplingParams
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.sampling import NUCLEUS_PROBE, Sampler, _nucleus
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, math.nan),)}, "logit_bias"),
    ],
)
def test_bad_params_are_refused_by_name(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_only_plain_greedy_params_go_without_a_sampler() -> None:
    assert SamplingParams().plain
    assert SamplingParams(temperature=0.7, top_k=1).plain
    assert not SamplingParams(temperature=0.7).plain
    penalised = SamplingParams(frequency_penalty=0.5)
    assert penalised.greedy
    assert not penalised.plain  # the arg-max of other logits: a sampler applies them
    Sampler(penalised)
    with pytest.raises(ValueError, match="no sampler"):
        Sampler(SamplingParams(top_p=0.5))
    assert not SamplingParams(logit_bias=((3, -1.0),)).plain  # a sampler adds the bias


def test_logit_bias_is_added_before_the_penalties_and_the_draw() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert Sampler(SamplingParams(logit_bias=((3, 3.5),))).pick(logits) == 3
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),))).pick(logits) == 1
    # biased first: token 3 at 2.5 then loses 1.0 per occurrence in the answer
    both = SamplingParams(logit_bias=((3, 3.5),), frequency_penalty=1.0)
    assert Sampler(both).pick(logits, [3], prompt_len=0) == 0
    banned = SamplingParams(temperature=1.0, seed=0, logit_bias=((0, -100.0), (1, -100.0)))
    draws = Counter(Sampler(banned).pick(logits) for _ in range(200))
    assert set(draws) <= {2, 3}  # e^-100: never drawn in 200
    assert logits.tolist() == [2.0, 1.0, 0.5, -1.0]  # the caller's row is left alone


@pytest.mark.parametrize(
    ("penalties", "tokens", "want"),
    [
        # answer so far [1, 1] after prompt [0]: token 1's logit 3.0 against token 2's 2.5
        ({"frequency_penalty": 0.2}, [0, 1, 1], 1),  # 3.0 - 2 x 0.2 = 2.6
        ({"frequency_penalty": 0.3}, [0, 1, 1], 2),  # 3.0 - 2 x 0.3 = 2.4
        ({"presence_penalty": 0.4}, [0, 1, 1], 1),  # once, whatever the count: 2.6
        ({"presence_penalty": 0.6}, [0, 1, 1], 2),  # 2.4
        ({"presence_penalty": 2.0}, [1], 1),  # a prompt token is not the answer's
        ({"repetition_penalty": 1.25}, [1], 2),  # the prompt's too: 3.0 / 1.25 = 2.4
        ({"repetition_penalty": 1.1}, [1], 1),  # 2.73
        ({"repetition_penalty": 0.5}, [2], 2),  # below 1 favours them: 5.0
    ],
)
def test_penalties_change_the_logits_as_vllm_does(
    penalties: dict[str, float], tokens: list[int], want: int
) -> None:
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    before = logits.clone()
    assert Sampler(SamplingParams(**penalties)).pick(logits, tokens, prompt_len=1) == want
    assert torch.equal(logits, before)  # the batch's logits are left as they were


def test_repetition_penalty_multiplies_a_negative_logit() -> None:
    logits = torch.tensor([-1.0, -0.5, -2.0])
    assert Sampler(SamplingParams(repetition_penalty=1.5)).pick(logits, [1], 1) == 1  # -0.75
    assert Sampler(SamplingParams(repetition_penalty=3.0)).pick(logits, [1], 1) == 0  # -1.5


def _frequencies(params: SamplingParams, logits: torch.Tensor, n: int) -> list[float]:
    s = Sampler(params)
    counts = Counter(s.pick(logits) for _ in range(n))
    return [counts[i] / n for i in range(logits.numel())]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_follow_the_tempered_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    want = torch.softmax(logits / temperature, 0).tolist()
    got = _frequencies(SamplingParams(temperature=temperature, seed=1), logits, 20_000)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) < 0.015, (got, want)


def test_top_k_and_top_p_keep_only_the_head_in_its_proportions() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top_p 0.5: 0.4 alone is short of it, 0.4 + 0.3 reaches it -> tokens 0 and 1, 4 : 3
    got = _frequencies(SamplingParams(temperature=1.0, top_p=0.5, seed=2), logits, 14_000)
    assert got[2] == got[3] == 0
    assert abs(got[0] - 4 / 7) < 0.015
    got = _frequencies(SamplingParams(temperature=1.0, top_k=2, seed=3), logits, 2_000)
    assert got[2] == got[3] == 0
    assert min(got[0], got[1]) > 0
    got = _frequencies(SamplingParams(temperature=1.0, top_p=0.75, seed=4), logits, 2_000)
    assert got[3] == 0
    assert got[2] > 0
    # top_k cuts first, then top_p renormalised over what is left: {0.4, 0.3, 0.2} -> 0.44 + 0.33
    got = _frequencies(SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=5), logits, 2_000)
    assert got[2] == got[3] == 0
    # min_p 0.6 keeps the tokens at least 0.6 x 0.4 = 0.24 likely: 0 and 1, still 4 : 3
    got = _frequencies(SamplingParams(temperature=1.0, min_p=0.6, seed=6), logits, 14_000)
    assert got[2] == got[3] == 0
    assert abs(got[0] - 4 / 7) < 0.015
    # ... after the temperature: at 2.0 the probabilities flatten and 0.2 passes 0.6 x max
    got = _frequencies(SamplingParams(temperature=2.0, min_p=0.6, seed=7), logits, 2_000)
    assert got[3] == 0
    assert got[2] > 0


@pytest.mark.parametrize(
    ("n", "spread", "dtype"),
    [
        (3_000, 0.5, torch.float64),  # flat: past the probe, the binned path
        (3_000, 3.0, torch.float64),
        (3_000, 8.0, torch.float64),  # peaked: inside the probe
        (262_144, 3.0, torch.float32),  # Gemma's vocabulary, as the engine hands it over
    ],
)
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_nucleus_is_the_smallest_head_reaching_top_p(
    n: int, spread: float, dtype: torch.dtype, top_p: float
) -> None:
    gen = torch.Generator().manual_seed(int(n + spread * 100 + top_p * 1000))
    logits = (torch.randn(n, generator=gen, dtype=torch.float64) * spread).to(dtype)
    probs = torch.softmax(logits, 0)
    vals, pos = _nucleus(probs, logits, top_p)
    assert torch.equal(vals, probs[pos])
    assert len(set(pos.tolist())) == len(pos)
    mass = float(vals.double().sum())
    assert mass >= top_p * (1 - 1e-6)  # it reaches top_p ...
    assert mass - float(vals.min()) < top_p  # ... and is the smallest set that does ...
    out = torch.ones(n, dtype=torch.bool)
    out[pos] = False
    assert float(vals.min()) >= float(probs[out].max())  # ... of the likeliest tokens
    if spread == 0.5 and top_p >= 0.5:
        assert len(pos) > NUCLEUS_PROBE  # the case the binned path is there for


def test_a_seed_reproduces_the_draws_and_another_seed_does_not() -> None:
    logits = torch.zeros(1_000)
    a, b = Sampler(SamplingParams(temperature=1.0, seed=7)), Sampler(SamplingParams(1.0, seed=7))
    c = Sampler(SamplingParams(temperature=1.0, seed=8))
    seq_a = [a.pick(logits) for _ in range(20)]
    assert seq_a == [b.pick(logits) for _ in range(20)]
    assert seq_a != [c.pick(logits) for _ in range(20)]
    unseeded = [Sampler(SamplingParams(temperature=1.0)).pick(logits) for _ in range(20)]
    assert len(set(unseeded)) > 1  # no seed: a fresh one per request


# --- in the executor ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _jobs(n: int, seed: int) -> list[Job]:
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        ids = tuple(r.randrange(256) for _ in range(r.randint(1, 40)))
        req = Request(rid=i, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=64)
        jobs.append(Job(req, r.randint(4, 24)))
    return jobs


def _run(model: Any, jobs: list[Job], sampled: dict[int, SamplingParams], **kw: Any) -> Any:
    ex = EngineExecutor(kw.pop("policy", make_policy("fcfs")), model, **kw)
    for rid, params in sampled.items():
        ex.samplers[rid] = Sampler(params)
    res = ex.run(jobs)
    assert ex.kv.total_tokens == 0
    return res


def test_sampled_requests_are_seeded_per_request_and_leave_greedy_ones_alone(model: Any) -> None:
    jobs = _jobs(8, seed=11)
    sampled = {
        0: SamplingParams(temperature=1.0, seed=5),
        3: SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=6),
    }
    batched = _run(model, jobs, sampled, kv_capacity=10_000)
    prompts = [list(j.request.prompt_token_ids or ()) for j in jobs]
    greedy = greedy_generate(model, prompts, max(j.output_len for j in jobs))
    for k, j in enumerate(jobs):
        rid = j.request.rid
        if rid not in sampled:
            assert batched.outputs[rid] == greedy[k][: j.output_len]
    assert batched.outputs[0] != greedy[0][: jobs[0].output_len]
    # the same request alone in the engine draws the same answer: the seed is its own
    for rid in sampled:
        alone = _run(model, [jobs[rid]], {rid: sampled[rid]}, kv_capacity=10_000)
        assert alone.outputs[rid] == batched.outputs[rid]


@pytest.mark.parametrize("penalised", [False, True])
def test_a_restarted_sampled_request_continues_its_draws_where_it_left_them(
    model: Any, penalised: bool
) -> None:
    """Replayed tokens draw nothing, so the answer after a restart is the one an
    uninterrupted run makes; drawing during the replay would shift every later token.
    Penalties read the tokens the executor holds, so they survive the restart too."""
    jobs = _jobs(10, seed=3)
    extra = {"frequency_penalty": 0.5, "repetition_penalty": 1.3} if penalised else {}
    sampled = {
        j.request.rid: SamplingParams(temperature=1.0, seed=100 + j.request.rid, **extra)
        for j in jobs
    }
    roomy = _run(model, jobs, sampled, kv_capacity=10_000)
    tight = _run(
        model,
        jobs,
        sampled,
        policy=make_policy("fcfs", preempt_mode="restart"),
        kv_capacity=120,
        max_batch_tokens=32,
    )
    assert tight.counters.get("restarts", 0) > 0  # the point of the test
    assert tight.outputs == roomy.outputs


def test_penalties_act_in_the_executor_greedy_or_not(model: Any) -> None:
    """The random model repeats itself under plain greedy decoding; a frequency
    penalty makes the same greedy requests repeat less."""
    jobs = _jobs(8, seed=21)
    plain = _run(model, jobs, {}, kv_capacity=10_000)
    penalty = SamplingParams(frequency_penalty=2.0)
    penalised = _run(model, jobs, {j.request.rid: penalty for j in jobs}, kv_capacity=10_000)

    def repeats(outputs: dict[int, list[int]]) -> int:
        return sum(len(out) - len(set(out)) for out in outputs.values())

    assert repeats(plain.outputs) > 0  # else the test shows nothing
    assert repeats(penalised.outputs) < repeats(plain.outputs)
    again = _run(model, jobs, {j.request.rid: penalty for j in jobs}, kv_capacity=10_000)
    assert again.outputs == penalised.outputs  # greedy with penalties: no randomness
