"""The server's batch limits from its step costs (server/autosize.py), and where they show."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from duetime.core.cost import LinearStepCost
from duetime.server.app import create_app
from duetime.server.autosize import MAX_SEQS_CAP, limits_from_cost, measure_step_cost
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.threaded import serve_in_thread
from tests.factories import cli_refused


def test_the_largest_batch_that_meets_the_target() -> None:
    # decode(D) = 10 ms + D * (3 ms + 512 tokens * 10 us) = 10 + 8.12 D ms: D <= 11
    cost = LinearStepCost.batch(c=0.010, a=0.0007, b=0.003, d=0.00001)
    lim = limits_from_cost(cost, tpot_target_s=0.1, context=512, source="profile")
    assert lim.max_num_seqs == 11
    assert lim.decode_step_ms == pytest.approx(10 + 8.12 * 11)
    # a chunk's step carries the 11 decoders within 200 ms: 99.3 + 0.7 P <= 200, P <= 143
    assert lim.prefill_chunk_tokens == 128
    assert lim.max_batch_tokens == 11 + 128  # the budget counts a token for each decoder
    assert lim.chunk_step_ms == pytest.approx(10 + 8.12 * 11 + 0.7 * 128)
    # a slower machine or longer contexts: fewer sequences
    slower = limits_from_cost(cost, tpot_target_s=0.1, context=2048, source="profile")
    assert slower.max_num_seqs < lim.max_num_seqs


def test_limits_stay_within_bounds() -> None:
    tiny = LinearStepCost.batch(c=0.001, a=0.0, b=1e-6, d=0.0)
    lim = limits_from_cost(tiny, tpot_target_s=1.0, context=64, source="profile")
    assert lim.max_num_seqs == MAX_SEQS_CAP
    assert lim.prefill_chunk_tokens == 2048
    assert lim.max_batch_tokens == MAX_SEQS_CAP + 2048
    huge = LinearStepCost.batch(c=0.5, a=0.01, b=0.1, d=0.0)
    lim = limits_from_cost(huge, tpot_target_s=0.1, context=64, source="profile")
    assert lim.max_num_seqs == 1  # even one sequence misses: one at a time
    assert lim.max_batch_tokens == 1 + 64
    with pytest.raises(ValueError, match="TPOT"):
        limits_from_cost(tiny, tpot_target_s=0, context=64, source="profile")


def test_the_model_times_its_own_steps() -> None:
    model, _, _ = load_served_model(ServeOptions(model="tiny", predictor=None))
    cost = measure_step_cost(model, batches=(1, 4), prompts=(16, 32), reps=2)
    assert cost.c0 + cost.b > 0
    lim = limits_from_cost(cost, tpot_target_s=1.0, context=64, source="measured at start")
    assert lim.max_num_seqs >= 1


def test_health_and_models_show_the_limits() -> None:
    options = ServeOptions(model="tiny", predictor=None, max_num_seqs=7, max_batch_tokens=96)
    options.limits = {"max_num_seqs": 7, "max_batch_tokens": 96, "source": "profile"}
    state = build_state(options, *load_served_model(options))
    with serve_in_thread(create_app(state)) as url:
        health = httpx.get(url + "/health").json()
        models = httpx.get(url + "/v1/models").json()
    assert health["limits"]["max_num_seqs"] == 7
    assert models["data"][0]["duetime_limits"]["max_batch_tokens"] == 96
    assert state.engine.executor.max_num_seqs == 7


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-num-seqs", "0"), ("--max-num-seqs", "lots"), ("--max-batch-tokens", "8")],
)
def test_serve_refuses_a_bad_limit(option: str, value: str) -> None:
    cli_refused("serve", "--model", "tiny", option, value, names=option)


def test_the_steps_timed_at_start_let_admission_judge_the_first_request() -> None:
    """Before any served step, a deadline no forecast can meet is refused at arrival when
    the start-up timing seeded the step-time fit; without a model it cannot be judged."""
    body = {
        "model": "duetime-tiny",
        "prompt": "Hello there",
        "max_tokens": 64,
        "ignore_eos": True,
        "deadline_ms": 200,
    }
    slow = LinearStepCost.batch(c=0.05, a=0.001, b=0.01, d=0.0)  # 60 ms a decode step
    codes = []
    for measured in (slow, None):
        options = ServeOptions(model="tiny", predictor=None, measured_cost=measured)
        state = build_state(options, *load_served_model(options))
        with serve_in_thread(create_app(state)) as url:
            codes.append(httpx.post(url + "/v1/completions", json=body, timeout=60).status_code)
    assert codes == [429, 200]


def test_a_given_limit_is_kept_and_its_figures_shown() -> None:
    cost = LinearStepCost.batch(c=0.010, a=0.0007, b=0.003, d=0.00001)
    lim = limits_from_cost(cost, tpot_target_s=0.1, context=512, source="profile", seqs=20)
    assert lim.max_num_seqs == 20
    assert lim.decode_step_ms == pytest.approx(10 + 8.12 * 20)  # of the 20 kept
    assert lim.prefill_chunk_tokens == 64  # the chunk still sized, beside 20 decoders
    assert lim.max_batch_tokens == 20 + 64


def test_a_given_budget_is_kept_and_bounds_the_batch() -> None:
    cost = LinearStepCost.batch(c=0.010, a=0.0007, b=0.003, d=0.00001)
    lim = limits_from_cost(cost, tpot_target_s=0.1, context=512, source="profile", budget=300)
    assert (lim.max_num_seqs, lim.max_batch_tokens, lim.prefill_chunk_tokens) == (11, 300, 289)
    assert lim.chunk_step_ms == pytest.approx(10 + 8.12 * 11 + 0.7 * 289)
    # a budget below the batch the target allows: no more decoders than tokens a step
    tight = limits_from_cost(cost, tpot_target_s=0.1, context=512, source="profile", budget=8)
    assert (tight.max_num_seqs, tight.prefill_chunk_tokens) == (8, 0)


def test_a_start_timed_on_a_busy_machine_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    """Beside two CPU-bound processes the start-up timing sized 80 sequences (212-221
    quiet) and said nothing: the spread of its repeats (37.8 % against ~5 %) tells."""
    from duetime.cli.serve import _announce
    from duetime.server.autosize import BUSY_SPREAD_PCT

    model, _, _ = load_served_model(ServeOptions(model="tiny", predictor=None))
    cost = measure_step_cost(model, batches=(1, 4), prompts=(16, 32), reps=2)
    spread = cost.meta["timing_spread_pct"]
    assert spread is not None
    assert spread >= 0
    options = ServeOptions(model="tiny", predictor=None)
    for pct, warned in ((5.0, False), (BUSY_SPREAD_PCT + 1, True)):
        lim = limits_from_cost(cost, tpot_target_s=1.0, context=64, source="measured at start")
        lim = dataclasses.replace(lim, timing_spread_pct=pct)
        _announce("tiny", "edf", "127.0.0.1", 8000, options, lim)
        said = capsys.readouterr().err
        assert ("warning:" in said) == warned, said
        assert ("restart when it is quiet" in said) == warned
