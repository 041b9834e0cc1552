"""Weight-only int8 GEMV / small GEMM for AVX2, compiled on first use.

Why our own kernel: batch-1 decode is memory-bound (fp32 reads 1.07 GB of
weights per token), so only fewer bytes per weight can speed it up, and this
torch build has no fast weight-only int8 kernel on AVX2
(``torch._weight_int8pack_mm`` measured 5-60x *slower* than fp32 here) while
fbgemm's dynamic int8 quantises activations too (77 % top-1 agreement on the
real model). This kernel keeps activations and accumulation in fp32 and only
stores weights as int8 with one fp32 scale per output row:

    y[m, n] = s[n] · Σ_k W8[n, k] · x[m, k]

Each 8 int8 weights are widened with ``vpmovsxbd`` + ``vcvtdq2ps`` and fed to
FMAs; up to 4 output rows share each load of ``x`` (1-4 rows of ``x`` per tile,
at most 8 accumulators so none spill; more rows reuse the weight block from
L1), and output rows are split across
threads with ``at::parallel_for``. A fixed summation order per row makes the
result independent of the thread count.

The C++ is built on first use by :class:`~duetime.engine.cpp_ext.CppOps`
(g++ and ninja; ``-O3 -mavx2 -mfma -mf16c``; cached per source hash). When the
CPU lacks AVX2 or the build fails (no compiler), :func:`q8_ops` logs one
warning and returns ``None``; callers then keep the fp32 path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from duetime.engine.cpp_ext import CppOps

__all__ = ["Q8Weight", "build_dir", "q8_available", "q8_linear", "q8_ops", "quantize_q8"]

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

namespace {

constexpr int64_t R = 4;  // output rows per block (interleaved in the packed layout)

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// Rows r0 .. r0 + RR of one block of R output rows against M rows of x (stride Kp,
// zero-padded to Kp). w: the block, laid out [Kp / 8][R][8] int8, one sequential
// stream. M * RR accumulators stay in registers (at most 8 of the 16 ymm).
template <int M, int RR>
void tile(const float* x, int64_t Kp, const int8_t* w, int r0, const float* s, float* y,
          int64_t ldy, int64_t nr) {
  __m256 acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 8) {
    const int8_t* wk = w + k * R + 8 * r0;
    _mm_prefetch((const char*)(wk + 1024), _MM_HINT_T0);
    __m256 wv[RR];
    for (int r = 0; r < RR; ++r) wv[r] = load8(wk + 8 * r);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * Kp + k);
      for (int r = 0; r < RR; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR && r0 + r < nr; ++r)
      y[m * ldy + r0 + r] = hsum(acc[m][r]) * s[r0 + r];
}

// One block of R output rows against all M rows of x: 1-2 rows of x take the whole
// block per pass; 3-4 rows take it in two halves (the second from L1), which keeps
// the accumulators in registers instead of spilling 16 of them.
void block(const float* x, int64_t M, int64_t Kp, const int8_t* w, const float* s, float* y,
           int64_t N, int64_t nr) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    tile<4, 2>(x + m * Kp, Kp, w, 0, s, y + m * N, N, nr);
    tile<4, 2>(x + m * Kp, Kp, w, 2, s, y + m * N, N, nr);
  }
  switch (M - m) {
    case 3:
      tile<3, 2>(x + m * Kp, Kp, w, 0, s, y + m * N, N, nr);
      tile<3, 2>(x + m * Kp, Kp, w, 2, s, y + m * N, N, nr);
      break;
    case 2: tile<2, 4>(x + m * Kp, Kp, w, 0, s, y + m * N, N, nr); break;
    case 1: tile<1, 4>(x + m * Kp, Kp, w, 0, s, y + m * N, N, nr); break;
    default: break;
  }
}

// x [M, K] fp32; w packed [ceil(N/4), Kp/8, 4, 8] int8 (Kp = K rounded up to 8, zero
// padded); s [ceil(N/4) * 4] fp32.  Returns y [M, N] = x @ (W8 * s).T.
at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& s,
                     int64_t N) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear: x must be 2-D [rows, in], got ", x_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "q8_linear: CPU tensors only");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.is_contiguous() &&
                  w.size(2) == R && w.size(3) == 8,
              "q8_linear: weight must be packed int8 [blocks, in/8, 4, 8], got ", w.sizes());
  const int64_t blocks = w.size(0), Kp = w.size(1) * 8, K = x_in.size(1);
  TORCH_CHECK(N > (blocks - 1) * R && N <= blocks * R, "q8_linear: ", N,
              " outputs do not fit ", blocks, " blocks of 4");
  TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  s.size(0) == blocks * R,
              "q8_linear: scales must be a contiguous fp32 [", blocks * R, "] tensor");
  TORCH_CHECK(K <= Kp && K > Kp - 8, "q8_linear: x has ", K, " features, weight has ", Kp,
              " (padded)");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  if (K != Kp) x = at::constant_pad_nd(x, {0, Kp - K});
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // >= ~128 KB of weights per task, so small layers stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (R * Kp));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * R;
      block(xp, M, Kp, wp + n * Kp, sp + n, yp + n, N, std::min<int64_t>(R, N - n));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(duetime_q8, m) {
  m.def("linear(Tensor x, Tensor w, Tensor s, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(duetime_q8, CPU, m) {
  m.impl("linear", &q8_linear);
}
"""

