"""Fitting step-cost models: known coefficients come back; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.predict.ete import (
    StepSample,
    evaluate,
    fit_batch_cost,
    fit_timebill,
    split_samples,
    whole_prompts,
)

TRUE = LinearStepCost(c0=0.006, c_prefill=0.002, a1=4e-4, a2=2e-8, b=3e-4, d=2e-7)


def _samples(noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    out = []

    def add(p: int, past: int, dseq: int, kv: int, kind: str) -> None:
        attn = float(p * (past + p))
        t = TRUE.step_time(p, attn, dseq, kv) * (1 + noise * rng.standard_normal())
        out.append(StepSample(p, attn, dseq, kv, t, kind))

    for n in (16, 64, 128, 256, 512, 1024, 2048):
        add(n, 0, 0, 0, "prefill")
    for d in (1, 4, 16, 64):
        for ctx in (64, 512, 2048):
            add(0, 0, d, d * ctx, "decode")
    for n, d in ((128, 8), (512, 16), (64, 32)):
        add(n, 0, d, d * 300, "mixed")
    return out


def test_batch_fit_recovers_exact_coefficients_without_noise() -> None:
    fit = fit_batch_cost(_samples(0.0))
    for name in ("c0", "c_prefill", "a1", "a2", "b", "d"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-3, abs=1e-10)


def test_noisy_fit_has_small_heldout_mape() -> None:
    samples = _samples(0.02, seed=1) + _samples(0.02, seed=2)
    train, test = split_samples(samples, 0.25, seed=0)
    cost = fit_batch_cost(train)
    ete = fit_timebill(train)
    m = evaluate(cost, ete, test)
    assert m["batch_model_mape_pct"] is not None
    assert m["batch_model_mape_pct"] < 5.0
    # and it is a real check: a wrong model is far off
    wrong = LinearStepCost(c0=0.05)
    assert evaluate(wrong, ete, test)["batch_model_mape_pct"] > 50.0


def test_a_sum_calibrated_fit_adds_up_skewed_steps_to_their_total() -> None:
    """One step in five takes twice its time: the relative-L1 fit prices the usual step
    (about the median) and its sum falls short of the measured total by the skew; the
    calibrated fit sums to the total and keeps the uncalibrated fit's shape."""
    clean = _samples(0.0) * 5
    steps = [
        StepSample(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens,
                   s.seconds * (2.0 if k % 5 == 0 else 1.0), s.kind)
        for k, s in enumerate(clean)
    ]  # fmt: skip
    total = sum(s.seconds for s in steps)

    def priced(cost: LinearStepCost) -> float:
        return sum(
            cost.step_time(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens)
            for s in steps
        )

    median = fit_batch_cost(steps)
    summed = fit_batch_cost(steps, sum_calibrated=True)
    assert priced(median) < 0.9 * total
    assert priced(summed) == pytest.approx(total, rel=1e-6)
    assert summed.meta["sum_scale"] == pytest.approx(total / priced(median), rel=1e-3)
    assert summed.b / summed.c0 == pytest.approx(median.b / median.c0, rel=1e-6)
    assert "sum_scale" not in median.meta
    # priced shapes added after the timed steps (anchors) do not count toward the total
    anchors = [
        StepSample(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens,
                   s.seconds * 0.5, s.kind)
        for s in clean[:40]
    ]  # fmt: skip
    anchored = fit_batch_cost(steps, sum_calibrated=True, extra=anchors)
    assert priced(anchored) == pytest.approx(total, rel=1e-6)


def test_timebill_fit_matches_its_closed_forms() -> None:
    ete = fit_timebill(_samples(0.0))
    assert ete.a == pytest.approx(TRUE.a2, rel=1e-6)
    assert ete.b == pytest.approx(TRUE.a1, rel=1e-6)
    assert ete.c == pytest.approx(TRUE.c0 + TRUE.c_prefill, rel=1e-6)
    # batch-1 decode: q = c0 + b, p = d
    assert ete.p == pytest.approx(TRUE.d, rel=1e-6)
    assert ete.q == pytest.approx(TRUE.c0 + TRUE.b, rel=1e-6)
    # e2e: prefill + (N-1) steps attending N, N+1, ... tokens
    n, o = 300, 20
    direct = ete.prefill(n) + sum(ete.decode_step(n + i) for i in range(o - 1))
    assert ete.e2e(n, o) == pytest.approx(direct, rel=1e-12)
    assert ete.e2e(n, o, keep_ratio=0.5) < ete.e2e(n, o)


def test_timebill_fits_and_is_judged_on_whole_prompts_only() -> None:
    """A chunk after its past is not a prompt of the chunk's rows: TimeBill's t_prefill(N)
    neither fits nor is scored on one (it would price it as a whole prompt of N)."""
    whole = _samples(0.0)
    chunks = []
    for past in (256, 512, 768):  # 256-row chunks of a 1,024-token prompt, priced exactly
        attn = float(256 * (past + 256))
        t = TRUE.step_time(256, attn, 0, 0)
        chunks.append(StepSample(256, attn, 0, 0, t, "prefill", ((256, past + 256),)))
    ete = fit_timebill(whole + chunks)
    assert ete.a == pytest.approx(TRUE.a2, rel=1e-6)  # the chunks moved nothing
    assert evaluate(TRUE, ete, whole + chunks)["ete_prefill_mape_pct"] == pytest.approx(0, abs=1e-6)
    recorded = [StepSample(64, 64.0 * 64, 0, 0, 0.03, "prefill", ((64, 64),))]
    assert whole_prompts(recorded + chunks) == recorded


