// Decode attention from each sequence's own KV tensors; why and how:
// duetime/engine/attention_kernel.py.
#include "common.h"

#include <ATen/ops/empty.h>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace {

void check_kv(const at::Tensor& t, int64_t g, int64_t d, at::ScalarType dt, const char* what,
              size_t b) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == dt && t.device().is_cpu(),
              "decode_attention: ", what, "[", b, "] must be a CPU ", dt,
              " [kv_heads, S, head_dim] tensor (as keys[0]), got ", t.sizes(), " ",
              t.scalar_type());
  TORCH_CHECK(t.size(0) == g && t.size(2) == d && t.size(1) >= 1 && t.stride(2) == 1,
              "decode_attention: ", what, "[", b, "] has shape ", t.sizes(), " strides ",
              t.strides(), "; want [", g, ", S >= 1, ", d, "] with unit stride on head_dim");
}

constexpr int64_t R = 4;         // query heads of one KV head taken together
constexpr int64_t PREFETCH = 4;  // key rows read ahead of the one being scored

// Cache lines (64 bytes) of a row of n values of T from p, into the cache level `hint`.
template <_mm_hint hint, typename T>
inline void prefetch_row(const T* p, int64_t from, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = from * int64_t(sizeof(T)); o < n * int64_t(sizeof(T)); o += 64)
    _mm_prefetch(c + o, hint);
}

// Scores of NR query rows q[r] (row stride D) against S keys of T (fp32 or bf16; row stride
// ks): p[r * S + j] = scale * q_r . k_j. Each key is read once for all NR rows. The value
// rows v (row stride vs) that the weighted sum reads next are fetched into L2 meanwhile: the
// scores keep the core busy while the values arrive (the score pass is bound by its FMAs,
// the weighted sum by DRAM when it fetches them itself).
template <int NR, typename T>
void scores(const float* q, const T* k, int64_t ks, int64_t S, int64_t D, float scale, float* p,
            const T* v, int64_t vs) {
  const int64_t D8 = D - D % 8;
  for (int64_t j = 0; j < S; ++j) {
    const T* kj = k + j * ks;
    if (j + PREFETCH < S)  // the key rows a few ahead: DRAM, not the core, sets the pace
      prefetch_row<_MM_HINT_T0>(kj + PREFETCH * ks, 0, D);
    prefetch_row<_MM_HINT_T1>(v + j * vs, 0, D);
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 kv = load8(kj + d);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), kv, acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[r]);
      for (int64_t d = D8; d < D; ++d) s += q[r * D + d] * float(kj[d]);
      p[r * S + j] = s * scale;
    }
  }
}

// p[0..S) <- exp(p - max) in place, vectorised; returns (max, sum of the exponentials).
std::pair<float, float> exp_in_place(float* p, int64_t S) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < S; ++j) mx = std::max(mx, p[j]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= S; j += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; j < S; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  return {mx, sum};
}

inline void scale_row(float* x, float a, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), av));
  for (; i < n; ++i) x[i] *= a;
}

