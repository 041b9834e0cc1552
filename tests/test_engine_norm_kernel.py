"""The C++ RMS norms against the torch path, and the engine with and without them.

Skips with a reason when the ops cannot be built here (no compiler / no AVX2).
"""

from __future__ import annotations

import pytest
import torch

from duetime.engine import SeqChunk, norm_kernel
from duetime.engine.norm_kernel import FusedNorms, TorchNorms, make_norms, norm_ops
from duetime.engine.testing import engine_from_hf, tiny_hf_model

needs_kernel = pytest.mark.skipif(norm_ops() is None, reason="norm ops could not be built here")

EPS = 1e-6


def _pair() -> tuple[TorchNorms, FusedNorms]:
    ops = norm_ops()
    assert ops is not None
    return TorchNorms(EPS), FusedNorms(EPS, ops)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# widths with and without the 16- and 8-lane tails; 300 rows go over several threads
@needs_kernel
@pytest.mark.parametrize(("rows", "width"), [(1, 640), (3, 7), (5, 24), (300, 33), (2, 1)])
def test_rms_and_add_rms_equal_torch(rows, width) -> None:
    plain, fused = _pair()
    g = torch.Generator().manual_seed(rows * 100 + width)
    x, h = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    w1, w2 = 1 + torch.randn(width, generator=g), 1 + torch.randn(width, generator=g)
    _close(fused.rms(x, w1), plain.rms(x, w1))
    for got, want in zip(fused.add_rms(x, h, w1, w2), plain.add_rms(x, h, w1, w2), strict=True):
        _close(got, want)
    # leading dimensions are rows too; a non-contiguous input is read as its values
    x3 = torch.randn(2, rows, width, generator=g)
    _close(fused.rms(x3, w1), plain.rms(x3, w1))
    xt = torch.randn(width, rows, generator=g).t()
    _close(fused.rms(xt, w1), plain.rms(xt, w1))


@needs_kernel
@pytest.mark.parametrize(("rows", "features"), [(1, 2048), (3, 7), (300, 24), (2, 1)])
def test_gelu_mul_equals_torch(rows, features) -> None:
    """The fused gated GELU against ``F.gelu(gate, 'tanh') * up``: gates from -60 to 60
    (tanh saturated both ways, and near zero), tails off the 8-lane loop, many rows."""
    plain, fused = _pair()
    g = torch.Generator().manual_seed(rows + features)
    gu = torch.randn(rows, 2 * features, generator=g) * 4
    gu[0, :features] = torch.linspace(-60, 60, features)
    got = fused.gelu_mul(gu)
    assert got.shape == (rows, features)
    _close(got, plain.gelu_mul(gu))
    strided = torch.randn(2 * features, rows, generator=g).t()  # the torch path serves it
    _close(fused.gelu_mul(strided), plain.gelu_mul(strided))


@needs_kernel
def test_gelu_mul_refuses_bad_input_by_name() -> None:
    ops = norm_ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="gelu_mul: gu must be contiguous fp32"):
        ops.gelu_mul(torch.randn(3, 5))  # an odd width has no gate/up halves
    with pytest.raises(RuntimeError, match="gelu_mul"):
        ops.gelu_mul(torch.randn(3, 4, dtype=torch.float64))


@needs_kernel
@pytest.mark.parametrize(
    ("t", "heads", "d", "extra"), [(1, 5, 256, 256), (4, 3, 18, 7), (70, 2, 40, 0)]
)
def test_qk_rope_equals_torch_on_the_front_of_each_qkv_row(t, heads, d, extra) -> None:
    plain, fused = _pair()
    g = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, heads * d + extra, generator=g)  # q and k heads first, then v
    w = 1 + torch.randn(heads, d, generator=g)
    angles = torch.randn(t, 1, d, generator=g)
    cos, sin = angles.cos(), angles.sin()
    got = fused.qk_rope(qkv, heads, w, cos, sin)
    assert got.shape == (t, heads, d)
    assert got.is_contiguous()
    _close(got, plain.qk_rope(qkv, heads, w, cos, sin))
    # a row stride wider than the row (a slice of a larger product) is read in place
    wide = torch.randn(t, heads * d + extra + 5, generator=g)[:, : heads * d + extra]
    _close(fused.qk_rope(wide, heads, w, cos, sin), plain.qk_rope(wide, heads, w, cos, sin))


@needs_kernel
def test_ops_refuse_bad_shapes_and_dtypes_by_name() -> None:
    ops = norm_ops()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="w must be a contiguous CPU fp32 tensor of 8"):
        ops.rms(x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ops.add_rms(x, torch.randn(2, 9), torch.ones(8), torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="x must be a CPU fp32"):
        ops.rms(x.double(), torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.qk_rope(x, 2, torch.ones(2, 6), torch.ones(2, 6), torch.ones(2, 6), EPS)
    with pytest.raises(RuntimeError, match="cos must be"):
        ops.qk_rope(x, 1, torch.ones(1, 8), torch.ones(3, 8), torch.ones(2, 8), EPS)


@needs_kernel
def test_fused_norms_hand_other_dtypes_to_torch() -> None:
    plain, fused = _pair()
    x = torch.randn(3, 16).bfloat16()
    w = 1 + torch.rand(16)
    out = fused.rms(x, w)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, plain.rms(x, w))
    assert not make_norms(EPS, torch.bfloat16).fused
    assert make_norms(EPS, torch.float32).fused
    assert not make_norms(EPS, torch.float32, fused=False).fused


def _greedy(model, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    kv = model.new_kv_cache()
    slots = [kv.allocate() for _ in prompts]
    logits = [model.step([SeqChunk(s, p, 0) for s, p in zip(slots, prompts, strict=True)], kv)]
    picked = []
    for _ in range(steps):
        toks = logits[-1].argmax(-1).tolist()
        picked.append(toks)
        chunks = [SeqChunk(s, [t], kv.seq_len(s)) for s, t in zip(slots, toks, strict=True)]
        logits.append(model.step(chunks, kv))
    return torch.stack(logits), picked


@needs_kernel
@pytest.mark.parametrize("dtype", ["fp32", "q8"])
def test_engine_runs_alike_with_and_without_the_ops(monkeypatch, dtype) -> None:
    hf = tiny_hf_model(seed=2)
    prompts = [[2, *range(10, 50)], [2, 7, 9]]
    fused = engine_from_hf(hf, dtype=dtype)
    assert fused.fused_norms
    # the prompt's attention in fp32: bf16 would round the ops' last-bit differences apart
    fused.prefill_attention_dtype = None
    with_ops = _greedy(fused, prompts, 8)
    monkeypatch.setattr(norm_kernel._EXT, "_state", {"ops": None})  # as with no compiler
    plain = engine_from_hf(hf, dtype=dtype)
    assert not plain.fused_norms
    plain.prefill_attention_dtype = None
    without = _greedy(plain, prompts, 8)
    torch.testing.assert_close(with_ops[0], without[0], atol=1e-4, rtol=1e-4)
    assert with_ops[1] == without[1]


def test_the_switch_turns_the_ops_off_and_on() -> None:
    model = engine_from_hf(tiny_hf_model(seed=3))
    model.fused_norms = False
    assert not model.fused_norms
    model.fused_norms = True
    assert model.fused_norms == (norm_ops() is not None)
