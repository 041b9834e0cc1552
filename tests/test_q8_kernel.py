"""The weight-only int8 kernel (q8) and oneDNN's int8 product, beside torch.

The q8 tests compare against a float64 torch product with the *same* quantised
weights, so any error beyond fp32 summation rounding is a kernel bug (layout,
tails, padding, threading), not quantisation. They skip with a reason when the
kernel cannot be built here (no compiler / no AVX2); the fallback tests run
either way. The ``q8`` dtype built on the kernel: ``test_engine_q8.py``.
"""

from __future__ import annotations

import pytest
import torch

from duetime.engine.linear import DenseLinear, Q8Linear
from duetime.engine.q8_kernel import q8_available, q8_linear, quantize_q8
from tests.factories import on_threads

needs_kernel = pytest.mark.skipif(
    not q8_available(), reason="int8 kernel could not be built here (no g++/ninja or no AVX2)"
)

# odd sizes on purpose: output rows not a multiple of 4, inputs not a multiple of 8
SHAPES = [(1, 1, 1), (1, 7, 13), (2, 5, 8), (3, 17, 33), (4, 64, 100), (5, 130, 7), (9, 33, 257)]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


def test_quantize_round_trip_is_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 21, generator=g) * torch.rand(37, 1, generator=g) * 3
    w[5] = 0.0  # an all-zero row must not divide by zero
    q = quantize_q8(w)
    w8 = q.int8()
    assert w8.shape == (37, 21)
    assert w8.dtype == torch.int8
    assert int(w8.abs().max()) == 127  # the largest entry of a row maps to ±127
    step = q.scale[:37, None]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(q.dequantize()[5], torch.zeros(21))
    # padding (rows 37..39, columns 21..23) is zero so it adds nothing
    assert q.packed.shape == (10, 3, 4, 8)
    assert int(q.packed.abs().sum()) == int(w8.abs().sum())


def test_quantize_rejects_non_matrices() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_q8(torch.randn(3, 4, 5))


@needs_kernel
@pytest.mark.parametrize(("rows", "out", "inp"), SHAPES)
def test_kernel_matches_torch_on_the_same_int8_weights(rows: int, out: int, inp: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out + inp)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(rows, inp, generator=g) * 4
    q = quantize_q8(w)
    got = q8_linear(x, q)
    ref = _reference(x, q.dequantize())
    assert got.shape == (rows, out)
    assert got.dtype == torch.float32
    # fp32 accumulation over `inp` terms: relative error ~ sqrt(inp) * 6e-8
    tol = 1e-5 * float(ref.abs().max()) + 1e-6
    assert float((got - ref).abs().max()) < tol


@needs_kernel
def test_kernel_takes_non_contiguous_and_bf16_inputs() -> None:
    g = torch.Generator().manual_seed(3)
    q = quantize_q8(torch.randn(11, 24, generator=g))
    x = torch.randn(24, 3, generator=g).T  # non-contiguous [3, 24]
    ref = _reference(x, q.dequantize())
    torch.testing.assert_close(q8_linear(x, q), ref, atol=1e-5, rtol=1e-5)
    got = q8_linear(x.bfloat16(), q)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x.bfloat16().float(), q.dequantize()))


@needs_kernel
def test_kernel_result_does_not_depend_on_thread_count() -> None:
    g = torch.Generator().manual_seed(4)
    q = quantize_q8(torch.randn(1030, 640, generator=g))  # several parallel tasks
    x = torch.randn(3, 640, generator=g)
    product = lambda: q8_linear(x, q)  # noqa: E731
    assert torch.equal(on_threads(1, product), on_threads(2, product))


@needs_kernel
def test_kernel_rejects_mismatched_inputs() -> None:
    q = quantize_q8(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="features"):
        q8_linear(torch.randn(1, 24), q)
    with pytest.raises(RuntimeError, match="2-D"):
        q8_linear(torch.randn(16), q)


@needs_kernel
def test_q8_linear_uses_the_kernel_for_few_rows_and_the_fallback_for_more() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g)
    fallback = DenseLinear(w, torch.float32)
    lin = Q8Linear(w, fallback, max_rows=2)
    deq = lin.q.dequantize()
    few, many = torch.randn(2, 24, generator=g), torch.randn(3, 24, generator=g)
    torch.testing.assert_close(lin(few), _reference(few, deq), atol=1e-5, rtol=1e-5)
    assert torch.equal(lin(many), fallback(many))  # exactly the fp32 path
    assert not torch.allclose(lin(few), fallback(few), atol=1e-6)  # really int8
    assert lin.bytes_read(2) == lin.q.nbytes < lin.bytes_read(3) == fallback.nbytes


@needs_kernel
def test_onednn_int8_product_is_close_to_fp32() -> None:
    """Per-row scaled u8 activations, per-channel int8 weight: within int8 rounding of
    the fp32 product, an outlier row (100x larger) included."""
    from duetime.engine.onednn_int8 import OneDnnInt8Linear, onednn_int8_available

    if not onednn_int8_available():
        pytest.skip("oneDNN's int8 linear needs AMX tiles or VNNI here")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 64, generator=g)
    x = torch.randn(16, 64, generator=g)
    x[0] *= 100.0
    ref = x @ w.T
    got = OneDnnInt8Linear(w)(x)
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert got.dtype == torch.float32
    assert got.shape == (16, 512)
    assert rel.max() < 0.03