def test_timebill_prefill_fit_weights_short_prompts_like_long_ones() -> None:
    """Relative residuals: with 5 % multiplicative noise, the MAPE of the fit beats plain LS."""
    rng = np.random.default_rng(3)
    n = np.repeat([16.0, 32, 64, 128, 256, 512, 1024, 2048], 6)
    truth = 2e-7 * n * n + 1.2e-3 * n + 0.01
    t = truth * (1 + 0.05 * rng.standard_normal(n.size))
    pre = [StepSample(int(k), k * k, 0, 0, float(v), "prefill") for k, v in zip(n, t, strict=True)]
    dec = [StepSample(0, 0.0, 1, k, 0.02 + 1e-6 * k, "decode") for k in (64, 512, 2048)]
    ete = fit_timebill(pre + dec)
    x = np.column_stack([n * n, n, np.ones_like(n)])
    plain = x @ np.linalg.lstsq(x, t, rcond=None)[0]
    ours = np.asarray(ete.prefill(n))
    short = n <= 64
    assert np.mean(np.abs(ours - truth) / truth) < np.mean(np.abs(plain - truth) / truth)
    assert np.mean(np.abs(ours[short] - truth[short]) / truth[short]) < 0.5 * np.mean(
        np.abs(plain[short] - truth[short]) / truth[short]
    )


def test_too_few_samples_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least 6"):
        fit_batch_cost(_samples(0.0)[:3])
    with pytest.raises(ValueError, match="prefill"):
        fit_timebill([s for s in _samples(0.0) if s.kind != "prefill"])


def test_profile_of_a_tiny_engine_loads_into_the_simulator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from duetime.engine.profile import ProfileGrid, measure_steps
    from duetime.engine.testing import engine_from_hf, tiny_hf_model
    from duetime.predict.cost_report import profile_payload
    from duetime.sim.profiles import load_profile

    model = engine_from_hf(tiny_hf_model(seed=0))
    samples = measure_steps(model, ProfileGrid.quick())
    kinds = {s.kind for s in samples}
    assert kinds == {"prefill", "decode", "mixed"}
    assert all(s.seconds > 0 for s in samples)
    payload = profile_payload(
        samples, name="tiny", source="test", kv_capacity_tokens=999,
        max_num_seqs=7, max_batch_tokens=321,
    )  # fmt: skip
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(payload))
    cost, cfg = load_profile(str(path))
    assert (cfg.kv_capacity, cfg.max_num_seqs, cfg.max_batch_tokens) == (999, 7, 321)
    assert cost.step_time(0, 0.0, 1, 10) > 0
    assert payload["heldout"]["batch_model_mape_pct"] is not None


def test_serving_steps_are_the_executors_steps_of_a_real_run() -> None:
    from duetime.core.request import Job, Request
    from duetime.engine.profile import serving_steps
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    model = engine_from_hf(tiny_hf_model(seed=0))
    jobs = [
        Job(Request(rid=k, arrival=0.0, prompt_len=5 + 3 * k, max_tokens=6), output_len=6)
        for k in range(4)
    ]
    steps = serving_steps(model, jobs=jobs, max_batch_tokens=8)
    # 4 prompts of 5..14 tokens in chunks of <= 8 tokens, 6 tokens each: prefill and decode
    assert sum(s.prefill_tokens for s in steps) == sum(5 + 3 * k for k in range(4))
    assert sum(s.decode_seqs for s in steps) == 4 * 5  # the first token comes from prefill
    assert {s.kind for s in steps} >= {"decode", "mixed"}
    assert all(s.seconds > 0 for s in steps)
    for s in steps:  # kinds follow the shapes
        assert (s.kind == "decode") == (s.prefill_tokens == 0)


def test_evictions_are_timed_and_priced_into_the_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from duetime.engine.profile import (
        ProfileGrid,
        fit_eviction_cost,
        measure_evictions,
        measure_steps,
    )
    from duetime.engine.testing import engine_from_hf, tiny_hf_model
    from duetime.predict.cost_report import profile_payload
    from duetime.sim.profiles import load_profile

    model = engine_from_hf(tiny_hf_model(seed=0))
    for method in ("snapkv", "streaming"):
        ev = measure_evictions(model, (16, 40), method=method, reps=2)
        assert [h for h, _ in ev] == [16, 16, 40, 40]  # KV held before each eviction
        assert all(s > 0 for _, s in ev)
    with pytest.raises(ValueError, match="snapkv or streaming"):
        measure_evictions(model, (16,), method="h2o")
    assert fit_eviction_cost([(100, 0.01), (200, 0.02)]) == pytest.approx(1e-4)
    assert fit_eviction_cost([]) == 0.0
    payload = profile_payload(
        measure_steps(model, ProfileGrid.quick()), name="tiny", source="test",
        kv_capacity_tokens=999, max_num_seqs=7, max_batch_tokens=321, evictions=ev,
    )  # fmt: skip
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(payload))
    cost, _ = load_profile(str(path))
    assert cost.e == pytest.approx(fit_eviction_cost(ev))
    assert cost.eviction_time(40) > 0
