"""KV cache accounting, slot life cycle, sliding-window trimming and the eviction primitive."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from duetime.engine import Gemma3, KVCache, SeqChunk
from duetime.engine.testing import engine_from_hf, tiny_hf_model

WINDOW = 4


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=3))


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _feed(model: Gemma3, kv: KVCache, slot: int, ids: list[int]) -> torch.Tensor:
    return model.step([SeqChunk(slot, ids, kv.seq_len(slot))], kv, all_logits=True)


def test_accounting_returns_to_zero_after_free(model: Gemma3) -> None:
    kv = model.new_kv_cache()
    a, b = kv.allocate(), kv.allocate()
    model.step([SeqChunk(a, _ids(10), 0), SeqChunk(b, _ids(3), 0)], kv)
    model.step([SeqChunk(a, [1], 10), SeqChunk(b, _ids(40), 3)], kv)
    # the global layers hold every position; sliding ones are bounded
    assert (kv.num_tokens(a), kv.num_tokens(b)) == (11, 43)
    assert kv.total_tokens == 54
    assert kv.total_bytes >= 54 * kv.bytes_per_token // 2  # 2 of 4 layers are global
    kv.free(a)
    assert kv.total_tokens == 43
    kv.free(b)
    assert kv.total_tokens == 0
    assert kv.total_bytes == 0
    assert kv.slots == []
    assert kv.allocate() in (a, b)  # slots are reused


def test_free_unknown_slot_fails(model: Gemma3) -> None:
    kv = model.new_kv_cache()
    s = kv.allocate()
    kv.free(s)
    with pytest.raises(KeyError):
        kv.free(s)


def test_can_allocate_respects_budget(model: Gemma3) -> None:
    kv = model.new_kv_cache(max_tokens=20)
    s = kv.allocate()
    _feed(model, kv, s, _ids(15))
    assert kv.can_allocate(5)
    assert not kv.can_allocate(6)
    kv.free(s)
    assert kv.can_allocate(20)


def test_sliding_layers_stay_bounded(model: Gemma3) -> None:
    kv = model.new_kv_cache()
    s = kv.allocate()
    _feed(model, kv, s, _ids(100))
    for _ in range(60):
        _feed(model, kv, s, [7])
    sliding = [i for i, sl in enumerate(model.config.sliding_layers) if sl]
    for i in sliding:
        assert kv.positions(s, i).shape[1] < 100 + 2 * WINDOW  # trimmed, never the full 160
        assert kv.positions(s, i)[0, -1] == 159
    assert kv.num_tokens(s) == 160  # global layers keep everything


def test_a_sliding_layer_does_not_trim_at_every_token(model: Gemma3) -> None:
    """A buffer held at the window's size trimmed (copying its whole window) at every
    decoded token; after a trim it must have room for a run of tokens."""
    from duetime.engine import kv_store

    trims = 0
    real_make_room = kv_store.KVStore._make_room

    def counting(self, slot, layer, n, sliding):  # type: ignore[no-untyped-def]
        nonlocal trims
        before = layer.length
        real_make_room(self, slot, layer, n, sliding)
        trims += layer.length < before

    kv = model.new_kv_cache()
    s = kv.allocate(WINDOW)  # capacity: exactly the window
    _feed(model, kv, s, _ids(WINDOW))
    sliding = sum(model.config.sliding_layers)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_store.KVStore, "_make_room", counting)
        for _ in range(40):
            _feed(model, kv, s, [7])
    assert trims <= 2 * sliding  # at most a couple of trims a layer, not one a token
    for i, sl in enumerate(model.config.sliding_layers):
        if sl:
            assert kv.positions(s, i)[0, -1] == WINDOW + 39


def test_retain_everything_changes_nothing(model: Gemma3) -> None:
    """Materialising per-head positions (the evicted code path) must not change outputs."""
    ids = _ids(20, seed=1)
    kv_ref, kv = model.new_kv_cache(), model.new_kv_cache()
    r, s = kv_ref.allocate(), kv.allocate()
    _feed(model, kv_ref, r, ids[:12])
    _feed(model, kv, s, ids[:12])
    heads = model.config.num_kv_heads
    for layer in range(model.config.num_layers):
        n = kv.positions(s, layer).shape[1]
        kv.retain(s, layer, torch.arange(n).expand(heads, n))
    for chunk in (ids[12:17], [ids[17]], [ids[18]], [ids[19]]):
        torch.testing.assert_close(_feed(model, kv, s, chunk), _feed(model, kv_ref, r, chunk))


def test_per_head_eviction_of_out_of_window_keys_is_invisible(model: Gemma3) -> None:
    """Sliding layers may drop anything older than the window, differently per KV head,
    and must keep masking what they still hold that has left the window."""
    ids = _ids(30, seed=2)
    kv_ref, kv = model.new_kv_cache(), model.new_kv_cache()
    r, s = kv_ref.allocate(), kv.allocate()
    _feed(model, kv_ref, r, ids[:20])
    _feed(model, kv, s, ids[:20])
    for layer, sliding in enumerate(model.config.sliding_layers):
        if not sliding:
            continue
        pos = kv.positions(s, layer)[0]
        recent = torch.nonzero(pos > 19 - WINDOW).squeeze(1)  # what the next queries need
        old = torch.nonzero(pos <= 19 - WINDOW).squeeze(1)
        m = len(old) // 2
        # head 0 keeps the even old entries, head 1 the odd ones: same count, other positions
        keep = torch.stack([torch.cat([old[0::2][:m], recent]), torch.cat([old[1::2][:m], recent])])
        kv.retain(s, layer, keep)
        assert not torch.equal(kv.positions(s, layer)[0], kv.positions(s, layer)[1])
    for chunk in (ids[20:23], [ids[23]], ids[24:30]):
        torch.testing.assert_close(_feed(model, kv, s, chunk), _feed(model, kv_ref, r, chunk))


def test_evicting_global_keys_changes_attention_and_accounting(model: Gemma3) -> None:
    ids = _ids(16, seed=4)
    kv_ref, kv = model.new_kv_cache(), model.new_kv_cache()
    r, s = kv_ref.allocate(), kv.allocate()
    _feed(model, kv_ref, r, ids[:12])
    _feed(model, kv, s, ids[:12])
    heads = model.config.num_kv_heads
    keep = torch.tensor([0, 1, 8, 9, 10, 11]).expand(heads, 6)  # StreamingLLM: 2 sinks + 4 recent
    for layer, sliding in enumerate(model.config.sliding_layers):
        if not sliding:
            kv.retain(s, layer, keep)
            assert kv.positions(s, layer)[0].tolist() == [0, 1, 8, 9, 10, 11]
    assert kv.seq_len(s) == 12  # positions are not renumbered
    got = _feed(model, kv, s, ids[12:14])
    want = _feed(model, kv_ref, r, ids[12:14])
    assert not torch.allclose(got, want, atol=1e-3)
    assert kv.num_tokens(s) == 8  # 6 kept + 2 new in the global layers


def test_retain_rejects_bad_indices(model: Gemma3) -> None:
    kv = model.new_kv_cache()
    s = kv.allocate()
    _feed(model, kv, s, _ids(6))
    heads = model.config.num_kv_heads
    with pytest.raises(AssertionError, match="increase"):
        kv.retain(s, 1, torch.tensor([3, 1]).expand(heads, 2))
    with pytest.raises(AssertionError, match="out of range"):
        kv.retain(s, 1, torch.tensor([0, 6]).expand(heads, 2))
    with pytest.raises(AssertionError, match="per KV head"):
        kv.retain(s, 1, torch.tensor([[0, 1]] * (heads + 1)))


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "feed", "free"]), st.integers(1, 9)), max_size=14
    )
)
def test_accounting_invariants_hold_under_random_use(model: Gemma3, ops) -> None:
    kv = model.new_kv_cache()
    expected: dict[int, int] = {}
    for op, n in ops:
        live = sorted(expected)
        if op == "new" or not live:
            expected[kv.allocate(reserve_tokens=n if n % 2 else 0)] = 0
        elif op == "feed":
            s = live[n % len(live)]
            _feed(model, kv, s, _ids(n, seed=n))
            expected[s] += n
        else:
            s = live[n % len(live)]
            kv.free(s)
            del expected[s]
        assert sorted(kv.slots) == sorted(expected)
        for s, length in expected.items():
            assert kv.seq_len(s) == length
            assert kv.num_tokens(s) == length
        assert kv.total_tokens == sum(expected.values())
    for s in list(expected):
        kv.free(s)
    assert kv.total_tokens == 0
    assert kv.total_bytes == 0
