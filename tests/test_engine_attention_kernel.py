"""The C++ decode attention against SDPA, and the engine with and without it.

Skips with a reason when the op cannot be built here (no compiler / no AVX2).
"""

from __future__ import annotations

import pytest
import torch

from duetime.engine import SeqChunk, attention_kernel
from duetime.engine.attention import attend
from duetime.engine.attention_kernel import decode_attention, decode_attention_ops
from duetime.engine.kv_cache import KVView
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from tests.factories import on_threads

needs_kernel = pytest.mark.skipif(
    decode_attention_ops() is None, reason="decode attention op could not be built here"
)


def _views(g: torch.Generator, lengths: list[int], kvh: int, hd: int) -> list[KVView]:
    out = []
    for n in lengths:
        # keys and values as the cache holds them: slices of a larger [2, kvh, cap, hd] buffer
        buf = torch.randn(2, kvh, n + 7, hd, generator=g)
        out.append(KVView(buf[0, :, 3 : 3 + n], buf[1, :, 3 : 3 + n], 0, None, needs_mask=False))
    return out


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "kvh", "hd"),
    [
        ([1], 4, 1, 256),
        ([5, 1, 33], 4, 1, 16),
        ([7, 70], 8, 2, 13),
        ([300] * 3, 2, 2, 24),
        ([129, 257], 6, 1, 40),  # heads in groups of 4 and 2; keys past a 128-key block
        ([9, 140], 3, 1, 72),  # a group of 3; columns past the register passes
    ],
)
def test_kernel_equals_sdpa_per_sequence(lengths, heads, kvh, hd) -> None:
    g = torch.Generator().manual_seed(len(lengths) + hd)
    views = _views(g, lengths, kvh, hd)
    q = torch.randn(len(lengths), heads, hd, generator=g)
    got = decode_attention(q, [v.keys for v in views], [v.values for v in views], 0.3)
    want = torch.cat([attend(q[i : i + 1], v, None, 0.3) for i, v in enumerate(views)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "kvh", "hd"),
    [([700], 4, 1, 256), ([1000], 6, 2, 40), ([257, 3], 2, 1, 16), ([513], 1, 1, 8)],
)
def test_keys_split_over_threads_merge_to_the_same_attention(lengths, heads, kvh, hd) -> None:
    """With fewer (sequence, KV head) pairs than threads, a pair's keys go in pieces over
    the threads and the pieces merge by their maxima (up to 4 pieces here)."""
    g = torch.Generator().manual_seed(sum(lengths) + hd)
    views = _views(g, lengths, kvh, hd)
    q = torch.randn(len(lengths), heads, hd, generator=g) * 3  # peaked: the maxima matter
    keys, values = [v.keys for v in views], [v.values for v in views]
    got = on_threads(4, lambda: decode_attention(q, keys, values, 0.3))
    want = torch.cat([attend(q[i : i + 1], v, None, 0.3) for i, v in enumerate(views)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "hd"), [([1, 40], 4, 256), ([700], 4, 256), ([9, 140], 3, 72)]
)
def test_bf16_keys_and_values_attend_as_their_fp32_widening(lengths, heads, hd) -> None:
    """A bf16 cache (q8 where the CPU computes bf16): the kernel widens each key and
    value as it reads them, so it equals fp32 attention over the widened cache."""
    g = torch.Generator().manual_seed(hd + len(lengths))
    views = _views(g, lengths, 1, hd)
    keys = [v.keys.bfloat16() for v in views]
    values = [v.values.bfloat16() for v in views]
    q = torch.randn(len(lengths), heads, hd, generator=g)
    got = on_threads(2, lambda: decode_attention(q, keys, values, 0.3))
    want = decode_attention(q, [k.float() for k in keys], [v.float() for v in values], 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_kernel_rejects_mismatched_inputs_with_a_clear_error() -> None:
    q = torch.randn(2, 4, 8)
    k = [torch.randn(1, 3, 8), torch.randn(1, 4, 8)]
    with pytest.raises(RuntimeError, match="2 queries but 1 keys"):
        decode_attention(q, k[:1], k[:1], 1.0)
    with pytest.raises(RuntimeError, match="3 keys but 4 values"):
        decode_attention(q, k, [k[1], k[1]], 1.0)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        decode_attention(q, [t.double() for t in k], k, 1.0)
    with pytest.raises(RuntimeError, match=r"values\[0\] must be a CPU BFloat16"):
        decode_attention(q, [t.bfloat16() for t in k], k, 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_buffers_attend_as_views_of_them_bit_for_bit(dtype) -> None:
    """``decode_bufs`` (the decode loop's form: each sequence's whole [2, G, cap, D] buffer
    and the entries to attend) reads the same keys and values as views cut from it."""
    g = torch.Generator().manual_seed(5)
    spans = [(0, 0), (3, 40), (0, 299), (17, 130)]  # entries lo .. at, inclusive
    bufs = [torch.randn(2, 2, 300, 40, generator=g).to(dtype) for _ in spans]
    q = torch.randn(len(spans), 6, 40, generator=g)
    keys = [b[0, :, lo : at + 1] for b, (lo, at) in zip(bufs, spans, strict=True)]
    values = [b[1, :, lo : at + 1] for b, (lo, at) in zip(bufs, spans, strict=True)]
    lo, at = [s[0] for s in spans], [s[1] for s in spans]
    ops = decode_attention_ops()
    got = on_threads(2, lambda: ops.decode_bufs(q, bufs, lo, at, 0.3))
    want = on_threads(2, lambda: decode_attention(q, keys, values, 0.3))
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"attends to entries 5 \.\. 300 of 300"):
        ops.decode_bufs(q[:1], bufs[:1], [5], [300], 0.3)
    with pytest.raises(RuntimeError, match="4 queries need as many"):
        ops.decode_bufs(q, bufs[:3], lo[:3], at[:3], 0.3)
    with pytest.raises(RuntimeError, match=r"bufs\[1\] must be a contiguous"):
        ops.decode_bufs(q[:2], [bufs[0], bufs[1][:, :, ::2]], lo[:2], [0, 3], 0.3)


def _decode_logits(model, prompts: list[list[int]], steps: int) -> torch.Tensor:
    kv = model.new_kv_cache()
    slots = [kv.allocate() for _ in prompts]
    model.step([SeqChunk(s, p, 0) for s, p in zip(slots, prompts, strict=True)], kv)
    rows = []
    for i in range(steps):
        chunks = [SeqChunk(s, [3 + i], kv.seq_len(s)) for s in slots]
        rows.append(model.step(chunks, kv))
    return torch.stack(rows)


@needs_kernel
def test_engine_decodes_equal_with_and_without_the_kernel(monkeypatch) -> None:
    hf = tiny_hf_model(seed=1)
    model = engine_from_hf(hf)
    prompts = [[2, 5, 9], [2, *range(10, 40)], [2, 7]]  # different lengths: padding path
    assert model.decode_kernel
    with_kernel = _decode_logits(model, prompts, 6)
    monkeypatch.setattr(attention_kernel._EXT, "_state", {"ops": None})  # as with no compiler
    assert decode_attention_ops() is None
    plain = engine_from_hf(hf)
    assert not plain.decode_kernel
    without = _decode_logits(plain, prompts, 6)
    torch.testing.assert_close(with_kernel, without, atol=1e-4, rtol=1e-4)
