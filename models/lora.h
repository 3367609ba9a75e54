#pragma once
// The LoRA slot of an adaptable layer (models::Linear, models::Conv2d): an adapter the trainer
// fills and trains, and that the layer's own forward consults, so every holder of the layer (the
// typed member and the ModuleList that gives it its checkpoint name are the same object) runs
// the adapted forward without any module being replaced or wrapped.
//
// The adapter is kohya sd-scripts' LoRAModule (networks/lora.py), exactly:
//   out = base(x) + up(dropout(down(x)) * rank_mask) * multiplier * scale
// with scale = alpha / rank, `dropout` applied to down's output (kohya's `dropout`, not peft's
// input dropout), the rank mask of `rank_dropout` rescaling by 1 / (1 - rank_dropout), and
// `module_dropout` skipping the whole adapter for a step. The three dropouts act only while
// `training`. A 1x1 or 3x3 convolution's down is a convolution with the base layer's kernel,
// stride and padding, its up a 1x1 convolution (kohya's LoCon layout).
//
// The adapter's tensors are not parameters of the layer: the base model's state dict, its
// fingerprint and its parameters() list are unchanged by an adapter. The tensors live wherever
// the owner put them (fp32 while training, whatever the base dtype); the adapter computes in the
// base output's dtype, its tensors cast for each call, as kohya's LoRA computes under autocast:
// in bf16 or fp16 no fp32 copy of an activation is made or kept for backward.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace lorapipe::models {

struct LoraAdapter {
  at::Tensor down;  // [rank, in] or [rank, in, kh, kw]
  at::Tensor up;    // [out, rank] or [out, rank, 1, 1]
  double scale = 1.0;       // alpha / rank
  double multiplier = 1.0;  // kohya's network multiplier
  double dropout = 0.0;
  double rank_dropout = 0.0;
  double module_dropout = 0.0;
  bool training = false;
  // Convolutions only: the base layer's geometry, which `down` repeats.
  std::vector<int64_t> stride = {1, 1};
  std::vector<int64_t> padding = {0, 0};

  int64_t rank() const { return down.size(0); }
  bool is_conv() const { return down.dim() == 4; }

  // base_out + the adapter's contribution for input `x` (the base layer's own input), added into
  // base_out in place unless it is a view: it must be the layer's fresh output, which no backward
  // reads.
  at::Tensor add_to(const at::Tensor& x, const at::Tensor& base_out) const;
};

}  // namespace lorapipe::models
