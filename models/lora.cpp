#include "models/lora.h"

#include <ATen/ATen.h>

namespace lorapipe::models {

at::Tensor LoraAdapter::add_to(const at::Tensor& x, const at::Tensor& base_out) const {
  if (training && module_dropout > 0) {
    // kohya: `if torch.rand(1) < self.module_dropout: return org_forwarded`.
    if (at::rand({1}).item<double>() < module_dropout) return base_out;
  }
  // In the base's dtype, as kohya's LoRA computes under autocast: its fp32 weights cast per call
  // (rank-sized), so no fp32 copy of an activation is made or kept for backward.
  const c10::ScalarType dtype = base_out.scalar_type();
  const at::Tensor d = down.scalar_type() == dtype ? down : down.to(dtype);
  const at::Tensor u = up.scalar_type() == dtype ? up : up.to(dtype);
  const at::Tensor input = x.scalar_type() == dtype ? x : x.to(dtype);
  at::Tensor lx = is_conv() ? at::conv2d(input, d, /*bias=*/{}, stride, padding)
                            : at::linear(input, d);
  if (training && dropout > 0) lx = at::dropout(lx, dropout, /*train=*/true);
  double effective_scale = scale;
  if (training && rank_dropout > 0) {
    // One keep/drop draw per sample and rank, broadcast over tokens or pixels (kohya's mask).
    // Drawn in fp32 whatever lx's dtype, as kohya's torch.rand (which autocast leaves alone).
    at::Tensor mask =
        at::rand({lx.size(0), rank()}, lx.options().dtype(at::kFloat)) > rank_dropout;
    if (is_conv()) {
      mask = mask.unsqueeze(-1).unsqueeze(-1);
    } else if (lx.dim() == 3) {
      mask = mask.unsqueeze(1);
    }
    lx = lx * mask.to(lx.scalar_type());
    effective_scale = scale / (1.0 - rank_dropout);
  }
  at::Tensor delta = is_conv() ? at::conv2d(lx, u) : at::linear(lx, u);
  delta.mul_(multiplier * effective_scale);
  // The layer's own fresh output, added into in place; a custom autograd Function's output (the
  // float8 layers') may be a view, which autograd forbids modifying in place.
  if (base_out.is_view()) return base_out + delta;
  at::Tensor out = base_out;
  return out.add_(delta);
}

}  // namespace lorapipe::models
