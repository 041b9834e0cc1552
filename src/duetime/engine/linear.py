"""Matrix-multiply back-ends for the model's linear layers: dense (fp32/bf16) or int8.

Why int8 at all: decode at small batch is memory-bound, and the tied
262,144 × 640 output layer is most of the bytes. On this AVX2 machine (no
AVX-512/AMX, so no native bf16 GEMM) fbgemm's dynamic-int8 GEMM reads a
quarter of the fp32 bytes and was 2-15x faster than bf16 in our measurements
(see docs/engine-kernels.md). It quantizes the weight per output channel once and the
activation per call.

fbgemm scales the activation per *tensor*; with many rows that lets one
outlier token (Gemma's BOS row is ~100x larger than the rest) crush every other
row to a few levels. Each row is therefore divided by its own max first and
the output row multiplied back — exact algebra (``W(x/s)·s = Wx``) that turns
the per-tensor scale into a per-token one for two cheap elementwise ops. On the
real model it raised top-1 agreement with fp32 (teacher-forced text, output
layer only) from 84 % to 91 %; bf16 gets 96 %.

``reduce_range=True`` keeps activations to 7 bits: AVX2's ``vpmaddubsw`` adds
two u8×s8 products into a saturating int16, and 255·128·2 would overflow.

Which fp32 kernel per shape (measured on this 2-core AVX2 machine, interleaved,
medians; the tables are in git history of docs/engine.md): MKL's ``F.linear`` repacks the weight
on every call, which at 2-64 rows costs more than the product itself, while
oneDNN's ``_linear_pointwise`` on a weight reordered once at load
(:class:`PackedLinear`) does not: 1.3-2x faster for the 72 layer matmuls at
4-64 rows and 1.2-2.5x for the 262k-row output layer, equal at 1 and 512 rows.
A single row stays on ``F.linear`` when a plain copy exists anyway (the tied
output layer shares the embedding table): MKL's GEMV there needs no thread
barrier, which matters when another process holds one of the two cores.

Weight-only int8 (:class:`Q8Linear`, our AVX2 kernel in ``q8_kernel.py``) keeps
activations and accumulation in fp32 and reads a quarter of the fp32 bytes;
it serves the few-row products of decode steps, while steps with more rows
(prefill, large batches), which are compute-bound, stay on the fp32 path, or
go to bf16 (:class:`Bf16Linear`) where the CPU computes bf16 natively.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812

from duetime.engine.q8_kernel import Q8Weight, q8_available, q8_linear, quantize_q8

__all__ = [
    "Q8_HEAD_MAX_ROWS",
    "Q8_MAX_ROWS",
    "Bf16Linear",
    "ByRows",
    "DenseLinear",
    "Int8Linear",
    "Linear",
    "PackedLinear",
    "Q8Linear",
    "int8_available",
    "packed_available",
    "q8_or",
    "ranking",
    "row_scaled",
    "weight_bytes_read",
]


class Linear(Protocol):
    """``y = x @ W.T``; input and output dtype are the back-end's ``dtype``."""

    dtype: torch.dtype
    out_features: int
    nbytes: int
    """Weight bytes one call reads (for memory rooflines)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """Plain ``F.linear`` with the weight kept in the compute dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.dtype = dtype
        self.out_features = weight.shape[0]
        self.nbytes = self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def packed_available() -> bool:
    """Whether this torch build has oneDNN's packed-weight linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# oneDNN chooses the blocked layout from an expected row count; 16 (a decode
# batch) measured as good as 1 or 128 for every row count we run.
_PACK_HINT_ROWS = 16


class Bf16Linear:
    """fp32 in and out; the product in bfloat16 on a copy of the weight cast once.

    For ``q8``'s steps of more than :data:`Q8_MAX_ROWS` rows (prefill chunks, large
    decode batches) on a CPU that computes bfloat16 natively (AVX512-BF16): there a
    bf16 product took about half the time of :class:`PackedLinear`'s fp32 one for
    Gemma's layer shapes at 64 and 512 rows (0.71 vs 1.36 ms for 512 × 640 → 1024), and
    the copy is half the fp32 bytes. The activations are rounded to bf16 going in and
    the outputs coming out, as a bf16 model computes them; the residual stream, norms
    and the attention's arithmetic stay fp32 (the KV cache is bf16 beside these rows).
    Elsewhere torch emulates bf16, several times slower than fp32: keep
    :class:`PackedLinear` there.

    The weight is reordered once for oneDNN where torch has its packed linear (as
    :class:`PackedLinear` does for fp32): Gemma's four layer products at 64 rows took
    0.95 ms a layer packed against 1.65 ms through ``F.linear``, which reorders the
    weight on every call.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        bf16 = weight.detach().to(torch.bfloat16).contiguous()
        self.nbytes = bf16.nbytes
        # the packed copy is the only one kept: no extra memory
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(bf16, _PACK_HINT_ROWS)
            if packed_available()
            else None
        )
        self.weight = bf16 if self.packed is None else None
        self.dtype = torch.float32
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.packed is None:
            assert self.weight is not None
            return F.linear(xb, self.weight).float()
        return torch.ops.mkldnn._linear_pointwise(
            xb.contiguous(), self.packed, None, "none", [], ""
        ).float()


