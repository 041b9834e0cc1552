// What every kernel in this folder includes first. CppOps inlines this file into
// each source, so the build folder holds one self-contained .cpp per extension.
// Narrow ATen headers (not ATen/ATen.h): a build takes a few seconds, not a minute
// (and a file, not load_inline, which prepends <torch/extension.h>: all of ATen
// and pybind11).
#ifndef DUETIME_ENGINE_CSRC_COMMON_H_
#define DUETIME_ENGINE_CSRC_COMMON_H_

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp of 8 floats, for x <= 0 (attention scores minus their maximum; the GELU's tanh):
// Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial
// for e^r (Cephes' expf coefficients, relative error ~1e-7) scaled by 2^n through the
// exponent bits.
// Below -87.3 the result is 0, as expf's is (it would be a denormal at most).
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// 8 consecutive fp32 or bf16 values as fp32 (a bf16 is the top half of an fp32's bits).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// dst[0..n) <- src rounded to bf16, to nearest even as torch's own conversion rounds (so a
// finite value or an infinity stored here equals one stored by `Tensor.copy_`; a NaN stays a
// NaN only where its payload's top bits are set).
inline void to_bf16(c10::BFloat16* dst, const float* src, int64_t n) {
  int64_t i = 0;
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
  for (; i + 8 <= n; i += 8) {
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, half)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

}  // namespace

#endif  // DUETIME_ENGINE_CSRC_COMMON_H_
