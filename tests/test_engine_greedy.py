"""Plain greedy steps: each row's token without a row of logits (Gemma3.greedy /
greedy_step, RescoredInt8Head.best) and the int8 products' unscaled ranking."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from duetime.engine import SeqChunk
from duetime.engine.linear import Int8Linear, int8_available, ranking, row_scaled
from duetime.engine.q8_kernel import q8_available
from duetime.engine.rescored_head import RescoredInt8Head, topk_indices
from duetime.engine.testing import engine_from_hf, tiny_hf_model

needs_kernel = pytest.mark.skipif(
    not q8_available(), reason="int8 kernel could not be built here (no g++/ninja or no AVX2)"
)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=3)


def _rank_backends() -> list[Any]:
    from duetime.engine.onednn_int8 import OneDnnInt8Linear, onednn_int8_available

    w = torch.randn(300, 48, generator=torch.Generator().manual_seed(0))
    found: list[Any] = [Int8Linear(w)] if int8_available() else []
    if onednn_int8_available():
        found.append(OneDnnInt8Linear(w))
    return found


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_an_int8_ranking_is_the_product_divided_by_the_row_scale(rows: int) -> None:
    backends = _rank_backends()
    if not backends:
        pytest.skip("no int8 GEMM in this torch build")
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
    x[0] *= 50.0  # an outlier row: its own scale, not a shared one
    _, row_max = row_scaled(x)
    for lin in backends:
        ranked = ranking(lin, x)
        assert not torch.allclose(ranked, lin(x))  # really unscaled
        torch.testing.assert_close(ranked * row_max, lin(x), rtol=1e-5, atol=1e-4)
        assert torch.equal(ranked.argmax(-1), lin(x).argmax(-1))


def test_ranking_of_a_plain_product_is_the_product() -> None:
    from duetime.engine.linear import DenseLinear

    lin = DenseLinear(torch.randn(5, 8), torch.float32)
    x = torch.randn(3, 8)
    assert torch.equal(ranking(lin, x), lin(x))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
def test_q8_greedy_picks_what_the_argmax_of_its_logits_picks(hf: Any, rows: int) -> None:
    """Rows 1-2: the int8 kernel ranks (int4 up to 4 where the CPU has VNNI), 3+: int8
    GEMMs; every pick equals the arg-max of the argmax_only logits (the best candidate
    wins either way where the exact scores lead, as they do for these rows)."""
    model = engine_from_hf(hf, "q8")
    assert isinstance(model.lm_head, RescoredInt8Head)
    hidden = torch.randn(rows, hf.config.hidden_size, generator=torch.Generator().manual_seed(7))
    want = model.logits(hidden, argmax_only=True).argmax(-1)
    got = model.greedy(hidden)
    assert got.dtype == torch.int64
    assert got.shape == (rows,)
    assert torch.equal(got, want)


@needs_kernel
def test_best_is_the_exactly_best_of_the_ranked_candidates(hf: Any) -> None:
    model = engine_from_hf(hf, "q8")
    head = model.lm_head
    assert isinstance(head, RescoredInt8Head)
    x = torch.randn(6, hf.config.hidden_size, generator=torch.Generator().manual_seed(11))
    best = head.best(x)
    cand = topk_indices(ranking(head._int8, x), head.k)
    exact = x @ head.weight.T  # every logit in fp32
    for r in range(6):
        assert int(best[r]) in cand[r].tolist()
        assert int(best[r]) == int(cand[r][exact[r, cand[r]].argmax()])


@pytest.mark.parametrize("dtype", ["fp32", "q8"])
def test_greedy_step_equals_step_then_argmax(hf: Any, dtype: str) -> None:
    """Same prompts, same cache state: the greedy step's tokens are the step's arg-max,
    and it advances the cache as the step does."""
    if dtype == "q8" and not q8_available():
        pytest.skip("int8 kernel could not be built here")
    model = engine_from_hf(hf, dtype)  # type: ignore[arg-type]
    prompts = [[2, 5, 9, 11], [2, 7], [2, 3, 4, 5, 6, 8]]
    caches = []
    for _ in range(2):
        kv = model.new_kv_cache()
        slots = [kv.allocate() for _ in prompts]
        caches.append((kv, slots))
    (kv_a, sa), (kv_b, sb) = caches
    a = model.step([SeqChunk(s, p, 0) for s, p in zip(sa, prompts, strict=True)], kv_a)
    b = model.greedy_step([SeqChunk(s, p, 0) for s, p in zip(sb, prompts, strict=True)], kv_b)
    assert torch.equal(a.argmax(-1), b)
    for _ in range(3):  # decode steps from there, each fed its own pick
        a = model.step(
            [SeqChunk(s, [int(t)], kv_a.seq_len(s)) for s, t in zip(sa, a.argmax(-1), strict=True)],
            kv_a,
            argmax_only=True,
        )
        b = model.greedy_step(
            [SeqChunk(s, [int(t)], kv_b.seq_len(s)) for s, t in zip(sb, b, strict=True)], kv_b
        )
        assert torch.equal(a.argmax(-1), b)
    assert [kv_a.seq_len(s) for s in sa] == [kv_b.seq_len(s) for s in sb]