class PackedLinear:
    """fp32 linear on a weight reordered once for oneDNN (no per-call repacking).

    ``plain``: an fp32 ``[out, in]`` tensor that is kept anyway (the tied output
    layer's embedding table); single-row calls then use ``F.linear`` on it. The
    packed copy is the only copy of a layer weight, so it costs no extra memory.
    Results equal ``F.linear``'s to fp32 rounding (different summation order).
    """

    def __init__(self, weight: torch.Tensor, *, plain: torch.Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
        self.plain = plain
        self.dtype = torch.float32
        self.out_features = w.shape[0]
        self.nbytes = w.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.shape[0] == 1:
            return F.linear(x, self.plain)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, None, "none", [], ""
        )


def int8_available() -> bool:
    """Whether this torch build has the fbgemm/x86 dynamic-int8 linear kernels."""
    return "x86" in torch.backends.quantized.supported_engines or (
        "fbgemm" in torch.backends.quantized.supported_engines
    )


class RowScaledInt8:
    """An int8 product of per-row scaled activations. A subclass gives its kernel,
    ``_product(x, row_max)``: the answer rescales it per row (in place), the ranking
    (:func:`ranking`) does not. Int8Linear (fbgemm) and OneDnnInt8Linear share this.
    """

    def _product(self, x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, row_max = row_scaled(x)
        # in place: a fresh [rows, vocab] product would page-fault its 1 MiB a row again
        return self._product(x, row_max).mul_(row_max)

    def ranking(self, x: torch.Tensor) -> torch.Tensor:
        """The product with each row divided by its activation's scale (see :func:`ranking`)."""
        return self._product(*row_scaled(x))


class Int8Linear(RowScaledInt8):
    """Dynamic int8 linear: int8 per-channel weight, fp32 in and out."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        amax = w.abs().amax(dim=1).clamp_min(1e-8)
        scales = (amax / 127.0).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():
            # quantize_per_channel is flagged deprecated in torch 2.13 but is still the
            # only way to build the packed fbgemm weight; linear.py is its one user.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.dtype = torch.float32
        self.out_features = w.shape[0]
        self.nbytes = w.numel() + 4 * w.shape[0]  # int8 weight + one scale per row

    def _product(self, x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x / row_max, self._packed, True)


def ranking(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` up to a positive factor per row, for a caller that only ranks each row's
    values (an output layer's arg-max or top-k): an int8 product then skips multiplying
    its activation's scale back into every output (a 96-row step of the 262,144-column
    output layer spent 3.7 ms of ~150 there)."""
    fn = getattr(lin, "ranking", None)
    return fn(x) if fn is not None else lin(x)


def row_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp32 and each row's largest magnitude (``[rows, 1]``, at least 1e-12):
    the per-token scale an int8 GEMM's activations are divided by (see the module)."""
    x = x.float()
    return x, x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)


