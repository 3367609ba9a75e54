#pragma once
// Scaled dot-product attention for every model in models/, through
// at::scaled_dot_product_attention (flash / memory-efficient kernels on GPU), with a switch that
// forces the plain math path, which parity tests use to compare with the reference. The math path
// is each reference's own formulation, op for op, so that the same kernels round the same way:
// diffusers' AttnProcessor for the UNet and VAE (non-causal: heads folded into the batch, the
// scale inside baddbmm), transformers' eager CLIP attention for the text encoder (causal: a 4-D
// matmul, then the scale).

#include <ATen/core/Tensor.h>

#include <optional>

namespace lorapipe::models {

// q, k, v: [B, heads, T, head_dim]. `causal` masks future positions.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     bool causal = false);

// Non-causal attention over the keys `key_mask` selects ([B, S] bool, true: attended; undefined:
// all), as kohya's Flux attention with --apply_t5_attn_mask: every query still attends to the
// image tokens and the unmasked text. The math path is SDPA's own (a 4-D matmul, the scale, the
// masked scores at -inf), the reference's for the transformer families.
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& key_mask);

// Forces (or stops forcing) the math path process-wide.
void set_force_math_attention(bool force);
bool force_math_attention();

}  // namespace lorapipe::models
