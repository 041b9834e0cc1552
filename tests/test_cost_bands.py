"""The banded step-cost model: pricing, the simulator's closed form, the fit, profiles."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from duetime.core.cost import CostModelError, LinearStepCost
from duetime.core.cost_bands import BandCost, CostBandError, CostRegimes
from duetime.policies.timebill_math import ete_from_cost
from duetime.predict.ete import StepSample, cost_mape_pct, fit_batch_cost, step_kind

REGIMES = CostRegimes(rows=(8,), head_rows=(2, 4))
BANDED = LinearStepCost(
    c0=0.005, c_prefill=0.008, a1=2e-4, a2=3e-7, b=1e-3, d=3e-6,
    bands=(
        BandCost("rows", 0, 8, 0.0, 2.2e-3),
        BandCost("rows", 8, math.inf, 0.026, 0.0),
        BandCost("head_rows", 0, 2, 0.0055, 0.0),
        BandCost("head_rows", 2, 4, 0.0, 2.4e-3),
        BandCost("head_rows", 4, math.inf, 0.012, 5e-5),
    ),
)  # fmt: skip


def _shapes(rng: np.random.Generator, n: int) -> list[tuple[int, int, int]]:
    out = []
    for _ in range(n):
        d = int(rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64]))
        p = 0 if d and rng.random() < 0.6 else int(rng.integers(1, 600))
        out.append((p, d, d * int(rng.integers(16, 1024))))
    return out


def _samples(cost: LinearStepCost, seed: int = 0, n: int = 300) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    return [
        StepSample(p, float(p * p), d, kv, cost.step_time(p, p * p, d, kv), step_kind(p, d))
        for p, d, kv in _shapes(rng, n)
    ]


def test_regimes_name_their_bands_and_refuse_disorder() -> None:
    assert REGIMES.spans("rows") == [(0.0, 8.0), (8.0, math.inf)]
    assert [REGIMES.band_label("head_rows", x) for x in (1, 2, 3, 5)] == [
        "1-2", "1-2", "3-4", "5+"
    ]  # fmt: skip
    with pytest.raises(CostBandError, match="rows edges"):
        CostRegimes(rows=(8, 4))
    with pytest.raises(CostBandError, match="unknown regime axis"):
        CostRegimes.from_dict({"cols": [3]})


def test_a_step_pays_the_band_its_rows_fall_in() -> None:
    base = LinearStepCost(c0=0.01, b=0.001)
    banded = LinearStepCost(
        c0=0.01, b=0.001,
        bands=(BandCost("rows", 0, 8, 0.0, 0.002), BandCost("rows", 8, math.inf, 0.05, 0.0)),
    )  # fmt: skip
    assert banded.step_time(0, 0, 8, 0) == pytest.approx(base.step_time(0, 0, 8, 0) + 0.016)
    assert banded.step_time(0, 0, 9, 0) == pytest.approx(base.step_time(0, 0, 9, 0) + 0.05)
    # a prompt chunk's last token is a head row
    head_only = LinearStepCost(c0=0.01, bands=(BandCost("head_rows", 0, 1, 0.004, 0.0),))
    assert head_only.step_time(50, 0, 0, 0) == pytest.approx(0.014)  # 1 head row: the prompt
    assert head_only.step_time(50, 0, 1, 0) == pytest.approx(0.01)  # 2 head rows: no band


@pytest.mark.parametrize("decoders", [1, 2, 3, 4, 5, 8, 9, 40])
def test_decode_spans_stay_closed_form_in_every_band(decoders: int) -> None:
    kv, k = 300 * decoders, 57
    stepped = sum(BANDED.decode_step(decoders, kv + i * decoders) for i in range(k))
    assert BANDED.decode_span(k, decoders, kv) == pytest.approx(stepped, rel=1e-12)
    horizon = stepped * 1.0000001
    assert BANDED.decode_steps_within(horizon, decoders, kv) == k
    assert BANDED.decode_step(decoders, kv) == pytest.approx(BANDED.step_time(0, 0, decoders, kv))


def test_bands_round_trip_through_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(BANDED.to_profile()))
    back = LinearStepCost.from_profile(path)
    assert back.bands == BANDED.bands
    assert back.step_time(64, 4096, 5, 900) == pytest.approx(BANDED.step_time(64, 4096, 5, 900))
    bad = BANDED.to_profile()
    bad["bands"][0]["slope"] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(CostModelError, match="slope must be finite and >= 0"):
        LinearStepCost.from_profile(path)
    bad["bands"] = {"axis": "rows"}
    path.write_text(json.dumps(bad))
    with pytest.raises(CostModelError, match="'bands' must be a list"):
        LinearStepCost.from_profile(path)


def test_the_fit_recovers_a_banded_engine_that_a_linear_fit_cannot() -> None:
    train, test = _samples(BANDED, seed=1), _samples(BANDED, seed=2)
    banded = fit_batch_cost(train, regimes=REGIMES)
    linear = fit_batch_cost(train)
    assert cost_mape_pct(banded, test) < 0.5
    assert cost_mape_pct(linear, test) > 5.0
    assert banded.meta["regimes"] == {"rows": [8], "head_rows": [2, 4]}


def test_the_fit_ignores_steps_a_busy_machine_stretched() -> None:
    """One step in ten taking 2-3x its time (another job on the core) moves the fit by
    well under a percent: it minimises absolute relative error, not its square."""
    clean = _samples(BANDED, seed=3, n=400)
    rng = np.random.default_rng(4)
    spiked = [
        StepSample(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens,
                   s.seconds * (float(rng.uniform(2, 3)) if i % 10 == 0 else 1.0), s.kind)
        for i, s in enumerate(clean)
    ]  # fmt: skip
    cost = fit_batch_cost(spiked, regimes=REGIMES)
    assert cost_mape_pct(cost, _samples(BANDED, seed=5)) < 1.0


def test_scaling_a_banded_model_scales_its_bands_with_compute() -> None:
    slow = BANDED.scaled(compute=2.0, memory=1.0)
    assert slow.bands[1].intercept == pytest.approx(2 * BANDED.bands[1].intercept)
    assert slow.c0 == BANDED.c0
    assert slow.a1 == 2 * BANDED.a1


def test_timebill_reads_its_prompt_curve_off_the_long_prompts_band() -> None:
    ete = ete_from_cost(BANDED)
    for n in (64, 512, 2048):
        assert float(ete.prefill(n)) == pytest.approx(BANDED.prefill_time(n), rel=1e-9)
    assert ete.decode_step(0) == pytest.approx(BANDED.decode_step(1, 0))


def test_a_banded_decode_step_must_still_cost_something() -> None:
    with pytest.raises(CostModelError, match="at least"):
        LinearStepCost(bands=(BandCost("rows", 8, math.inf, 0.05, 0.0),))


def test_the_floor_pools_repeats_from_both_ends_of_a_run() -> None:
    """A machine that slowed by 10 % between the two bursts of repeats: each burst alone
    is steady, the pooled floor shows the move and the drift names it."""
    from duetime.engine.profile import NoiseShape, noise_drift_pct, noise_floor_pct, pool_noise

    first = [NoiseShape.of("decode", [0.100] * 8), NoiseShape.of("prefill", [0.200] * 8)]
    last = [NoiseShape.of("decode", [0.110] * 8), NoiseShape.of("prefill", [0.220] * 8)]
    assert noise_floor_pct(first) == 0.0
    assert noise_drift_pct(first, last) == pytest.approx(10.0)
    pooled = pool_noise(first, last)
    assert [len(s.seconds) for s in pooled] == [16, 16]
    assert noise_floor_pct(pooled) == pytest.approx(100 * 0.5 * 0.010 / 0.110, rel=1e-9)


#: BANDED plus a roofline bend: each layer row past 128 costs 0.4 ms more.
BENT = LinearStepCost(
    c0=BANDED.c0, c_prefill=BANDED.c_prefill, a1=BANDED.a1, a2=BANDED.a2, b=BANDED.b,
    d=BANDED.d, bands=(*BANDED.bands, BandCost("rows", 128, math.inf, -128 * 4e-4, 4e-4)),
)  # fmt: skip


def test_the_fit_bends_at_a_knot_where_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import duetime.predict.ete as ete

    train, test = _samples(BENT, seed=1), _samples(BENT, seed=2)
    assert 128 in ete.ROW_KNOTS
    bent = fit_batch_cost(train, regimes=REGIMES)
    assert cost_mape_pct(bent, test) < 0.5
    monkeypatch.setattr(ete, "ROW_KNOTS", ())
    assert cost_mape_pct(fit_batch_cost(train, regimes=REGIMES), test) > 1.2


def test_past_its_last_sample_the_fit_goes_on_at_the_last_slope() -> None:
    """No knot bends where no step was timed: a prompt longer than all of them is priced
    on the slope measured last, not on a band with nothing in it."""
    short = [s for s in _samples(BANDED, seed=1, n=600) if s.prefill_tokens + s.decode_seqs <= 100]
    cost = fit_batch_cost(short, regimes=REGIMES)
    assert all(b.lo < 100 for b in cost.bands if b.axis == "rows")
    for n in (400, 1600):
        assert cost.prefill_time(n) == pytest.approx(BANDED.prefill_time(n), rel=0.03)


def test_a_band_may_not_cost_less_than_nothing() -> None:
    assert BandCost("rows", 8, math.inf, -8 * 0.01, 0.01).intercept < 0  # a knot: 0 at 8 rows
    with pytest.raises(CostBandError, match="must be >= 0 over its rows"):
        BandCost("rows", 8, math.inf, -1.0, 0.01)


def test_merged_bands_are_disjoint_and_price_as_the_bands_they_merge() -> None:
    from duetime.core.cost_bands import bands_time, merge_bands

    overlapping = (*BENT.bands, BandCost("rows", 4, 64, 0.001, 1e-4))
    merged = merge_bands(overlapping)
    for axis in ("rows", "head_rows"):
        spans = sorted((b.lo, b.hi) for b in merged if b.axis == axis)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for rows in range(1, 700, 7):
        for head in (1, 2, 3, 9):
            assert bands_time(merged, rows, head) == pytest.approx(
                bands_time(overlapping, rows, head), rel=1e-12, abs=1e-15
            )
