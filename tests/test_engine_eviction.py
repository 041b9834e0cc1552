"""SnapKV on the tiny random-weight Gemma 3's KV cache: scores against eager attention,
kept sets, exact token accounting with sliding layers and chunked prefill, the window
freed, export and restore exact. The executor's evictions: ``test_executor_eviction.py``."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from duetime.engine import SeqChunk
from duetime.engine.eviction import snapkv_evict, snapkv_scores
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from tests.factories import EvictAfterPrefill

PROMPT = [random.Random(7).randrange(256) for _ in range(40)]


@pytest.fixture(scope="module")
def hf() -> Any:
    # sliding window 16 < prompt 40, and larger than the observation window used below,
    # so sliding layers have entries SnapKV must choose among
    return tiny_hf_model(seed=2, sliding_window=16)


@pytest.fixture(scope="module")
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf)


@pytest.fixture(scope="module")
def model_w4() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1))  # sliding window 4


def _prefill(model: Gemma3, chunks: list[int], window: int, prompt: list[int] = PROMPT) -> Any:
    kv = model.new_kv_cache()
    slot = kv.allocate()
    kv.watch(slot, window)
    pos = 0
    for n in chunks:
        model.step([SeqChunk(slot, prompt[pos : pos + n], pos)], kv)
        pos += n
    assert pos == len(prompt)
    return kv, slot


@torch.no_grad()
def _eager_scores(hf: Any, prompt: list[int], window: int) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, T]``: softmax(QKᵀ) of the last ``window`` queries from
    transformers' eager attention, summed over those queries and each group's heads."""
    out = hf(torch.tensor([prompt]), output_attentions=True)
    kvh = hf.config.num_key_value_heads
    ref = []
    for att in out.attentions:  # [1, heads, T, T]
        a = att[0, :, -window:, :]
        ref.append(a.reshape(kvh, -1, a.shape[-1]).sum(dim=1))
    return ref


@pytest.mark.parametrize("chunks", [[40], [13, 9, 18], [35, 1, 4]])
def test_scores_equal_eager_attention_weights(hf: Any, model: Gemma3, chunks: list[int]) -> None:
    w = 8  # the window spans chunk borders in the chunked cases
    kv, slot = _prefill(model, chunks, window=w)
    ref = _eager_scores(hf, PROMPT, w)
    rep = model.config.num_heads // model.config.num_kv_heads
    for layer in range(model.config.num_layers):
        ours = snapkv_scores(kv, slot, layer, w)
        pos = kv.positions(slot, layer)
        want = ref[layer].gather(1, pos)
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)
        # every key any window query sees is held: the weights sum to one per query row
        torch.testing.assert_close(ours.sum(-1), torch.full((2,), float(rep * w)))