// out[r] = sum_j p[r * S + j] v_j for NR rows (row stride D). Keys in blocks of KB (their
// values stay in cache), and within a block 8 * C columns at a time, their NR sums in
// registers over the block's keys.
template <int NR, typename T>
void weighted(const float* p, const T* v, int64_t vs, int64_t S, int64_t D, float* out) {
  constexpr int C = NR <= 2 ? 4 : 2;  // 8-wide column chunks per pass (NR * C registers)
  constexpr int64_t KB = 128;
  const int64_t DC = D - D % (8 * C);
  for (int64_t j0 = 0; j0 < S; j0 += KB) {
    const int64_t j1 = std::min(S, j0 + KB);
    for (int64_t d = 0; d < DC; d += 8 * C) {
      __m256 acc[NR][C];
      for (int r = 0; r < NR; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = j0 ? _mm256_loadu_ps(out + r * D + d + 8 * c) : _mm256_setzero_ps();
      for (int64_t j = j0; j < j1; ++j) {
        const T* vj = v + j * vs + d;
        if (d == 0)  // the first pass over the block brings each value row in whole
          prefetch_row<_MM_HINT_T1>(vj, 64 / int64_t(sizeof(T)), D);
        __m256 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load8(vj + 8 * c);
        for (int r = 0; r < NR; ++r) {
          const __m256 pr = _mm256_broadcast_ss(p + r * S + j);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * D + d + 8 * c, acc[r][c]);
    }
  }
  for (int64_t d = DC; d < D; ++d)
    for (int r = 0; r < NR; ++r) {
      float s = 0.f;
      for (int64_t j = 0; j < S; ++j) s += p[r * S + j] * float(v[j * vs + d]);
      out[r * D + d] = s;
    }
}

// NR query rows against S keys: out[r] = sum_j exp(score_rj - m_r) v_j, unnormalised,
// with m_r the rows' largest score and l_r the sum of their exponentials.
template <int NR, typename T>
void attend_group(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t S,
                  int64_t D, float scale, float* p, float* out, float* m, float* l) {
  scores<NR>(q, k, ks, S, D, scale, p, v, vs);
  for (int r = 0; r < NR; ++r) std::tie(m[r], l[r]) = exp_in_place(p + r * S, S);
  weighted<NR>(p, v, vs, S, D, out);
}

template <typename T>
void attend_rows(int64_t nr, const float* q, const T* k, int64_t ks, const T* v, int64_t vs,
                 int64_t S, int64_t D, float scale, float* p, float* out, float* m, float* l) {
  switch (nr) {
    case 4: attend_group<4>(q, k, ks, v, vs, S, D, scale, p, out, m, l); break;
    case 3: attend_group<3>(q, k, ks, v, vs, S, D, scale, p, out, m, l); break;
    case 2: attend_group<2>(q, k, ks, v, vs, S, D, scale, p, out, m, l); break;
    default: attend_group<1>(q, k, ks, v, vs, S, D, scale, p, out, m, l); break;
  }
}

// Keys per piece when a (sequence, KV head) pair is split over threads.
constexpr int64_t PIECE = 256;

// One sequence's keys and values as the kernel reads them: S entries from k and v, a KV head
// `head` elements after the one before it, an entry `row` elements after the one before it.
struct SeqKV {
  const void* k;
  const void* v;
  int64_t S, k_head, v_head, k_row, v_row;
};

// q [B, H, D] fp32, contiguous; seqs[b]: sequence b's keys and values, G KV heads of T (fp32
// or bf16). Returns [B, H * D].
template <typename T>
at::Tensor attend_seqs(const at::Tensor& q, const std::vector<SeqKV>& seqs, int64_t G,
                       double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t rep = H / G;
  at::Tensor y = at::empty({B, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float sc = float(scale);
  // Fewer (sequence, KV head) pairs than threads (one sequence: one pair for Gemma 3 270M):
  // each pair's keys go in pieces of PIECE over the threads, and the pieces' partial sums
  // merge by their maxima (flash-decoding). Otherwise one pair a task.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> first(size_t(B * G) + 1, 0);  // the pairs' first piece
  for (int64_t t = 0; t < B * G; ++t) {
    const int64_t S = seqs[size_t(t / G)].S;
    const int64_t n = B * G < threads ? std::min(threads, (S + PIECE - 1) / PIECE) : 1;
    first[size_t(t) + 1] = first[size_t(t)] + n;
  }
  const int64_t pieces = first.back();
  const bool split = pieces > B * G;
  // per piece and query row: its unnormalised output, its max and its sum
  std::vector<float> part(split ? size_t(pieces * rep * D) : 0);
  std::vector<float> pm(size_t(pieces * rep)), pl(size_t(pieces * rep));
  at::parallel_for(0, pieces, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
      const int64_t b = t / G, g = t % G, n = first[size_t(t) + 1] - first[size_t(t)];
      const SeqKV& kv = seqs[size_t(b)];
      const int64_t c = i - first[size_t(t)];
      const int64_t j0 = kv.S * c / n, j1 = kv.S * (c + 1) / n;  // this piece's keys
      p.resize(size_t(R * (j1 - j0)));
      const T* kp = static_cast<const T*>(kv.k) + g * kv.k_head + j0 * kv.k_row;
      const T* vp = static_cast<const T*>(kv.v) + g * kv.v_head + j0 * kv.v_row;
      for (int64_t r0 = 0; r0 < rep; r0 += R) {
        const int64_t nr = std::min(R, rep - r0);
        const int64_t row = b * H + g * rep + r0;  // the first query row of this group
        float* out = split ? part.data() + (i * rep + r0) * D : yp + row * D;
        float* m = pm.data() + i * rep + r0;
        float* l = pl.data() + i * rep + r0;
        attend_rows(nr, qp + row * D, kp, kv.k_row, vp, kv.v_row, j1 - j0, D, sc, p.data(), out, m,
                    l);
        if (!split)
          for (int64_t r = 0; r < nr; ++r) scale_row(out + r * D, 1.f / l[r], D);
      }
    }
  });
  if (split) {  // out_r = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the largest m_c
    for (int64_t t = 0; t < B * G; ++t) {
      const int64_t b = t / G, g = t % G;
      for (int64_t r = 0; r < rep; ++r) {
        float* out = yp + (b * H + g * rep + r) * D;
        float mx = -INFINITY;
        for (int64_t i = first[size_t(t)]; i < first[size_t(t) + 1]; ++i)
          mx = std::max(mx, pm[size_t(i * rep + r)]);
        std::fill(out, out + D, 0.f);
        float total = 0.f;
        for (int64_t i = first[size_t(t)]; i < first[size_t(t) + 1]; ++i) {
          const float w = std::exp(pm[size_t(i * rep + r)] - mx);
          total += w * pl[size_t(i * rep + r)];
          const float* o = part.data() + (i * rep + r) * D;
          for (int64_t d = 0; d < D; ++d) out[d] += w * o[d];
        }
        scale_row(out, 1.f / total, D);
      }
    }
  }
  return y;
}

at::Tensor attend_typed(const at::Tensor& q, const std::vector<SeqKV>& seqs, int64_t G,
                        at::ScalarType kv_type, double scale) {
  return kv_type == at::kBFloat16 ? attend_seqs<c10::BFloat16>(q, seqs, G, scale)
                                  : attend_seqs<float>(q, seqs, G, scale);
}

void check_q(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), op,
              ": q must be a CPU fp32 [batch, heads, head_dim] tensor, got ", q.sizes(), " ",
              q.scalar_type());
}

