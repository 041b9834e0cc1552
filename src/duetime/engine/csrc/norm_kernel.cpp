// Gemma 3's RMS norms and gated GELU, one op each; why and how: duetime/engine/norm_kernel.py.
#include "common.h"

#include <ATen/ops/empty.h>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

inline float sumsq(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(sumsq(x, n) / float(n) + eps);
}

// y = (x * r) * w
inline void scaled(const float* x, float r, const float* w, float* y, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * r * w[i];
}

// y = x + (h * r) * w
inline void add_scaled(const float* x, const float* h, float r, const float* w, float* y,
                       int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 hw =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + i), rv), _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(x + i), hw));
  }
  for (; i < n; ++i) y[i] = x[i] + h[i] * r * w[i];
}

// Rows per thread hand-off: a decode's one row never leaves the calling thread.
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
}

void check_vec(const at::Tensor& w, int64_t n, const char* op, const char* what) {
  TORCH_CHECK(
      w.scalar_type() == at::kFloat && w.device().is_cpu() && w.is_contiguous() && w.numel() == n,
      op, ": ", what, " must be a contiguous CPU fp32 tensor of ", n, " values, got ", w.sizes(),
      " ", w.scalar_type());
}

at::Tensor rows_of(const at::Tensor& x, const char* op, const char* what) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op, ": ", what,
              " must be a CPU fp32 tensor, got ", x.sizes(), " ", x.scalar_type());
  return x.contiguous();
}

at::Tensor rms(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = rows_of(x_in, "rms", "x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  check_vec(w, n, "rms", "w");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      scaled(xp + r * n, inv_rms(xp + r * n, n, float(eps)), wp, yp + r * n, n);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms(const at::Tensor& x_in, const at::Tensor& h_in,
                                           const at::Tensor& w_post, const at::Tensor& w_next,
                                           double eps) {
  const at::Tensor x = rows_of(x_in, "add_rms", "x"), h = rows_of(h_in, "add_rms", "h");
  TORCH_CHECK(x.sizes() == h.sizes(), "add_rms: x ", x.sizes(), " and h ", h.sizes(),
              " differ in shape");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  check_vec(w_post, n, "add_rms", "w_post");
  check_vec(w_next, n, "add_rms", "w_next");
  at::Tensor x2 = at::empty(x.sizes(), x.options()), y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>();
  const float *pp = w_post.data_ptr<float>(), *np = w_next.data_ptr<float>();
  float *x2p = x2.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * n;
      add_scaled(xp + o, hp + o, inv_rms(hp + o, n, e), pp, x2p + o, n);
      scaled(x2p + o, inv_rms(x2p + o, n, e), np, yp + o, n);
    }
  });
  return {x2, y};
}

// qkv [T, C] (row stride any, unit column stride); its first heads * d columns are the
// query and key heads. w [heads, d]; cos, sin [T, d] (contiguous). Returns [T, heads, d].
at::Tensor qk_rope(const at::Tensor& qkv, int64_t heads, const at::Tensor& w,
                   const at::Tensor& cos_in, const at::Tensor& sin_in, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() &&
                  qkv.stride(1) == 1,
              "qk_rope: qkv must be a CPU fp32 [T, C] tensor with unit column stride, got ",
              qkv.sizes(), " strides ", qkv.strides(), " ", qkv.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.size(0) == heads, "qk_rope: w must be [", heads,
              ", head_dim], got ", w.sizes());
  const int64_t T = qkv.size(0), d = w.size(1), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && heads * d <= qkv.size(1), "qk_rope: ", heads, " heads of ", d,
              " (even) do not fit in rows of ", qkv.size(1));
  check_vec(w, heads * d, "qk_rope", "w");
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  check_vec(cs, T * d, "qk_rope", "cos");
  check_vec(sn, T * d, "qk_rope", "sin");
  at::Tensor y = at::empty({T, heads, d}, qkv.options());
  const float *qp = qkv.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rs = qkv.stride(0);
  const float e = float(eps);
  at::parallel_for(0, T * heads, grain(d), [&](int64_t i0, int64_t i1) {
    std::vector<float> nb(size_t(d), 0.f);
    float* nrm = nb.data();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, hd = i % heads;
      const float* src = qp + t * rs + hd * d;
      scaled(src, inv_rms(src, d, e), wp + hd * d, nrm, d);
      const float *c = cp + t * d, *s = sp + t * d;
      float* out = yp + i * d;
      int64_t j = 0;
      for (; j + 8 <= half; j += 8) {
        const __m256 a = _mm256_loadu_ps(nrm + j), b = _mm256_loadu_ps(nrm + half + j);
        // out[j] = a*cos[j] + (-b)*sin[j]; out[half+j] = b*cos[half+j] + a*sin[half+j]
        _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)),
                                                _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), b),
                                                              _mm256_loadu_ps(s + j))));
        _mm256_storeu_ps(out + half + j,
                         _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + j)),
                                       _mm256_mul_ps(a, _mm256_loadu_ps(s + half + j))));
      }
      for (; j < half; ++j) {
        const float a = nrm[j], b = nrm[half + j];
        out[j] = a * c[j] + (-b) * s[j];
        out[half + j] = b * c[half + j] + a * s[half + j];
      }
    }
  });
  return y;
}

inline float gelu_tanh(float x) {
  const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + std::tanh(y));
}

// gu [T, 2F] (a fused gate/up product) -> gelu_tanh(gate) * up [T, F]. tanh(y) is
// sign(y) (1 - e^(-2|y|)) / (1 + e^(-2|y|)), from one exponential of a non-positive number.
at::Tensor gelu_mul(const at::Tensor& gu) {
  TORCH_CHECK(
      gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
      "gelu_mul: gu must be contiguous fp32 [rows, 2 * features], got ", gu.sizes(), " ",
      gu.scalar_type());
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  at::Tensor y = at::empty({T, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, grain(F), [&](int64_t t0, int64_t t1) {
    const __m256 k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
    const __m256 sign = _mm256_set1_ps(-0.f), m2 = _mm256_set1_ps(-2.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * 2 * F, *u = g + F;
      float* out = yp + t * F;
      int64_t j = 0;
      for (; j + 8 <= F; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 yv =
            _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x));
        const __m256 e = exp_nonpos(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, yv)));
        const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        const __m256 tanh_y = _mm256_or_ps(th, _mm256_and_ps(sign, yv));
        const __m256 gl = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh_y));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(gl, _mm256_loadu_ps(u + j)));
      }
      for (; j < F; ++j) out[j] = gelu_tanh(g[j]) * u[j];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(duetime_norm, m) {
  m.def("rms(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms(Tensor x, Tensor h, Tensor w_post, Tensor w_next, float eps) -> (Tensor, Tensor)");
  m.def("qk_rope(Tensor qkv, int heads, Tensor w, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("gelu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(duetime_norm, CPU, m) {
  m.impl("rms", &rms);
  m.impl("add_rms", &add_rms);
  m.impl("qk_rope", &qk_rope);
  m.impl("gelu_mul", &gelu_mul);
}
