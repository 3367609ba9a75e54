#include "models/lora.h"

#include <ATen/ATen.h>

namespace lorapipe::models {

at::Tensor LoraAdapter::add_to(const at::Tensor& x, const at::Tensor& base_out) const {
  if (training && module_dropout > 0) {
    // kohya: `if torch.rand(1) < self.module_dropout: return org_forwarded`.
    if (at::rand({1}).item<double>() < module_dropout) return base_out;
  }
  const at::Tensor input = x.scalar_type() == down.scalar_type() ? x : x.to(down.scalar_type());
  at::Tensor lx = is_conv() ? at::conv2d(input, down, /*bias=*/{}, stride, padding)
                            : at::linear(input, down);
  if (training && dropout > 0) lx = at::dropout(lx, dropout, /*train=*/true);
  double effective_scale = scale;
  if (training && rank_dropout > 0) {
    // One keep/drop draw per sample and rank, broadcast over tokens or pixels (kohya's mask).
    at::Tensor mask = at::rand({lx.size(0), rank()}, lx.options()) > rank_dropout;
    if (is_conv()) {
      mask = mask.unsqueeze(-1).unsqueeze(-1);
    } else if (lx.dim() == 3) {
      mask = mask.unsqueeze(1);
    }
    lx = lx * mask.to(lx.scalar_type());
    effective_scale = scale / (1.0 - rank_dropout);
  }
  at::Tensor delta = is_conv() ? at::conv2d(lx, up) : at::linear(lx, up);
  delta = delta * (multiplier * effective_scale);
  return base_out + delta.to(base_out.scalar_type());
}

}  // namespace lorapipe::models
