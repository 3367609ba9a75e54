#pragma once
// torch::nn::Linear whose forward is at::linear, the op PyTorch's Python nn.Linear calls.
//
// The C++ frontend's functional linear runs an input of more than two dimensions as a matmul
// followed by a separate in-place bias add. at::linear folds the leading dimensions of a
// contiguous input and issues one fused addmm, and its backward is the matching AddmmBackward.
// Every (B, L, C) projection of the UNet, the VAE attention and the CLIP tower goes through here,
// so this is the difference between matching the reference's kernel sequence and an extra pass
// over every projection's output. Parameters and their names ("weight", "bias") are
// torch::nn::Linear's, so state dicts and module_tensors see no difference.

#include <ATen/ops/linear.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace lorapipe::models {

struct LinearImpl : torch::nn::LinearImpl {
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input) { return at::linear(input, weight, bias); }
};
TORCH_MODULE(Linear);

}  // namespace lorapipe::models