def _pooled(scores: torch.Tensor, n_prefix: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV's pooling written out: a centred window over the prefix, zeros outside."""
    s = scores[:, :n_prefix]
    half = kernel // 2
    out = torch.zeros_like(s)
    for j in range(n_prefix):
        lo, hi = max(0, j - half), min(n_prefix, j + half + 1)
        part = s[:, lo:hi]
        out[:, j] = part.sum(-1) / kernel if pooling == "avg" else part.max(-1).values
    return out


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_kept_positions_are_the_window_plus_the_top_pooled_prefix_per_head(
    hf: Any, model: Gemma3, pooling: str
) -> None:
    w, n_drop, kernel = 8, 28, 7  # keeps 12: fewer than a sliding layer's 15 live entries
    kv, slot = _prefill(model, [17, 23], window=w)
    ref = _eager_scores(hf, PROMPT, w)
    cfg = model.config
    keep = 40 - n_drop
    snapkv_evict(kv, slot, n_drop, window=w, kernel=kernel, pooling=pooling)  # type: ignore[arg-type]
    differ = False
    for layer in range(cfg.num_layers):
        kept = kv.positions(slot, layer)
        if cfg.sliding_layers[layer]:
            # candidates are the 15 live entries (window 16 - 1), more than may stay: its own SnapKV
            live = torch.arange(40 - (cfg.sliding_window - 1), 40)
            assert kept.shape[1] == keep
            assert bool(torch.isin(kept, live).all())
            scores = ref[layer][:, live]
            n_prefix, offset = live.numel() - w, int(live[0])
        else:
            scores, n_prefix, offset = ref[layer], 40 - w, 0
        pooled = _pooled(scores, n_prefix, kernel, pooling)
        for h in range(cfg.num_kv_heads):
            assert kept[h, -w:].tolist() == list(range(40 - w, 40))  # the whole window
            chosen = kept[h, :-w] - offset
            assert chosen.numel() == keep - w
            others = torch.ones(n_prefix, dtype=torch.bool)
            others[chosen] = False
            # top-scored: no dropped prefix entry scores above a kept one (max-pooling ties
            # make the exact set ambiguous, so compare scores, not indices)
            assert float(pooled[h, chosen].min()) >= float(pooled[h, others].max()) - 1e-5
        differ |= kept[0].tolist() != kept[1].tolist()
    assert differ, "random heads should disagree somewhere: per-head selection is the point"
    assert kv.num_tokens(slot) == keep


@pytest.mark.parametrize("chunks", [[40], [5, 30, 5], [1] * 40])
@pytest.mark.parametrize("n_drop", [0, 1, 13, 30, 39])
def test_accounting_is_exact_with_sliding_layers(
    model: Gemma3, model_w4: Gemma3, chunks: list[int], n_drop: int
) -> None:
    for m in (model, model_w4):  # sliding window 16 and 4, both below the 40-token prompt
        kv, slot = _prefill(m, chunks, window=32)
        old = kv.num_tokens(slot)
        assert old == 40
        snapkv_evict(kv, slot, n_drop)
        assert kv.num_tokens(slot) == old - n_drop
        # every layer still holds the newest position, and decoding goes on from there
        assert all(int(kv.positions(slot, i)[:, -1].min()) == 39 for i in range(4))
        m.step([SeqChunk(slot, [3], 40)], kv)
        assert kv.num_tokens(slot) == old - n_drop + 1


def test_fewer_kept_than_the_window_keeps_the_newest(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=32)
    snapkv_evict(kv, slot, 37)
    for layer in range(model.config.num_layers):
        assert kv.positions(slot, layer).tolist() == [[37, 38, 39]] * 2


def test_bad_arguments_are_clear_errors(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=8)
    with pytest.raises(ValueError, match="window"):
        snapkv_evict(kv, slot, 4, window=0)
    with pytest.raises(ValueError, match="odd"):
        snapkv_evict(kv, slot, 4, kernel=6)
    with pytest.raises(ValueError, match="pooling"):
        snapkv_evict(kv, slot, 4, pooling="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        snapkv_evict(kv, slot, -1)
    with pytest.raises(ValueError, match="at least one"):
        snapkv_evict(kv, slot, 40)
    assert kv.num_tokens(slot) == 40  # nothing happened
    other = kv.allocate()
    model.step([SeqChunk(other, PROMPT[:10], 0)], kv)
    with pytest.raises(ValueError, match="no observation window"):
        snapkv_evict(kv, other, 4)
    with pytest.raises(ValueError, match="eviction must be one of"):
        EngineExecutor(EvictAfterPrefill(0.5), model, eviction="h2o")


def test_window_is_freed_and_survives_export(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=8)
    before = kv.nbytes(slot)
    state = kv.export(slot)  # a swap before eviction keeps the window
    assert not kv.watching
    slot2 = kv.restore(state)
    assert kv.nbytes(slot2) >= kv.obs_window(slot2).nbytes  # type: ignore[union-attr]
    ref, ref_slot = _prefill(model, [40], window=8)
    snapkv_evict(kv, slot2, 20, window=8)
    snapkv_evict(ref, ref_slot, 20, window=8)
    for layer in range(4):
        assert torch.equal(kv.positions(slot2, layer), ref.positions(ref_slot, layer))
        assert torch.equal(kv.keys(slot2, layer), ref.keys(ref_slot, layer))
    kv.unwatch(slot2)
    assert kv.nbytes(slot2) < before
    kv.free(slot2)
    assert kv.total_tokens == 0
    assert not kv.watching


def test_evicted_sequence_export_restore_is_bit_exact(model: Gemma3) -> None:
    kv, slot = _prefill(model, [13, 27], window=8)
    snapkv_evict(kv, slot, 25, window=8)
    kv.unwatch(slot)
    model.step([SeqChunk(slot, [5], 40)], kv)
    want = [
        (
            kv.keys(slot, i).clone(),
            kv.positions(slot, i).clone(),
            kv.view(slot, i, 0).values.clone(),
        )
        for i in range(4)
    ]
    slot2 = kv.restore(kv.export(slot))
    for i, (k, p, v) in enumerate(want):
        assert torch.equal(kv.keys(slot2, i), k)
        assert torch.equal(kv.positions(slot2, i), p)
        assert torch.equal(kv.view(slot2, i, 0).values, v)
    assert kv.num_tokens(slot2) == 16
