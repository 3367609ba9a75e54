#pragma once
// Frozen base weights stored in float8 (kohya's --fp8_base, --fp8_base_unet): a quarter of the
// fp32 weights' memory, half of bf16's, for the layers that hold nearly all of it.
//
// Only the weight of each models::Linear and models::Conv2d is stored in float8_e4m3fn: 99.95%
// of SD1.5's U-Net. Its norms and biases, and the text encoder's embeddings (kohya keeps those
// too: nn.Embedding takes no float8), keep the compute dtype. A layer whose
// weight is float8 computes in its input's dtype: the weight is upcast for the call and dropped
// after it. kohya puts the whole model in float8 and lets autocast upcast each call; autograd then
// keeps every upcast copy alive for backward, so without gradient checkpointing kohya's peak holds
// the bf16 weights on top of the float8 ones. Here backward keeps the float8 weight and upcasts it
// again: the peak holds the float8 weights only, one layer's upcast copy at a time.
//
// These layers are frozen: no gradient reaches a float8 weight or a bias beside it (a LoRA on the
// layer trains through its own tensors), and the input's gradient is the only one computed.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/options/conv.h>

#include <cstdint>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

inline bool is_float8(const at::Tensor& t) {
  return t.defined() && c10::isFloat8Type(t.scalar_type());
}

// at::linear(input, weight upcast to input's dtype, bias), for a float8 weight.
at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias);

// torch::nn::Conv2d's forward (zero padding) with the float8 weight upcast to input's dtype.
at::Tensor float8_conv2d(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const torch::nn::detail::ConvNdOptions<2>& options);

// The largest magnitude float8_e4m3fn holds; store_weights_in_float8 saturates beyond it (a plain
// conversion would make such a value NaN).
inline constexpr double kFloat8E4m3Max = 448.0;

struct Float8Storage {
  int64_t tensors = 0;        // weights converted
  int64_t bytes_before = 0;   // their storage before
  int64_t bytes_after = 0;    // and after
  int64_t saturated = 0;      // weights with values beyond +-448, clamped to it
};

// Stores the weight of every models::Linear and models::Conv2d under `module` (on its device) as
// float8_e4m3fn, rounded to nearest, and freezes those layers (weight and bias). Move the module
// to its device afterwards with a device-only .to(device): a .to(dtype) converts the float8
// weights back.
Float8Storage store_weights_in_float8(torch::nn::Module& module);

}  // namespace lorapipe::models
