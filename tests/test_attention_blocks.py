"""Long prefill chunks attend in blocks of queries, each over the keys it may see.

The blocks must give the attention of one call over every key with the full
causal (and sliding-window) mask: for whole prompts, for chunks with a past, in
global and sliding layers, and through the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import duetime.engine.attention as attention
from duetime.engine import SeqChunk
from duetime.engine.attention import MaskCache, attend, attend_prefill
from duetime.engine.kv_cache import KVCache, KVView
from duetime.engine.testing import engine_from_hf, tiny_hf_model

WINDOW = 16


def _view(past: int, n: int, sliding: bool, kv_heads: int = 1) -> KVView:
    """The keys a chunk of ``n`` at position ``past`` sees, as the cache gives them (a
    sliding layer keeps the last ``WINDOW - 1`` of its past)."""
    s = past + n
    lo = max(0, s - (WINDOW - 1 + n)) if sliding else 0
    g = torch.Generator().manual_seed(past * 1000 + n)
    k = torch.randn(kv_heads, s, 32, generator=g)
    v = torch.randn(kv_heads, s, 32, generator=g)
    return KVView(k[:, lo:], v[:, lo:], lo, None, needs_mask=True)


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize(
    ("past", "n"), [(0, 50), (0, 8), (0, 16), (0, 17), (37, 50), (5, 9), (100, 21)]
)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_blocks_attend_as_one_masked_call(
    monkeypatch: pytest.MonkeyPatch, past: int, n: int, sliding: bool, kv_heads: int
) -> None:
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 8)
    view = _view(past, n, sliding, kv_heads)
    q = torch.randn(n, 4, 32, generator=torch.Generator().manual_seed(n))
    full = attend(q, view, MaskCache(WINDOW).mask(view, past, n, sliding), 0.2)
    got = attend_prefill(q, view, past, sliding, MaskCache(WINDOW), 0.2)
    assert got.shape == full.shape
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)


def test_every_block_sees_only_keys_it_may_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key no query of the chunk may see (outside every window) changes nothing."""
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 8)
    view = _view(0, 64, sliding=True)
    q = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(1))
    before = attend_prefill(q, view, 0, True, MaskCache(WINDOW), 0.2)
    view.keys[:, 0] = 1e4  # key 0: seen by queries 0..15 only
    after = attend_prefill(q, view, 0, True, MaskCache(WINDOW), 0.2)
    assert not torch.allclose(before[:WINDOW], after[:WINDOW])
    torch.testing.assert_close(before[WINDOW:], after[WINDOW:], rtol=0, atol=0)


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=2))  # sliding window 4


@pytest.mark.parametrize("split", [None, 23])
def test_the_model_prefills_in_blocks_as_in_one_call(
    monkeypatch: pytest.MonkeyPatch, model: Any, split: int | None
) -> None:
    """A 60-token prompt (whole, or in chunks of 23 and 37: a past) in blocks of 8
    queries gives the logits and the cache of one call per layer."""
    prompt = torch.randint(3, 250, (60,), generator=torch.Generator().manual_seed(4)).tolist()

    def prefill() -> tuple[torch.Tensor, KVCache, int]:
        kv = KVCache(model.config)
        slot = kv.allocate(64)
        if split is None:
            return model.step([SeqChunk(slot, prompt, 0)], kv), kv, slot
        model.step([SeqChunk(slot, prompt[:split], 0)], kv)
        return model.step([SeqChunk(slot, prompt[split:], split)], kv), kv, slot

    monkeypatch.setattr(attention, "PREFILL_BLOCK", 10**6)
    ref, kv_ref, slot = prefill()
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 8)
    got, kv_got, _ = prefill()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    for layer in range(model.config.num_layers):
        a, b = kv_got.view(slot, layer, 1), kv_ref.view(slot, layer, 1)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
