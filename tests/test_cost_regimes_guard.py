"""The guard: a kernel switch the engine has must be a band of the step-cost model.

Two checks. The engine's code: steps of 1-24 decoders (alone and beside a prompt
chunk) are traced on the tiny q8 model, and two row counts in one band of the
model must run the same functions. The timings: the model fitted to recorded
steps of the real Gemma q8 (tests/data/q8-steps.json, 526 steps of `duetime
profile`'s grid and serving run) must sit on the median step of every regime;
with the bands taken out it does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.cost_bands import CostRegimes
from duetime.predict.ete import StepSample, fit_batch_cost

RECORDED = Path(__file__).parent / "data" / "q8-steps.json"
#: Largest |median relative error| allowed in a regime cell of >= 20 recorded steps.
MAX_CELL_BIAS_PCT = 3.0


@pytest.fixture(scope="module")
def tiny_q8() -> Any:
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    model = engine_from_hf(tiny_hf_model(), dtype="q8")
    if not model.int4_ranking or model._loop is None:
        pytest.skip("the q8 kernels do not build on this machine")
    return model


@pytest.fixture(scope="module")
def recorded() -> list[StepSample]:
    return [StepSample(**row) for row in json.loads(RECORDED.read_text())]


def test_every_switch_the_engine_makes_is_a_band(tiny_q8: Any) -> None:
    from duetime.engine.cost_regimes import regimes_of, unpriced_switches

    regimes = regimes_of(tiny_q8)
    assert regimes.rows
    assert regimes.head_rows
    assert unpriced_switches(tiny_q8, regimes) == []


@pytest.mark.parametrize(
    ("regimes", "where"),
    [
        (CostRegimes(rows=(), head_rows=(2, 4)), "decoders alone run different code"),
        (CostRegimes(rows=(8,), head_rows=(2,)), "3 and 5 decoders alone"),
        (CostRegimes(), "run different code"),
    ],
)
def test_a_model_missing_a_band_is_caught(tiny_q8: Any, regimes: CostRegimes, where: str) -> None:
    from duetime.engine.cost_regimes import unpriced_switches

    problems = unpriced_switches(tiny_q8, regimes)
    assert problems
    assert any(where in p for p in problems)
    assert "regimes_of" in problems[0]


def _worst_cell_bias(cost: LinearStepCost, samples: list[StepSample], cells: CostRegimes) -> float:
    by_cell: dict[tuple[str, str, bool], list[float]] = {}
    for s in samples:
        rows, head = s.prefill_tokens + s.decode_seqs, s.decode_seqs + (s.prefill_tokens > 0)
        key = (cells.band_label("rows", rows), cells.band_label("head_rows", head),
               s.prefill_tokens > 0)  # fmt: skip
        pred = cost.step_time(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens)
        by_cell.setdefault(key, []).append((pred - s.seconds) / s.seconds)
    return max(abs(100 * float(np.median(v))) for v in by_cell.values() if len(v) >= 20)


def test_the_fitted_model_sits_on_every_regime_of_the_real_engine(
    tiny_q8: Any, recorded: list[StepSample]
) -> None:
    """The real Gemma's regimes are the tiny model's: the same classes and row limits."""
    from duetime.engine.cost_regimes import regimes_of

    regimes = regimes_of(tiny_q8)
    cost = fit_batch_cost(recorded, regimes=regimes)
    assert _worst_cell_bias(cost, recorded, regimes) <= MAX_CELL_BIAS_PCT


@pytest.mark.parametrize(
    "fewer", [None, CostRegimes(rows=(), head_rows=(2, 4)), CostRegimes(rows=(8,), head_rows=(4,))]
)
def test_without_its_bands_the_model_misses_a_regime(
    tiny_q8: Any, recorded: list[StepSample], fewer: CostRegimes | None
) -> None:
    from duetime.engine.cost_regimes import regimes_of

    cost = fit_batch_cost(recorded, regimes=fewer)
    assert _worst_cell_bias(cost, recorded, regimes_of(tiny_q8)) > MAX_CELL_BIAS_PCT


def test_the_servers_online_fit_is_the_same_banded_model(recorded: list[StepSample]) -> None:
    from duetime.server.step_timer import StepTimer

    regimes = CostRegimes(rows=(8,), head_rows=(2, 4))
    n = len(recorded)
    timer = StepTimer(regimes=regimes, window=n, min_steps=n, refit_every=n)
    for s in recorded:
        timer.observe(s.seconds, s.prefill_tokens, s.decode_seqs, s.kv_tokens, s.prefill_attn)
    online = timer.as_cost()
    assert online is not None
    assert online.bands
    offline = fit_batch_cost(recorded, regimes=regimes, sum_calibrated=True)
    for s in recorded[:50]:
        args = (s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens)
        assert online.step_time(*args) == pytest.approx(offline.step_time(*args), rel=1e-6)
    assert timer.coefficients()["bands"]  # type: ignore[index]
