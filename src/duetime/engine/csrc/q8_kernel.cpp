// Weight-only int8 GEMV / small GEMM (AVX2); why and how: duetime/engine/q8_kernel.py.
#include "common.h"

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
    for (int r = 0; r < RR && r0 + r < nr; ++r) y[m * ldy + r0 + r] = hsum(acc[m][r]) * s[r0 + r];
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
at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& s, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear: x must be 2-D [rows, in], got ", x_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "q8_linear: CPU tensors only");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == R &&
                  w.size(3) == 8,
              "q8_linear: weight must be packed int8 [blocks, in/8, 4, 8], got ", w.sizes());
  const int64_t blocks = w.size(0), Kp = w.size(1) * 8, K = x_in.size(1);
  TORCH_CHECK(N > (blocks - 1) * R && N <= blocks * R, "q8_linear: ", N, " outputs do not fit ",
              blocks, " blocks of 4");
  TORCH_CHECK(
      s.dim() == 1 && s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(0) == blocks * R,
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

TORCH_LIBRARY(duetime_q8, m) { m.def("linear(Tensor x, Tensor w, Tensor s, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(duetime_q8, CPU, m) { m.impl("linear", &q8_linear); }
