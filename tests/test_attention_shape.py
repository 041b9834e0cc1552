"""The attention shape: a prompt chunk's ``A`` term as the engine's kernels compute it.

The guard here counts the scores the engine's attention calls compute and holds the
shape to them, so a changed kernel choice (block size, when the causal call serves, how
many keys a sliding layer keeps) cannot silently leave the cost model pricing another.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from duetime.core.attention_shape import AttentionShape, AttentionShapeError
from duetime.core.cost import CostModelError, LinearStepCost, chunk_attention
from duetime.core.cost_bands import CostRegimes
from duetime.predict.ete import StepSample, fit_batch_cost

GEMMA = AttentionShape(window=512, sliding_layers=15, layers=18, block=256)


def test_without_a_shape_a_chunk_costs_rows_times_end() -> None:
    assert chunk_attention(64, 64) == 64 * 64
    assert chunk_attention(100, 400) == 100 * 400
    assert LinearStepCost(c0=1e-3).chunk_attention(100, 400) == 100 * 400


def test_a_whole_prompt_within_the_window_is_one_causal_call_on_every_layer() -> None:
    assert GEMMA.work(300, 300) == 300 * 300
    assert GEMMA.work(512, 512) == 512 * 512


def test_past_the_window_a_sliding_layer_sees_its_window_only() -> None:
    # a 1,024-token prompt: 3 global layers run one causal call, 15 sliding ones 4
    # blocks of 256 over at most the 511 keys before each query's block plus the block
    sliding = sum(256 * (b - max(0, a - 511)) for a, b in ((0, 256), (256, 512),
                                                            (512, 768), (768, 1024)))  # fmt: skip
    assert GEMMA.work(1024, 1024) == pytest.approx((3 * 1024 * 1024 + 15 * sliding) / 18)
    assert GEMMA.work(1024, 1024) < 0.8 * chunk_attention(1024, 1024)


def test_a_chunk_after_its_past_is_one_masked_call_over_the_keys_each_layer_holds() -> None:
    # 192 rows after 576: a global layer holds 768 keys, a sliding one 511 + 192
    assert GEMMA.work(192, 768) == pytest.approx((3 * 192 * 768 + 15 * 192 * 703) / 18)
    # after a short past every layer holds it all
    assert GEMMA.work(100, 300) == pytest.approx(100 * 300)


def test_a_long_chunk_after_its_past_runs_in_blocks() -> None:
    one_global = 256 * (512 + 256) + 44 * (512 + 300)
    assert GEMMA._layer(300, 512, None) == one_global
    assert GEMMA.work(0, 10) == 0.0


@pytest.mark.parametrize(
    "raw",
    [
        {"window": 512, "sliding_layers": 15, "layers": 18},
        {"window": 512, "sliding_layers": 19, "layers": 18, "block": 256},
        {"window": 0, "sliding_layers": 1, "layers": 18, "block": 256},
        {"window": "512", "sliding_layers": 15, "layers": 18, "block": 256},
        [512, 15, 18, 256],
    ],
)
def test_a_shape_that_describes_no_model_is_refused(raw: Any) -> None:
    with pytest.raises(AttentionShapeError):
        AttentionShape.from_dict(raw)


def test_a_profile_keeps_its_shape_and_one_without_prices_rows_times_end(tmp_path: Any) -> None:
    cost = LinearStepCost(c0=1e-3, a2=1e-9, attention=GEMMA)
    path = tmp_path / "p.json"
    import json

    path.write_text(json.dumps(cost.to_profile()))
    back = LinearStepCost.from_profile(path)
    assert back.attention == GEMMA
    assert back.prefill_time(1024) == pytest.approx(1e-3 + 1e-9 * GEMMA.work(1024, 1024))
    plain = LinearStepCost.from_dict({"coefficients": {"c0": 1e-3, "a2": 1e-9}}, "plain")
    assert plain.attention is None
    assert plain.prefill_time(1024) == pytest.approx(1e-3 + 1e-9 * 1024 * 1024)
    bad = {**cost.to_profile(), "attention": {"window": 512}}
    with pytest.raises(CostModelError, match="attention shape"):
        LinearStepCost.from_dict(bad, "bad.json")


def test_the_fit_keeps_the_engines_shape() -> None:
    samples = [
        StepSample(n, GEMMA.work(n, n), 0, 0, 1e-3 + 1e-6 * n + 1e-9 * GEMMA.work(n, n))
        for n in (8, 32, 64, 128, 256, 512, 768, 1024)
    ] + [StepSample(0, 0.0, d, 100 * d, 2e-3 + 1e-4 * d) for d in (1, 2, 4, 8)]
    cost = fit_batch_cost(samples, regimes=CostRegimes(attention=GEMMA))
    assert cost.attention == GEMMA
    assert "attention" not in cost.meta["regimes"]  # kept once, as the model's own
    assert cost.prefill_time(1024) == pytest.approx(samples[7].seconds, rel=0.02)


# --- the guard: the shape counts what the engine's kernels compute ------------------


@pytest.fixture(scope="module")
def tiny() -> Any:
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    # window 8 over blocks of 6 (the block patched below): Gemma's 512 over 256 in small
    return engine_from_hf(tiny_hf_model(sliding_window=8))


def _scores(model: Any, rows: int, past: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """The query-key scores one prompt chunk's attention calls compute, per layer."""
    from duetime.engine.batch import SeqChunk

    kv = model.new_kv_cache()
    slot = kv.allocate(past + rows)
    if past:
        model.greedy_step([SeqChunk(slot, list(range(3, 3 + past)), 0)], kv)
    counted: list[float] = []
    sdpa = F.scaled_dot_product_attention

    def counting(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counted.append(q.shape[-3] * q.shape[-2] * k.shape[-2])  # heads x queries x keys
        return sdpa(q, k, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", counting)
        model.greedy_step([SeqChunk(slot, list(range(5, 5 + rows)), past)], kv)
    cfg = model.config
    return sum(counted) / cfg.num_heads / cfg.num_layers


@pytest.mark.parametrize(
    ("rows", "past"),
    [(5, 0), (8, 0), (13, 0), (4, 3), (4, 20), (6, 20), (13, 20), (15, 2), (2, 40)],
)
def test_the_shape_counts_the_scores_the_engine_computes(
    tiny: Any, rows: int, past: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from duetime.engine import attention
    from duetime.engine.cost_regimes import attention_shape_of

    monkeypatch.setattr(attention, "PREFILL_BLOCK", 6)
    shape = attention_shape_of(tiny)
    assert (shape.window, shape.block) == (8, 6)
    assert shape.work(rows, past + rows) == _scores(tiny, rows, past, monkeypatch)


def test_unblocked_attention_is_one_call_per_chunk(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from duetime.engine.cost_regimes import attention_shape_of

    monkeypatch.setattr(tiny, "blocked_prefill_attention", False)
    shape = attention_shape_of(tiny)
    for rows, past in ((13, 0), (13, 20)):
        assert shape.work(rows, past + rows) == _scores(tiny, rows, past, monkeypatch)
