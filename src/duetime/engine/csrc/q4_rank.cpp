// Int4 ranking of the vocabulary (AVX-512 VNNI); why and how: duetime/engine/q4_rank.py.
#include "common.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <cmath>

#define Q4_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int64_t G = 64;  // columns per group: 32 bytes of nibbles

// Output rows n0 .. n1 against M rows of int8 activations. w: [N, ng * 32] nibbles;
// s: [N, ng] fp16 scales; xq: [M, ng * 64] int8; start: [M, ng, 8] int32, each group's
// accumulator start (-8 * its activation sum in lane 0); sx: [M] activation scales.
template <int M>
Q4_TARGET void rows(const uint8_t* w, const uint16_t* s, const int8_t* xq, const int32_t* start,
                    const float* sx, float* y, int64_t N, int64_t ng, int64_t n0, int64_t n1) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t K = ng * G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * ng * 32;
    const uint16_t* sr = s + n * ng;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const __m256i b = _mm256_loadu_si256((const __m256i*)(wr + g * 32));
      const __m256i lo = _mm256_and_si256(b, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
      const __m256 sc = _mm256_set1_ps(_cvtsh_ss(sr[g]));
      for (int m = 0; m < M; ++m) {
        const int8_t* xr = xq + m * K + g * G;
        __m256i d = _mm256_loadu_si256((const __m256i*)(start + (m * ng + g) * 8));
        d = _mm256_dpbusd_epi32(d, lo, _mm256_loadu_si256((const __m256i*)xr));
        d = _mm256_dpbusd_epi32(d, hi, _mm256_loadu_si256((const __m256i*)(xr + 32)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) * sx[m];
  }
}

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// x [M, K] fp32 (K <= ng * 64; missing columns count as zeros); w [N, ng * 32] uint8;
// s [N, ng] fp16.  Returns y [M, N], the int4 product (activations quantised to int8).
at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(supported(), "q4_linear: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "q4_linear: x must be a 2-D fp32 CPU tensor, got ", x_in.sizes());
  TORCH_CHECK(
      w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % 32 == 0,
      "q4_linear: weight must be contiguous uint8 [out, groups * 32], got ", w.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0), ng = w.size(1) / 32;
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kHalf && s.is_contiguous() && s.size(0) == N &&
                  s.size(1) == ng,
              "q4_linear: scales must be contiguous fp16 [", N, ", ", ng, "], got ", s.sizes());
  TORCH_CHECK(K <= ng * G, "q4_linear: x has ", K, " columns, the weight ", ng * G);
  const int64_t Kp = ng * G;
  auto xf = x_in.contiguous();
  auto xq = at::zeros({M, Kp}, xf.options().dtype(at::kChar));
  auto start = at::zeros({M, ng, 8}, xf.options().dtype(at::kInt));
  auto sx = at::empty({M}, xf.options());
  const float* xp = xf.data_ptr<float>();
  int8_t* q = xq.data_ptr<int8_t>();
  int32_t* st = start.data_ptr<int32_t>();
  float* sxp = sx.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float most = 0.f;
    for (int64_t k = 0; k < K; ++k) most = std::max(most, std::abs(xp[m * K + k]));
    const float scale = most > 0.f ? most / 127.f : 1.f;
    sxp[m] = scale;
    for (int64_t k = 0; k < K; ++k) q[m * Kp + k] = (int8_t)std::nearbyint(xp[m * K + k] / scale);
    for (int64_t g = 0; g < ng; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += q[m * Kp + k];
      st[(m * ng + g) * 8] = -8 * sum;
    }
  }
  auto y = at::empty({M, N}, xf.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // at least 1,024 rows (~360 KB of weights) per task: small products stay on one thread
  at::parallel_for(0, N, 1024, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t r = std::min<int64_t>(4, M - m);
      const int8_t* xm = q + m * Kp;
      const int32_t* sm = st + m * ng * 8;
      float* ym = yp + m * N;
      switch (r) {
        case 4: rows<4>(wp, sp, xm, sm, sxp + m, ym, N, ng, n0, n1); break;
        case 3: rows<3>(wp, sp, xm, sm, sxp + m, ym, N, ng, n0, n1); break;
        case 2: rows<2>(wp, sp, xm, sm, sxp + m, ym, N, ng, n0, n1); break;
        default: rows<1>(wp, sp, xm, sm, sxp + m, ym, N, ng, n0, n1); break;
      }
    }
  });
  return y;
}

bool q4_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY(duetime_q4, m) {
  m.def("linear(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("supported() -> bool", &q4_supported);
}

TORCH_LIBRARY_IMPL(duetime_q4, CPU, m) { m.impl("linear", &q4_linear); }