void check_kv_type(at::ScalarType kv_type, const char* op) {
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, op,
              ": keys and values must be fp32 or bf16, got ", kv_type);
}

// q [B, H, D] fp32; keys[b], values[b] [G, S_b, D], all fp32 or all bf16. Returns [B, H * D].
at::Tensor decode_attention(const at::Tensor& q_in, at::TensorList keys, at::TensorList values,
                            double scale) {
  check_q(q_in, "decode_attention");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(int64_t(keys.size()) == B && int64_t(values.size()) == B, "decode_attention: ", B,
              " queries but ", keys.size(), " keys and ", values.size(), " values");
  TORCH_CHECK(B >= 1, "decode_attention: empty batch");
  const int64_t G = keys[0].size(0);
  TORCH_CHECK(G >= 1 && H % G == 0, "decode_attention: ", H, " heads do not group into ", G,
              " KV heads");
  const at::ScalarType kv_type = keys[0].scalar_type();
  check_kv_type(kv_type, "decode_attention");
  std::vector<SeqKV> seqs(static_cast<size_t>(B));
  for (size_t b = 0; b < size_t(B); ++b) {
    const at::Tensor &K = keys[b], &V = values[b];
    check_kv(K, G, D, kv_type, "keys", b);
    check_kv(V, G, D, kv_type, "values", b);
    TORCH_CHECK(K.size(1) == V.size(1), "decode_attention: sequence ", b, " has ", K.size(1),
                " keys but ", V.size(1), " values");
    seqs[b] = {K.data_ptr(), V.data_ptr(), K.size(1),  K.stride(0),
               V.stride(0),  K.stride(1),  V.stride(1)};
  }
  return attend_typed(q, seqs, G, kv_type, scale);
}

// The same from each sequence's whole KV buffer, without a view of it per sequence (a decode
// step of 96 sequences made ~3,500 of them a step, ~9 ms): bufs[b] [2, G, cap, D] contiguous
// (keys, then values), all fp32 or all bf16; sequence b attends to entries lo[b] .. at[b].
at::Tensor decode_attention_bufs(const at::Tensor& q_in, at::TensorList bufs, at::IntArrayRef lo,
                                 at::IntArrayRef at, double scale) {
  check_q(q_in, "decode_attention_bufs");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(
      B >= 1 && int64_t(bufs.size()) == B && int64_t(lo.size()) == B && int64_t(at.size()) == B,
      "decode_attention_bufs: ", B, " queries need as many buffers, starts and ends, got ",
      bufs.size(), ", ", lo.size(), ", ", at.size());
  const int64_t G = bufs[0].dim() == 4 ? bufs[0].size(1) : 0;
  TORCH_CHECK(G >= 1 && H % G == 0, "decode_attention_bufs: ", H, " heads do not group into ", G,
              " KV heads");
  const at::ScalarType kv_type = bufs[0].scalar_type();
  check_kv_type(kv_type, "decode_attention_bufs");
  const int64_t elem = int64_t(c10::elementSize(kv_type));
  std::vector<SeqKV> seqs(static_cast<size_t>(B));
  for (size_t b = 0; b < size_t(B); ++b) {
    const at::Tensor& buf = bufs[b];
    TORCH_CHECK(buf.dim() == 4 && buf.size(0) == 2 && buf.size(1) == G && buf.size(3) == D &&
                    buf.is_contiguous() && buf.scalar_type() == kv_type && buf.device().is_cpu(),
                "decode_attention_bufs: bufs[", b, "] must be a contiguous CPU ", kv_type, " [2, ",
                G, ", cap, ", D, "] tensor, got ", buf.sizes(), " ", buf.scalar_type());
    const int64_t cap = buf.size(2);
    TORCH_CHECK(0 <= lo[b] && lo[b] <= at[b] && at[b] < cap, "decode_attention_bufs: sequence ", b,
                " attends to entries ", lo[b], " .. ", at[b], " of ", cap);
    const char* base = static_cast<const char*>(buf.data_ptr()) + lo[b] * D * elem;
    seqs[b] = {base, base + G * cap * D * elem, at[b] - lo[b] + 1, cap * D, cap * D, D, D};
  }
  return attend_typed(q, seqs, G, kv_type, scale);
}

}  // namespace

TORCH_LIBRARY(duetime_attn, m) {
  m.def("decode(Tensor q, Tensor[] keys, Tensor[] values, float scale) -> Tensor");
  m.def("decode_bufs(Tensor q, Tensor[] bufs, int[] lo, int[] at, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(duetime_attn, CPU, m) {
  m.impl("decode", &decode_attention);
  m.impl("decode_bufs", &decode_attention_bufs);
}
