#include "models/attention.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cmath>
#include <limits>

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
  if (!causal) {
    // diffusers' AttnProcessor (the UNet's and VAE's reference): heads folded into the batch
    // (head_to_batch_dim's contiguous copies), the scale applied inside baddbmm, then bmm.
    const int64_t batch = q.size(0), heads = q.size(1), d = q.size(3);
    auto fold = [&](const at::Tensor& t) { return t.reshape({batch * heads, t.size(2), d}); };
    const at::Tensor q3 = fold(q), k3 = fold(k), v3 = fold(v);
    const at::Tensor scores =
        at::baddbmm(at::empty({q3.size(0), q3.size(1), k3.size(1)}, q3.options()), q3,
                    k3.transpose(-1, -2), /*beta=*/0, /*alpha=*/scale);
    return at::bmm(at::softmax(scores, -1), v3).view({batch, heads, q.size(2), d});
  }
  // transformers' eager CLIP attention (the causal one's reference): a 4-D matmul, then the scale.
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    const int64_t t = q.size(-2);
    const int64_t s = k.size(-2);
    at::Tensor mask = at::ones({t, s}, q.options().dtype(at::kBool)).triu(/*diagonal=*/1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return at::matmul(at::softmax(scores, -1), v);
}

at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& key_mask) {
  std::optional<at::Tensor> mask;
  if (key_mask.defined()) {
    mask = key_mask.to(at::kBool).view({key_mask.size(0), 1, 1, key_mask.size(1)});
  }
  if (!g_force_math) {
    return at::scaled_dot_product_attention(q, k, v, mask);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (mask) {
    scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(scores, -1), v);
}

}  // namespace lorapipe::models
