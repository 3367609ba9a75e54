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
//
// Scaled float8 (--fp8_scaled with --fp8_base, musubi-tuner's): each weight is stored as
// float8(weight / scale) with float32 scales, one per 64 input features of each output row of a
// Linear whose input width is a multiple of 64, one per row of another Linear, one for the whole
// weight of a convolution. Each scale takes its block's largest magnitude to 448, so small
// weights keep float8's full precision instead of falling into its subnormals (a plain cast
// rounds a weight of 0.002 to a multiple of 0.002), and nothing saturates. The layer computes
// with (float8 widened to fp32, times its scale) rounded to the input's dtype: exactly what a
// layer holding that dequantised weight computes. The scales cost 1/16 of the float8 bytes.
//
// Float8 matmuls (--fp8_fast with --fp8_scaled, musubi-tuner's name; the denoiser's Linear layers
// only): the layer multiplies float8 by float8 (at::_scaled_mm) instead of widening its weight.
// Its weight takes one scale per output row, the layout _scaled_mm's row-wise scaling reads (a
// 64-wide block is not one of its layouts); each call quantises its input the same way, one scale
// per row (token) taking the row's largest magnitude to 448. The product is then
// (float8 input times its row scale) by (float8 weight times its row scale), summed in fp32: on
// CUDA in one row-wise scaled _scaled_mm when the compute dtype is bf16 (the only output dtype
// that scaling takes) and the device has row-wise kernels (sm89, sm90, sm100; not sm120), else,
// and on the CPU (whose _scaled_mm takes one scale per tensor), as a
// unit-scale float8 _scaled_mm into fp32 followed by the two scales. The input's rounding to
// float8 is an error the dequantising path does not make: float8_test measures both per family.
// Backward is the dequantising path's (the input gradient in the compute dtype): gradients are
// not rounded to float8. A layer whose widths are not multiples of 16 (_scaled_mm's rule) widens
// its weight as before. On CUDA the matrix units exist from compute capability 8.9.

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

// at::linear(input, weight upcast to input's dtype, bias), for a float8 weight; with `scale`
// (scaled float8), the dequantised weight (dequantize_float8).
// With `matmul_in_float8` (a --fp8_fast layer, its scale one per row), float8_matmul's forward.
at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& scale = {}, bool matmul_in_float8 = false);

// torch::nn::Conv2d's forward (zero padding) with the float8 weight upcast to input's dtype (or
// dequantised with `scale`).
at::Tensor float8_conv2d(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const torch::nn::detail::ConvNdOptions<2>& options,
                         const at::Tensor& scale = {});

// Scaled float8's block: this many input features of one output row share a scale.
inline constexpr int64_t kFloat8ScaleBlock = 64;

// A weight's float32 scales, its blocks' largest magnitudes over 448 (1 for an all-zero block):
// [out, in / 64, 1] for a 2-d weight whose input width is a multiple of 64, [out, 1] for another
// 2-d weight, a 0-d tensor for any other shape.
at::Tensor float8_scales(const at::Tensor& weight);
// float8_e4m3fn(weight / scale), rounded to nearest, in the weight's shape.
at::Tensor quantize_float8(const at::Tensor& weight, const at::Tensor& scale);
// The weight a scaled float8 layer computes with: float8 widened to fp32 times its scale, rounded
// to `dtype`; without a scale, the plain widening.
at::Tensor dequantize_float8(const at::Tensor& weight, const at::Tensor& scale,
                             c10::ScalarType dtype);

// --fp8_fast's weight scales: one per output row of a 2-d weight, [out, 1].
at::Tensor float8_row_scales(const at::Tensor& weight);

// Whether `device` multiplies float8 matrices: the CPU (through _scaled_mm's CPU kernel: for
// trying the option, not for speed) and CUDA devices of compute capability 8.9 and above.
bool float8_matmul_supported(const c10::Device& device);

// y = x W^T + b over a float8 weight with row scales [out, 1], multiplied in float8 as
// --fp8_fast does (above); `input` [..., in] in the compute dtype, the result in the same dtype.
// No autograd: float8_linear wraps it.
at::Tensor float8_matmul(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& row_scale, const at::Tensor& bias);

// The largest magnitude float8_e4m3fn holds; store_weights_in_float8 saturates beyond it (a plain
// conversion would make such a value NaN).
inline constexpr double kFloat8E4m3Max = 448.0;

struct Float8Storage {
  int64_t tensors = 0;        // weights converted
  int64_t bytes_before = 0;   // their storage before
  int64_t bytes_after = 0;    // and after
  int64_t saturated = 0;      // weights with values beyond +-448, clamped to it
  int64_t float8_matmuls = 0; // of them, Linear weights that multiply in float8 (--fp8_fast)
};

// Stores the weight of every models::Linear and models::Conv2d under `module` (on its device) as
// float8_e4m3fn, rounded to nearest, and freezes those layers (weight and bias). `scaled`: scaled
// float8, the scales a buffer of the layer ("scale_weight", musubi-tuner's name) that moves with
// it. Move the module to its device afterwards with a device-only .to(device): a .to(dtype)
// converts the float8 weights back (and the scales to that dtype). `matmul_in_float8` (with
// `scaled`; --fp8_fast): every Linear's weight takes row scales and multiplies in float8.
Float8Storage store_weights_in_float8(torch::nn::Module& module, bool scaled = false,
                                      bool matmul_in_float8 = false);

}  // namespace lorapipe::models
