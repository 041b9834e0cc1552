"""build_jobs on synthetic and small hand-made ShareGPT sources; one slow test on the real one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from duetime.workloads import (
    AllAtOnce,
    Deadlines,
    LengthCaps,
    Poisson,
    ShareGPTSource,
    SyntheticSource,
    TraceArrivals,
    build_jobs,
    load_sharegpt_prompts,
)
from duetime.workloads.sharegpt import ShareGPTLengths, ShareGPTStats


def _fake_sharegpt(prompt: list[int], output: list[int]) -> ShareGPTSource:
    n = len(prompt)
    lengths = ShareGPTLengths(
        prompt_len=np.array(prompt),
        output_len=np.array(output),
        conv_id=np.array([f"c{i}" for i in range(n)]),
        turn=np.zeros(n, dtype=np.int32),
        byte_start=np.zeros(n, dtype=np.int64),
        byte_end=np.zeros(n, dtype=np.int64),
        stats=ShareGPTStats(),
        source=Path("/nonexistent"),
        tokenizer="fake",
    )
    return ShareGPTSource(lengths)


def test_rids_follow_arrival_order_and_seed_fixes_everything() -> None:
    kwargs = {"source": SyntheticSource((5, 50), (1, 30)), "arrivals": Poisson(rate=10.0)}
    jobs = build_jobs(200, seed=4, **kwargs)
    assert [j.request.rid for j in jobs] == list(range(200))
    arrivals = [j.request.arrival for j in jobs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] > 0
    assert build_jobs(200, seed=4, **kwargs) == jobs
    assert build_jobs(200, seed=5, **kwargs) != jobs
    assert {j.request.prompt_len for j in jobs} <= set(range(5, 51))
    assert len({j.request.prompt_len for j in jobs}) > 20  # really uniform, not fixed


def test_unsorted_trace_arrivals_are_sorted() -> None:
    jobs = build_jobs(3, source=SyntheticSource(4, 2), arrivals=TraceArrivals([9.0, 1.0, 5.0]))
    assert [j.request.arrival for j in jobs] == [1.0, 5.0, 9.0]


def test_synthetic_lengths_are_clipped_to_caps_and_max_tokens() -> None:
    caps = LengthCaps(max_prompt_len=40, max_total_len=60)
    jobs = build_jobs(
        300, source=SyntheticSource((10, 100), (1, 500)), caps=caps, max_tokens=30, seed=1
    )
    prompts = np.array([j.request.prompt_len for j in jobs])
    outputs = np.array([j.output_len for j in jobs])
    assert prompts.max() == 40
    assert outputs.max() <= 30
    assert (prompts + outputs).max() <= 60
    assert all(j.request.max_tokens == 30 for j in jobs)


def test_synthetic_range_outside_caps_is_an_error() -> None:
    says = r"^prompt lengths 100\.\.100 do not fit prompts of 1\.\.50 tokens$"
    with pytest.raises(ValueError, match=says):
        build_jobs(1, source=SyntheticSource(100, 4), caps=LengthCaps(max_prompt_len=50))


def test_sharegpt_pairs_outside_caps_are_dropped_not_clipped() -> None:
    source = _fake_sharegpt([10, 2000, 10, 600, 3], [10, 10, 3000, 1600, 10])
    jobs = build_jobs(50, source=source, caps=LengthCaps.vllm(), arrivals=AllAtOnce())
    assert {(j.request.prompt_len, j.output_len) for j in jobs} == {(10, 10)}


def test_sharegpt_samples_without_replacement_when_the_pool_allows() -> None:
    source = _fake_sharegpt(list(range(1, 101)), [5] * 100)
    prompts = [j.request.prompt_len for j in build_jobs(100, source=source, seed=2)]
    assert sorted(prompts) == list(range(1, 101))
    more = build_jobs(300, source=source, seed=2)  # more than the pool: with replacement
    assert len(more) == 300


def test_no_pair_fits_is_an_error_in_words() -> None:
    """The messages printed LengthCaps(max_prompt_len=..., ...): names no option has."""
    caps = LengthCaps(max_prompt_len=4)
    with pytest.raises(ValueError, match=r"no ShareGPT pair fits prompts of 1\.\.4 tokens, "):
        build_jobs(1, source=_fake_sharegpt([5], [5]), caps=caps)
    caps = LengthCaps(max_total_len=100)
    with pytest.raises(ValueError, match=r"of 1 under prompt \+ output <= 100 tokens$"):
        build_jobs(1, source=SyntheticSource(prompt_len=100, output_len=8), caps=caps)
    with pytest.raises(
        ValueError, match=r"^output lengths 20\.\.30 do not fit outputs of 1\.\.10 "
    ):
        build_jobs(1, source=SyntheticSource(prompt_len=8, output_len=(20, 30)), max_tokens=10)


@pytest.mark.parametrize(("basis", "tokens"), [("output_len", 8), ("max_tokens", 16)])
def test_deadline_rule(basis: str, tokens: int) -> None:
    rule = Deadlines(slo_scale=2.0, ttft_s=0.5, tpot_s=0.1, basis=basis)  # type: ignore[arg-type]
    jobs = build_jobs(
        5, source=SyntheticSource(4, 8), deadlines=rule, max_tokens=16, arrivals=Poisson(1.0)
    )
    for job in jobs:
        assert job.request.time_budget == pytest.approx(2.0 * (0.5 + 0.1 * tokens))
    assert build_jobs(5, source=SyntheticSource(4, 8))[0].request.deadline is None


def test_synthetic_prompt_ids_start_with_bos_and_match_lengths() -> None:
    jobs = build_jobs(20, source=SyntheticSource((3, 40), 5), with_prompt_ids=True, seed=9)
    for job in jobs:
        ids = job.request.prompt_token_ids
        assert ids is not None
        assert ids[0] == 2
        assert len(ids) == job.request.prompt_len
        assert all(10_000 <= i < 200_000 for i in ids[1:])


def test_zero_jobs_and_negative_n() -> None:
    assert build_jobs(0, source=SyntheticSource()) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        build_jobs(-1, source=SyntheticSource())


@pytest.mark.slow
@pytest.mark.real_model
def test_real_sharegpt_jobs_carry_their_prompts_token_ids() -> None:
    jobs = build_jobs(12, seed=11, caps=LengthCaps.vllm(), with_prompt_ids=True)
    prompts = load_sharegpt_prompts(12, seed=11, caps=LengthCaps.vllm())
    for job, prompt in zip(jobs, prompts, strict=True):
        ids = job.request.prompt_token_ids
        assert ids is not None
        assert ids[0] == 2
        # the cached count and a fresh tokenization of the same text agree
        assert job.request.prompt_len == len(ids) == prompt.prompt_len
        assert job.output_len == prompt.output_len
        assert 4 <= job.request.prompt_len <= 1024


def test_sharegpt_jobs_can_carry_prompt_text_for_text_predictors() -> None:
    from duetime.predict.oracle import make_job_predictor
    from duetime.workloads import build_jobs

    jobs = build_jobs(5, seed=3, with_prompt_text=True)
    assert all(j.request.prompt_text for j in jobs)
    plain = build_jobs(5, seed=3)
    assert [j.request.prompt_len for j in jobs] == [j.request.prompt_len for j in plain]
    pred = make_job_predictor("learned")
    assert pred is not None
    p = pred.predict_job(jobs[0])
    assert p.lo <= p.point <= p.hi


def test_prompt_text_on_synthetic_workloads_is_refused() -> None:
    import pytest

    from duetime.workloads import SyntheticSource, build_jobs

    with pytest.raises(ValueError, match="ShareGPT"):
        build_jobs(3, source=SyntheticSource(), with_prompt_text=True)
