// What every kernel in this folder includes first. CppOps inlines this file into
// each source, so the build folder holds one self-contained .cpp per extension.
// Narrow ATen headers (not ATen/ATen.h): a build takes a few seconds, not a minute
// (and a file, not load_inline, which prepends <torch/extension.h>: all of ATen
// and pybind11).
#ifndef DUETIME_ENGINE_CSRC_COMMON_H_
#define DUETIME_ENGINE_CSRC_COMMON_H_

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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

}  // namespace

#endif  // DUETIME_ENGINE_CSRC_COMMON_H_
