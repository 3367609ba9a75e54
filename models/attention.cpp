#include "models/attention.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cmath>

namespace lorapipe::models {
namespace {
std::atomic<bool> g_force_math{false};
}  // namespace

void set_force_math_attention(bool force) { g_force_math = force; }
bool force_math_attention() { return g_force_math; }

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  if (!g_force_math) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/causal);
  }
  // softmax(q k^T / sqrt(d)) v, written out.
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    const int64_t t = q.size(-2);
    const int64_t s = k.size(-2);
    at::Tensor mask = at::ones({t, s}, q.options().dtype(at::kBool)).triu(/*diagonal=*/1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return at::matmul(at::softmax(scores, -1), v);
}

}  // namespace lorapipe::models
