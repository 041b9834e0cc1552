"""Matrix-multiply back-ends for the model's linear layers: dense (fp32/bf16) or int8.

Why int8 at all: decode at small batch is memory-bound, and the tied
262,144 × 640 output layer is most of the bytes. On this AVX2 machine (no
AVX-512/AMX, so no native bf16 GEMM) fbgemm's dynamic-int8 GEMM reads a
quarter of the fp32 bytes and was 2-15x faster than bf16 in our measurements
(see docs/engine.md). It quantizes the weight per output channel once and the
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
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["DenseLinear", "Int8Linear", "Linear", "int8_available"]


class Linear(Protocol):
    """``y = x @ W.T``; input and output dtype are the back-end's ``dtype``."""

    dtype: torch.dtype
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """Plain ``F.linear`` with the weight kept in the compute dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.dtype = dtype
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def int8_available() -> bool:
    """Whether this torch build has the fbgemm/x86 dynamic-int8 linear kernels."""
    return "x86" in torch.backends.quantized.supported_engines or (
        "fbgemm" in torch.backends.quantized.supported_engines
    )


class Int8Linear:
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        row_max = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        return torch.ops.quantized.linear_dynamic(x / row_max, self._packed, True) * row_max
