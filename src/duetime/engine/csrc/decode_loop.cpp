// A plain decode step's layers in one call; why and how: duetime/engine/decode_loop.py.
#include "common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using c10::Dispatcher;

// One layer's attention for single-token decodes: row rows[i] of qk ([R, heads + kv_heads,
// head_dim], after the q/k norm and RoPE) and of qkv ([R, >= (heads + 2 kv_heads) * head_dim],
// the values last) stores its key and value in bufs[i] ([2, kv_heads, cap, head_dim], fp32, or
// bf16 with the key and value rounded to nearest even as `Tensor.copy_` rounds) at entry
// len[i], and its queries attend to entries lo[i] .. len[i] (inclusive). Returns
// [rows, heads * head_dim]. `rows` empty: every row of qk, in order.
at::Tensor store_attend(const at::Tensor& qk, const at::Tensor& qkv, at::IntArrayRef rows,
                        at::TensorList bufs, at::IntArrayRef len, at::IntArrayRef lo, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, double scale) {
  static auto attend = Dispatcher::singleton()
                           .findSchemaOrThrow("duetime_attn::decode_bufs", "")
                           .typed<at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef,
                                             at::IntArrayRef, double)>();
  const int64_t n_qk = heads + kv_heads, hd = head_dim;
  const int64_t T = rows.empty() ? qk.size(0) : (int64_t)rows.size();
  TORCH_CHECK(qk.dim() == 3 && qk.size(1) == n_qk && qk.size(2) == hd && qk.is_contiguous() &&
                  qk.scalar_type() == at::kFloat,
              "store_attend: qk must be contiguous fp32 [rows, heads + kv_heads, head_dim]");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(0) == qk.size(0) &&
                  qkv.size(1) >= (n_qk + kv_heads) * hd && qkv.scalar_type() == at::kFloat,
              "store_attend: qkv must be fp32 [rows, q + k + v] with unit column stride");
  TORCH_CHECK((int64_t)bufs.size() == T && (int64_t)len.size() == T && (int64_t)lo.size() == T,
              "store_attend: one buffer, length and start per row");
  const float* qkp = qk.data_ptr<float>();
  const float* vp = qkv.data_ptr<float>() + n_qk * hd;
  const int64_t qkv_row = qkv.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = rows.empty() ? t : rows[t];
    TORCH_CHECK(0 <= r && r < qk.size(0), "store_attend: row ", r, " out of range");
    const at::Tensor& buf = bufs[t];
    const int64_t cap = buf.size(2), at_ = len[t], from = lo[t];
    const bool bf16 = buf.scalar_type() == at::kBFloat16;
    TORCH_CHECK(buf.is_contiguous() && (bf16 || buf.scalar_type() == at::kFloat) && at_ < cap &&
                    buf.size(1) == kv_heads && buf.size(3) == hd && 0 <= from && from <= at_,
                "store_attend: no room for row ", r, " (or its buffer is not fp32 or bf16)");
    for (int64_t k = 0; k < kv_heads; ++k) {
      const float* key = qkp + (r * n_qk + heads + k) * hd;
      const float* value = vp + r * qkv_row + k * hd;
      const int64_t key_at = (k * cap + at_) * hd, value_at = ((kv_heads + k) * cap + at_) * hd;
      if (bf16) {
        c10::BFloat16* bp = buf.data_ptr<c10::BFloat16>();
        to_bf16(bp + key_at, key, hd);
        to_bf16(bp + value_at, value, hd);
      } else {
        float* bp = buf.data_ptr<float>();
        std::memcpy(bp + key_at, key, sizeof(float) * hd);
        std::memcpy(bp + value_at, value, sizeof(float) * hd);
      }
    }
  }
  // the rows' queries: a slice where the rows are consecutive (the executor puts decodes
  // together), else gathered from the contiguous qk before its heads are cut out
  at::Tensor q;
  bool consecutive = true;
  for (int64_t t = 1; t < (int64_t)rows.size() && consecutive; ++t)
    consecutive = rows[t] == rows[0] + t;
  if (rows.empty()) {
    q = qk;
  } else if (consecutive) {
    q = qk.narrow(0, rows[0], T);
  } else {
    at::Tensor idx = at::empty({T}, qk.options().dtype(at::kLong));
    std::copy(rows.begin(), rows.end(), idx.data_ptr<int64_t>());
    q = qk.index_select(0, idx);
  }
  q = q.narrow(1, 0, heads);
  return attend.call(q.contiguous(), bufs, lo, len, scale);
}