_EXT = CppOps("duetime_q8", _SOURCE, what="int8 weight-only kernel", env="DUETIME_Q8", logger=log)


def build_dir() -> Path:
    """Where the compiled kernel lives: one folder per (source, flags, torch version)."""
    return _EXT.build_dir()


def q8_ops() -> Any | None:
    """The compiled ops (``.linear(x, w, s, n)``), or ``None`` once a build has failed.

    The first call compiles (seconds) or loads the cached build; a failure is
    logged once as a warning and remembered for the life of the process.
    ``DUETIME_Q8=0`` disables the kernel (the fp32 fallback path is then used).
    """
    return _EXT.ops()


def q8_available() -> bool:
    """Whether the kernel is built (compiles it on the first call)."""
    return q8_ops() is not None


@dataclass(frozen=True)
class Q8Weight:
    """An int8 weight in the kernel's layout, with one fp32 scale per output row.

    ``packed``: ``[ceil(out/4), in8/8, 4, 8]`` int8 — blocks of 4 output rows
    interleaved 8 columns at a time, so the kernel reads one sequential stream
    per block (``in8``: ``in`` rounded up to 8, zero padded; padded rows are
    zero too). ``scale``: ``[ceil(out/4) * 4]`` fp32.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: int8 weights plus scales."""
        return self.packed.nbytes + self.scale.nbytes

    def int8(self) -> torch.Tensor:
        """The plain ``[out, in]`` int8 matrix (for tests and references; a copy)."""
        blocks, k8 = self.packed.shape[:2]
        plain = self.packed.permute(0, 2, 1, 3).reshape(blocks * 4, k8 * 8)
        return plain[: self.out_features, : self.in_features].contiguous()

    def dequantize(self) -> torch.Tensor:
        """``W8 * scale`` as fp32 ``[out, in]``: the weight the kernel multiplies by."""
        return self.int8().float() * self.scale[: self.out_features, None]


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric per-output-channel int8 in the kernel's packed layout.

    ``scale = max|row| / 127`` and ``W8 = round(W / scale)`` (error ≤ scale/2 per
    entry). Done in row chunks to keep the transient fp32 copy small.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_q8 wants a 2-D [out, in] weight, got {tuple(weight.shape)}")
    w = weight.detach()
    n, k = w.shape
    n4, k8 = -(-n // 4) * 4, -(-k // 8) * 8
    plain = torch.zeros((n4, k8), dtype=torch.int8)
    scale = torch.ones(n4, dtype=torch.float32)
    step = max(4, ((1 << 22) // max(k, 1)) // 4 * 4)
    for a in range(0, n, step):
        rows = w[a : a + step].float()
        s = rows.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        plain[a : a + len(rows), :k] = (
            torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        )
        scale[a : a + len(rows)] = s
    packed = plain.view(n4 // 4, 4, k8 // 8, 8).permute(0, 2, 1, 3).contiguous()
    return Q8Weight(packed, scale, n, k)


def q8_linear(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """``x @ w.dequantize().T`` in fp32 through the kernel (which must be built)."""
    ops = q8_ops()
    if ops is None:
        raise RuntimeError("the int8 kernel is not available (see the warning logged earlier)")
    return ops.linear(x, w.packed, w.scale, w.out_features)
