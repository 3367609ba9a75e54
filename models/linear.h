#pragma once
// The adaptable layers of the models: torch::nn::Linear and torch::nn::Conv2d with a LoRA slot
// (models/lora.h). Parameters and their names ("weight", "bias") are torch's, so state dicts and
// module_tensors see no difference; an empty slot costs one null check.
//
// Linear's forward is at::linear, the op PyTorch's Python nn.Linear calls. The C++ frontend's
// functional linear runs an input of more than two dimensions as a matmul followed by a separate
// in-place bias add. at::linear folds the leading dimensions of a contiguous input and issues one
// fused addmm, and its backward is the matching AddmmBackward. Every (B, L, C) projection of the
// UNet, the VAE attention and the CLIP tower goes through here, so this is the difference between
// matching the reference's kernel sequence and an extra pass over every projection's output.
//
// A weight stored in float8 (--fp8_base, models/float8.h) is upcast to the input's dtype per call
// (dequantised with its scales under --fp8_scaled).

#include <ATen/ops/linear.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "models/float8.h"
#include "models/lora.h"

namespace lorapipe::models {

struct LinearImpl : torch::nn::LinearImpl {
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input) {
    at::Tensor out = is_float8(weight)
                         ? float8_linear(input, weight, bias, weight_scale, float8_matmul)
                         : at::linear(input, weight, bias);
    return lora ? lora->add_to(input, out) : out;
  }
  std::shared_ptr<LoraAdapter> lora;  // filled by a LoRA network, empty otherwise
  at::Tensor weight_scale;  // scaled float8's scales (the buffer "scale_weight"); else undefined
  bool float8_matmul = false;  // --fp8_fast: multiplies in float8 (models/float8.h)
};
TORCH_MODULE(Linear);

struct Conv2dImpl : torch::nn::Conv2dImpl {
  using torch::nn::Conv2dImpl::Conv2dImpl;
  at::Tensor forward(const at::Tensor& input) {
    at::Tensor out = is_float8(weight) ? float8_conv2d(input, weight, bias, options, weight_scale)
                                       : torch::nn::Conv2dImpl::forward(input);
    return lora ? lora->add_to(input, out) : out;
  }
  std::shared_ptr<LoraAdapter> lora;
  at::Tensor weight_scale;
};
TORCH_MODULE(Conv2d);

}  // namespace lorapipe::models