// x [T, D]: the residual stream entering layer 0 (embedding * scale). Per layer l
// (L layers): w[8l .. 8l+7] = qkv, o, gate_up, down as (packed, scale) pairs with
// n[4l .. 4l+3] outputs, used for steps of at most few_rows rows; beyond, many[4l .. 4l+3]:
// the same products as bf16 weights packed for oneDNN's linear; norms[5l .. 5l+4] = in_norm,
// qk_norm, post_attn, pre_ffw, post_ffw; sliding[l]. bufs[l * T + t]: sequence t's [2, kv_heads,
// cap, head_dim] buffer of layer l, whose entry len[l * T + t] receives this step's key and value,
// and whose entries lo[..] .. len[..] (inclusive) the query attends to.
// Returns the residual stream after the last layer.
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList w, at::IntArrayRef n,
                         at::TensorList many, int64_t few_rows, at::TensorList norms,
                         at::IntArrayRef sliding, const at::Tensor& cos_l, const at::Tensor& sin_l,
                         const at::Tensor& cos_g, const at::Tensor& sin_g, at::TensorList bufs,
                         at::IntArrayRef len, at::IntArrayRef lo, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double scale) {
  static auto q8 =
      Dispatcher::singleton()
          .findSchemaOrThrow("duetime_q8::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  static auto packed =
      Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  static const c10::List<std::optional<at::Scalar>> no_scalars;
  static auto gelu_mul = Dispatcher::singleton()
                             .findSchemaOrThrow("duetime_norm::gelu_mul", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  static auto rms = Dispatcher::singleton()
                        .findSchemaOrThrow("duetime_norm::rms", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static auto add_rms = Dispatcher::singleton()
                            .findSchemaOrThrow("duetime_norm::add_rms", "")
                            .typed<std::tuple<at::Tensor, at::Tensor>(
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double)>();
  static auto qk_rope = Dispatcher::singleton()
                            .findSchemaOrThrow("duetime_norm::qk_rope", "")
                            .typed<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, double)>();
  const int64_t L = (int64_t)sliding.size(), T = x_in.size(0);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "decode_layers: x must be contiguous fp32 [rows, hidden]");
  TORCH_CHECK(
      (int64_t)w.size() == 8 * L && (int64_t)n.size() == 4 * L && (int64_t)norms.size() == 5 * L,
      "decode_layers: weights, outputs and norms must cover ", L, " layers");
  TORCH_CHECK(
      (int64_t)bufs.size() == L * T && (int64_t)len.size() == L * T && (int64_t)lo.size() == L * T,
      "decode_layers: one buffer, length and start per layer and row");
  const bool few = T <= few_rows;
  TORCH_CHECK(few || (int64_t)many.size() == 4 * L,
              "decode_layers: a step of more than few_rows rows needs the packed bf16 weights");
  // product p (0..4L-1) of the layers: the int8 kernel for few rows, packed bf16 beyond
  auto linear = [&](const at::Tensor& in, int64_t p) -> at::Tensor {
    if (few) return q8.call(in, w[2 * p], w[2 * p + 1], n[p]);
    return packed
        .call(in.to(at::kBFloat16), many[p], std::nullopt, "none", no_scalars, std::nullopt)
        .to(at::kFloat);
  };
  const int64_t n_qk = heads + kv_heads;
  at::Tensor x = x_in;
  at::Tensor h = rms.call(x, norms[0], eps);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& cos = sliding[l] ? cos_l : cos_g;
    const at::Tensor& sin = sliding[l] ? sin_l : sin_g;
    const at::Tensor qkv = linear(h, 4 * l);
    const at::Tensor qk = qk_rope.call(qkv, n_qk, norms[5 * l + 1], cos, sin, eps);
    at::Tensor a = store_attend(qk, qkv, {}, bufs.slice(l * T, T), len.slice(l * T, T),
                                lo.slice(l * T, T), heads, kv_heads, head_dim, scale);
    a = linear(a, 4 * l + 1);
    std::tie(x, h) = add_rms.call(x, a, norms[5 * l + 2], norms[5 * l + 3], eps);
    const at::Tensor gu = linear(h, 4 * l + 2);
    const at::Tensor act = gelu_mul.call(gu);
    a = linear(act, 4 * l + 3);
    if (l + 1 < L) {
      std::tie(x, h) = add_rms.call(x, a, norms[5 * l + 4], norms[5 * (l + 1)], eps);
    } else {
      x = at::add(x, rms.call(a, norms[5 * l + 4], eps));
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(duetime_loop, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] w, int[] n, Tensor[] many, int few_rows, "
      "Tensor[] norms, int[] sliding, "
      "Tensor cos_l, Tensor sin_l, Tensor cos_g, Tensor sin_g, Tensor[] bufs, int[] len, "
      "int[] lo, int heads, int kv_heads, int head_dim, float eps, float scale) -> Tensor");
  m.def(
      "store_attend(Tensor qk, Tensor qkv, int[] rows, Tensor[] bufs, int[] len, int[] lo, "
      "int heads, int kv_heads, int head_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(duetime_loop, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("store_attend", &store_attend);
}
// the packed bf16 weights are oneDNN tensors: a call that carries them dispatches here
TORCH_LIBRARY_IMPL(duetime_loop, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
