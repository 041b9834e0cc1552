"""Gemma 3's RMS norms and gated GELU in one C++ op each (fp32, built on first use).

Why: a Gemma 3 layer normalises five times (input, q/k per head, after
attention, before and after the MLP), and in torch each norm is eight small ops
(cast, square, mean, add, rsqrt, two products, cast) at ~1.5 µs of dispatch
apiece. At batch 1 that came to ~1.2 ms of a ~10.5 ms decode step on Gemma 3
270M (18 layers), with the q/k norm and RoPE alone 22 µs a layer; the products
themselves already run at the memory roofline. Three ops do the same work in one
pass over each row:

* ``rms(x, w)``: ``x · rsqrt(mean(x²) + eps) · w`` per row (``w`` is ``1 + weight``);
* ``add_rms(x, h, w_post, w_next)``: the residual step ``x' = x + rms(h, w_post)``
  and the next norm ``rms(x', w_next)``, both returned;
* ``qk_rope(qkv, w, cos, sin)``: the per-head norm of the query and key heads
  at the front of each row of the fused q/k/v product, then rotary embedding
  (``n · cos + rotate_half(n) · sin``), into a fresh ``[T, heads, head_dim]``;
* ``gelu_mul(gu)``: ``gelu_tanh(gate) · up`` of the fused gate/up product in one
  pass, tanh from one exponential (Cephes' polynomial, ~1e-7 relative): ATen's
  tanh GELU took 0.74 ms for a 320 × 2048 gate and the product 2.25 ms with
  the multiply, against 0.12 ms for ``tanh`` alone (2 threads).

The arithmetic is torch's, in the same order (sum of squares over the row, then
``/ n``, ``+ eps``, one reciprocal square root, ``(x · r) · w``); only the sum's
association differs, so results agree with the torch path to float rounding.
Rows are spread over threads (``at::parallel_for``) only where there are many (a
prefill), since a decode row is far below a thread hand-off's cost.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from duetime.engine.cpp_ext import CppOps

__all__ = ["FusedNorms", "TorchNorms", "make_norms", "norm_ops"]

log = logging.getLogger(__name__)

_F32 = torch.float32


_EXT = CppOps(
    "duetime_norm", "norm_kernel.cpp", what="fused norm kernel", env="DUETIME_NORM", logger=log
)


def norm_ops() -> Any | None:
    """The compiled ops, or ``None`` (no compiler / no AVX2 / ``DUETIME_NORM=0``)."""
    return _EXT.ops()


class TorchNorms:
    """The norms in plain torch: any dtype (norm arithmetic in fp32, as transformers)."""

    fused = False

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * w).to(x.dtype)

    def add_rms(
        self, x: torch.Tensor, h: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.rms(h, w_post)
        return x, self.rms(x, w_next)

    def qk_rope(
        self, qkv: torch.Tensor, heads: int, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        d = w.shape[-1]
        qk = self.rms(qkv[:, : heads * d].view(qkv.shape[0], heads, d), w)
        half = d // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return qk * cos + rotated * sin

    def gelu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """Gemma's gated feed-forward activation: ``gelu_tanh(gate) * up`` of a fused
        ``[rows, 2F]`` gate/up product."""
        gate, up = gu.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class FusedNorms(TorchNorms):
    """The same norms through the C++ ops (fp32 tensors only)."""

    fused = True

    def __init__(self, eps: float, ops: Any) -> None:
        super().__init__(eps)
        self._ops = ops

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype is not _F32:
            return super().rms(x, w)
        return self._ops.rms(x, w, self.eps)

    def add_rms(
        self, x: torch.Tensor, h: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype is not _F32 or h.dtype is not _F32:
            return super().add_rms(x, h, w_post, w_next)
        x2, y = self._ops.add_rms(x, h, w_post, w_next, self.eps)
        return x2, y

    def qk_rope(
        self, qkv: torch.Tensor, heads: int, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        if qkv.dtype is not _F32 or cos.dtype is not _F32:
            return super().qk_rope(qkv, heads, w, cos, sin)
        t, d = qkv.shape[0], w.shape[-1]
        return self._ops.qk_rope(qkv, heads, w, cos.reshape(t, d), sin.reshape(t, d), self.eps)

    def gelu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if gu.dtype is not _F32 or not gu.is_contiguous():
            return super().gelu_mul(gu)
        return self._ops.gelu_mul(gu)


def make_norms(eps: float, dtype: torch.dtype, *, fused: bool = True) -> TorchNorms:
    """The fused ops where the model computes in fp32 and they build, else plain torch."""
    ops = norm_ops() if fused and dtype == torch.float32 else None
    return TorchNorms(eps) if ops is None else FusedNorms(eps, ops)
