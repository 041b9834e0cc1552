"""Decode attention straight from each sequence's own KV tensors (C++, built on first use).

Why: with per-sequence KV tensors (kv_cache.py), one batched SDPA call for B
decodes needs every sequence's keys and values copied into one zero-padded
``[B, kv_heads, S_max, head_dim]`` pair first. At 16 sequences that copy and
fill were ~10 ms of an ~80 ms decode step on Gemma 3 270M (80 MB moved per
step), more than the attention itself. This op reads each sequence's keys and
values where they lie (any row stride, unit stride along ``head_dim``), once:

    p[r, j] = softmax_j(scale · q_r · k_j),   out_r = Σ_j p[r, j] · v_j

for the ``rep = heads / kv_heads`` query heads ``r`` that share a KV head,
in fp32 with the usual max-subtraction; (sequence, KV head) pairs are spread
over threads with ``at::parallel_for``. Only unmasked single-token decodes
(every stored key visible) come here; anything else keeps SDPA.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from duetime.engine.cpp_ext import CppOps

__all__ = ["decode_attention", "decode_attention_ops"]

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/ops/empty.h>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

void check_kv(const at::Tensor& t, int64_t g, int64_t d, const char* what, size_t b) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              "decode_attention: ", what, "[", b, "] must be a CPU fp32 [kv_heads, S, head_dim]",
              " tensor, got ", t.sizes(), " ", t.scalar_type());
  TORCH_CHECK(t.size(0) == g && t.size(2) == d && t.size(1) >= 1 && t.stride(2) == 1,
              "decode_attention: ", what, "[", b, "] has shape ", t.sizes(), " strides ",
              t.strides(), "; want [", g, ", S >= 1, ", d, "] with unit stride on head_dim");
}

// q [B, H, D] fp32; keys[b], values[b] [G, S_b, D]. Returns [B, H * D].
at::Tensor decode_attention(const at::Tensor& q_in, at::TensorList keys, at::TensorList values,
                            double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat && q_in.device().is_cpu(),
              "decode_attention: q must be a CPU fp32 [batch, heads, head_dim] tensor, got ",
              q_in.sizes(), " ", q_in.scalar_type());
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(int64_t(keys.size()) == B && int64_t(values.size()) == B,
              "decode_attention: ", B, " queries but ", keys.size(), " keys and ", values.size(),
              " values");
  TORCH_CHECK(B >= 1, "decode_attention: empty batch");
  const int64_t G = keys[0].size(0);
  TORCH_CHECK(G >= 1 && H % G == 0, "decode_attention: ", H, " heads do not group into ", G,
              " KV heads");
  for (size_t b = 0; b < size_t(B); ++b) {
    check_kv(keys[b], G, D, "keys", b);
    check_kv(values[b], G, D, "values", b);
    TORCH_CHECK(keys[b].size(1) == values[b].size(1), "decode_attention: sequence ", b, " has ",
                keys[b].size(1), " keys but ", values[b].size(1), " values");
  }
  const int64_t rep = H / G;
  at::Tensor y = at::empty({B, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float sc = float(scale);
  at::parallel_for(0, B * G, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / G, g = t % G;
      const at::Tensor& K = keys[b];
      const at::Tensor& V = values[b];
      const int64_t S = K.size(1);
      const float* kp = K.data_ptr<float>() + g * K.stride(0);
      const float* vp = V.data_ptr<float>() + g * V.stride(0);
      const int64_t ks = K.stride(1), vs = V.stride(1);
      p.resize(size_t(rep * S));
      for (int64_t r = 0; r < rep; ++r) {
        const float* qr = qp + (b * H + g * rep + r) * D;
        float* pr = p.data() + r * S;
        float mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          pr[j] = dot(qr, kp + j * ks, D) * sc;
          mx = std::max(mx, pr[j]);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < S; ++j) {
          pr[j] = std::exp(pr[j] - mx);
          sum += pr[j];
        }
        const float inv = 1.f / sum;
        float* out = yp + (b * H + g * rep + r) * D;
        std::fill(out, out + D, 0.f);
        for (int64_t j = 0; j < S; ++j) axpy(pr[j] * inv, vp + j * vs, out, D);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(duetime_attn, m) {
  m.def("decode(Tensor q, Tensor[] keys, Tensor[] values, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(duetime_attn, CPU, m) {
  m.impl("decode", &decode_attention);
}
"""

_EXT = CppOps(
    "duetime_attn", _SOURCE, what="decode attention kernel", env="DUETIME_ATTN", logger=log
)


def decode_attention_ops() -> Any | None:
    """The compiled op, or ``None`` (no compiler / no AVX2 / ``DUETIME_ATTN=0``)."""
    return _EXT.ops()


def decode_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """``[B, heads * head_dim]`` attention of one query per sequence over its own keys.

    ``q``: ``[B, heads, head_dim]`` fp32; ``keys[i]`` / ``values[i]``:
    ``[kv_heads, S_i, head_dim]`` fp32 views (unit stride on ``head_dim``).
    The op must be built (:func:`decode_attention_ops` not ``None``).
    """
    ops = decode_attention_ops()
    if ops is None:
        raise RuntimeError("the decode attention kernel is not available (see the warning)")
    return ops.decode(q, list(keys), list(values), scale)