# Rows up to which Q8Linear uses the int8 kernel. Interleaved microbenchmarks on
# this 2-core machine (docs/engine-kernels.md) had the kernel ahead of packed fp32 up to
# 16 rows for the layer matmuls; beyond a few rows the product turns compute-bound
# (int8 → fp32 widening costs as much as the FMA), so the margin shrinks with rows.
Q8_MAX_ROWS = 8
# Rows up to which the output layer's ranking product uses the int8 kernel; from 3 rows
# fbgemm's int8 GEMM (activations quantised too, VNNI where the CPU has it) is faster on
# its 262,144 x 640 weight: Gemma 3 270M, 2 threads, ms per product,
# kernel / fbgemm: 1 row 4.1 / 5.0, 2 rows 4.3 / 5.7, 3 rows 6.3 / 5.4, 4 rows 8.3 / 5.6,
# 8 rows 16.8 / 7.0. (Ranking only: the top candidates are re-scored in fp32.)
Q8_HEAD_MAX_ROWS = 2


class Q8Linear:
    """Weight-only int8 (per-output-channel scales) for ≤ ``max_rows`` rows.

    Single-row and few-row products (decode steps) go through the AVX2 kernel:
    int8 weights widened to fp32 in registers, fp32 activations and
    accumulation, ``y = s ⊙ (W8 x)``; nothing is dequantised to memory. More rows
    (prefill chunks, large decode batches) use ``fallback`` — the weight in its
    existing fp32 (or fbgemm) form, or a bf16 copy where the CPU computes bf16
    natively — where the product is compute-bound. Build with :func:`q8_or` so a missing kernel
    degrades to ``fallback`` alone.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        fallback: Linear,
        max_rows: int = Q8_MAX_ROWS,
        *,
        quantize: Callable[[torch.Tensor], Q8Weight] = quantize_q8,
    ) -> None:
        self.q = quantize(weight)
        self.fallback = fallback
        self.max_rows = max_rows
        self.dtype = torch.float32
        self.out_features = self.q.out_features
        self.nbytes = self.q.nbytes

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a product over ``rows`` rows reads (for rooflines)."""
        return self.q.nbytes if rows <= self.max_rows else weight_bytes_read(self.fallback, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return q8_linear(x, self.q)
        return self.fallback(x)

    def ranking(self, x: torch.Tensor) -> torch.Tensor:
        """See :func:`ranking`."""
        if x.shape[0] <= self.max_rows:
            return q8_linear(x, self.q)
        return ranking(self.fallback, x)


def q8_or(
    weight: torch.Tensor,
    fallback: Linear,
    max_rows: int = Q8_MAX_ROWS,
    *,
    quantize: Callable[[torch.Tensor], Q8Weight] = quantize_q8,
) -> Linear:
    """A :class:`Q8Linear` when the kernel builds, else ``fallback`` (warned once).

    ``quantize``: how to get the int8 weight (``load_model`` passes a cached one).
    """
    if not q8_available():
        return fallback
    return Q8Linear(weight, fallback, max_rows, quantize=quantize)


class ByRows:
    """``few`` for products of at most ``max_rows`` rows, ``many`` beyond: two back-ends
    of one weight, each where it measured faster (:func:`~duetime.engine.onednn_int8.int8_rank`)."""

    def __init__(self, few: Linear, many: Linear, max_rows: int) -> None:
        self.few, self.many, self.max_rows = few, many, max_rows
        self.dtype = few.dtype
        self.out_features = few.out_features
        self.nbytes = few.nbytes + many.nbytes

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a product over ``rows`` rows reads (for rooflines)."""
        return weight_bytes_read(self.few if rows <= self.max_rows else self.many, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.few(x) if x.shape[0] <= self.max_rows else self.many(x)

    def ranking(self, x: torch.Tensor) -> torch.Tensor:
        """See :func:`ranking`."""
        return ranking(self.few if x.shape[0] <= self.max_rows else self.many, x)


def weight_bytes_read(lin: Linear, rows: int) -> int:
    """Weight bytes a product of ``lin`` over ``rows`` rows reads (its ``bytes_read`` where it
    has one, else all its bytes)."""
    fn = getattr(lin, "bytes_read", None)
    return int(fn(rows)) if fn is not None else lin.nbytes
