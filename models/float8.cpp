#include "models/float8.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>

#include <array>
#include <atomic>
#include <variant>

#include "kernels/cuda_device.h"
#include "models/linear.h"

namespace lorapipe::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Neither function can give a float8 weight or a frozen bias a gradient; saying so loudly beats
// a LoRA that silently stops training because a bias was meant to.
void require_frozen(const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(!weight.requires_grad(), "a float8 weight cannot be trained");
  TORCH_CHECK(!bias.defined() || !bias.requires_grad(),
              "the bias beside a float8 weight is frozen with it");
}

// The bias rides along as a plain argument, not an input of the node: it gets no gradient, and
// the autograd function machinery takes no undefined tensor for a layer without one.
struct FrozenBias {
  at::Tensor tensor;
};

struct Float8Linear : torch::autograd::Function<Float8Linear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const FrozenBias& bias,
                            const FrozenBias& scale, bool matmul_in_float8) {
    ctx->save_for_backward({weight});  // the float8 tensor itself: no copy is kept
    ctx->saved_data["scale"] = scale.tensor.defined() ? c10::IValue(scale.tensor) : c10::IValue();
    if (matmul_in_float8) return float8_matmul(input, weight, scale.tensor, bias.tensor);
    return at::linear(input, dequantize_float8(weight, scale.tensor, input.scalar_type()),
                      bias.tensor);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    const c10::IValue& saved = ctx->saved_data["scale"];
    const at::Tensor scale = saved.isTensor() ? saved.toTensor() : at::Tensor();
    const at::Tensor& grad = grads[0];
    // y = x W^T + b, so dL/dx = dL/dy W: what linear's own backward computes for its input.
    return {at::matmul(grad, dequantize_float8(weight, scale, grad.scalar_type())), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Float8Conv2d : torch::autograd::Function<Float8Conv2d> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const FrozenBias& bias,
                            const FrozenBias& scale, std::vector<int64_t> stride, std::vector<int64_t> padding,
                            std::vector<int64_t> dilation, int64_t groups) {
    ctx->save_for_backward({weight});
    ctx->saved_data["scale"] = scale.tensor.defined() ? c10::IValue(scale.tensor) : c10::IValue();
    ctx->saved_data["input_sizes"] = input.sizes().vec();
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    return at::conv2d(input, dequantize_float8(weight, scale.tensor, input.scalar_type()),
                      bias.tensor, stride, padding, dilation, groups);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    const c10::IValue& saved = ctx->saved_data["scale"];
    const at::Tensor scale = saved.isTensor() ? saved.toTensor() : at::Tensor();
    const at::Tensor& grad = grads[0];
    const auto input_sizes = ctx->saved_data["input_sizes"].toIntVector();
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    // A convolution's input gradient is the transposed convolution of the output gradient with
    // the same weight; output_padding restores the rows and columns a stride > 1 dropped.
    std::vector<int64_t> output_padding(2);
    for (int d = 0; d < 2; ++d) {
      const int64_t kernel = weight.size(2 + d);
      const int64_t out = grad.size(2 + d);
      output_padding[d] = input_sizes[2 + d] - ((out - 1) * stride[d] - 2 * padding[d] +
                                                dilation[d] * (kernel - 1) + 1);
    }
    at::Tensor grad_input =
        at::conv_transpose2d(grad, dequantize_float8(weight, scale, grad.scalar_type()),
                             /*bias=*/{}, stride, padding, output_padding, groups, dilation);
    return {grad_input,  at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The scales that take each row's largest magnitude to 448 (1 for an all-zero row), [rows, 1].
at::Tensor row_scales(const at::Tensor& rows) {
  const at::Tensor scale = rows.detach().to(at::kFloat).abs().amax(/*dim=*/1, /*keepdim=*/true) /
                           kFloat8E4m3Max;
  return at::where(scale > 0, scale, at::ones_like(scale));
}

// Whether _scaled_mm takes per-row scales with a bf16 result on CUDA device `index`: its kernels
// for them (CUTLASS's f8f8bf16_rowwise, cuBLASLt's) cover sm89, sm90 and sm100 alone; on sm110
// and sm120 (RTX 50xx, RTX PRO Blackwell) torch refuses them (pytorch#161236, #192707), where
// the two-step product below, per-tensor unit scales into fp32 and then the row scales, runs.
// Asked once per device: every Linear's call asks.
bool rowwise_scaled_mm(int index) {
  static std::array<std::atomic<int>, 64> known{};  // 0 not asked yet, 1 no, 2 yes
  if (index < 0 || index >= static_cast<int>(known.size())) return false;
  int answer = known[index].load(std::memory_order_relaxed);
  if (answer == 0) {
    const int capability = kernels::cuda_compute_capability(index);
    answer = capability == 89 || (capability >= 90 && capability < 110) ? 2 : 1;
    known[index].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

}  // namespace

at::Tensor float8_row_scales(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "row scales are for a 2-d weight, not ", weight.sizes());
  torch::NoGradGuard no_grad;
  return row_scales(weight);
}

bool float8_matmul_supported(const c10::Device& device) {
  if (device.is_cpu()) return true;
  if (!device.is_cuda()) return false;
  const int index = device.has_index() ? device.index() : at::detail::getCUDAHooks().current_device();
  return kernels::cuda_compute_capability(index) >= 89;
}

at::Tensor float8_matmul(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& row_scale, const at::Tensor& bias) {
  TORCH_CHECK(weight.dim() == 2 && row_scale.dim() == 2 && row_scale.size(0) == weight.size(0) &&
                  row_scale.size(1) == 1,
              "a float8 matmul takes one scale per output row: weight ", weight.sizes(),
              ", scales ", row_scale.sizes());
  const int64_t in = weight.size(1), out = weight.size(0);
  const c10::ScalarType dtype = input.scalar_type();
  // _scaled_mm's rule: both widths multiples of 16. Elsewhere the dequantised weight, as
  // --fp8_scaled computes.
  if (in % 16 != 0 || out % 16 != 0) {
    return at::linear(input, dequantize_float8(weight, row_scale, dtype), bias);
  }
  torch::NoGradGuard no_grad;
  // Contiguous: _scaled_mm on sm90 takes only a row-major first operand, and reshape keeps a
  // view where it can (a batch-1 permute(0,2,3,1) of SDXL's proj_in input is column-major).
  const at::Tensor x = input.reshape({-1, in}).contiguous();
  // The activation's row maxima in its own dtype (exact: a magnitude's maximum rounds nothing),
  // then one widened quotient (on CUDA widened as it is read): two fp32 copies of a whole
  // activation fewer than row_scales and a separate widening made. The same float8 values.
  at::Tensor x_scale = x.abs().amax(/*dim=*/1, /*keepdim=*/true).to(at::kFloat) / kFloat8E4m3Max;
  x_scale = at::where(x_scale > 0, x_scale, at::ones_like(x_scale));  // [tokens, 1]
  const at::Tensor xq =
      at::div(x, x_scale).clamp_(-kFloat8E4m3Max, kFloat8E4m3Max).to(at::kFloat8_e4m3fn);
  const at::Tensor w_scale = row_scale.to(at::kFloat).t().contiguous();  // [1, out]
  at::Tensor y;
  if (input.is_cuda() && dtype == at::kBFloat16 && rowwise_scaled_mm(input.get_device())) {
    // Row-wise scaling in the kernel's epilogue: (xq * x_scale) (wq * w_scale)^T, fp32 sums.
    y = at::_scaled_mm(xq, weight.t(), x_scale, w_scale, /*bias=*/std::nullopt,
                       /*scale_result=*/std::nullopt, at::kBFloat16);
  } else {
    // The same product in two steps: unit scales into fp32, then the row and column scales.
    const at::Tensor one = at::ones({}, x_scale.options());
    y = at::_scaled_mm(xq, weight.t(), one, one, std::nullopt, std::nullopt, at::kFloat);
    y.mul_(x_scale).mul_(w_scale);
    y = y.to(dtype);
  }
  if (bias.defined()) y.add_(bias);
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

at::Tensor float8_scales(const at::Tensor& weight) {
  torch::NoGradGuard no_grad;
  const at::Tensor w = weight.detach().to(at::kFloat).abs();
  at::Tensor amax;
  if (w.dim() == 2 && w.size(1) % kFloat8ScaleBlock == 0) {
    amax = w.view({w.size(0), w.size(1) / kFloat8ScaleBlock, kFloat8ScaleBlock})
               .amax(/*dim=*/2, /*keepdim=*/true);
  } else if (w.dim() == 2) {
    amax = w.amax(/*dim=*/1, /*keepdim=*/true);
  } else {
    amax = w.max();
  }
  // An all-zero block keeps scale 1: its zeros stay zeros, and nothing divides by zero.
  at::Tensor scale = amax / kFloat8E4m3Max;
  return at::where(scale > 0, scale, at::ones_like(scale));
}

at::Tensor quantize_float8(const at::Tensor& weight, const at::Tensor& scale) {
  torch::NoGradGuard no_grad;
  const at::Tensor w = weight.detach().to(at::kFloat);
  const at::Tensor scaled =
      scale.dim() == 3
          ? (w.view({scale.size(0), scale.size(1), kFloat8ScaleBlock}) / scale).view(weight.sizes())
          : w / scale;
  return scaled.clamp(-kFloat8E4m3Max, kFloat8E4m3Max).to(at::kFloat8_e4m3fn);
}

at::Tensor dequantize_float8(const at::Tensor& weight, const at::Tensor& scale,
                             c10::ScalarType dtype) {
  if (!scale.defined()) return weight.to(dtype);
  // Scaled in place in fp32: one fp32 copy of the weight at a time, not two (the largest SD1.5
  // convolution, 29.5 M weights, would hold 236 MB more at the step's peak).
  at::Tensor w = weight.to(at::kFloat);
  if (scale.dim() == 3) {
    w.view({scale.size(0), scale.size(1), kFloat8ScaleBlock}).mul_(scale);
  } else {
    w.mul_(scale);
  }
  return w.to(dtype);
}

at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& scale, bool matmul_in_float8) {
  require_frozen(weight, bias);
  return Float8Linear::apply(input, weight, FrozenBias{bias}, FrozenBias{scale}, matmul_in_float8);
}

at::Tensor float8_conv2d(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const torch::nn::detail::ConvNdOptions<2>& options,
                         const at::Tensor& scale) {
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode()),
              "a float8 convolution pads with zeros only");
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&options.padding());
  TORCH_CHECK(padding != nullptr, "a float8 convolution takes explicit padding only");
  require_frozen(weight, bias);
  auto vec = [](at::IntArrayRef a) { return a.vec(); };
  return Float8Conv2d::apply(input, weight, FrozenBias{bias}, FrozenBias{scale},
                             vec(options.stride()), vec(*padding), vec(options.dilation()),
                             options.groups());
}

Float8Storage store_weights_in_float8(torch::nn::Module& module, bool scaled,
                                      bool matmul_in_float8) {
  TORCH_CHECK(scaled || !matmul_in_float8, "float8 matmuls take scaled float8 weights");
  torch::NoGradGuard no_grad;
  Float8Storage out;
  // `float8_matmul`: a Linear's flag (null for a convolution, which always widens its weight).
  auto store = [&](torch::nn::Module& layer, at::Tensor& weight, at::Tensor& bias,
                   at::Tensor& weight_scale, bool* float8_matmul) {
    if (!weight.defined() || is_float8(weight)) return;
    weight.requires_grad_(false);
    if (bias.defined()) bias.requires_grad_(false);
    ++out.tensors;
    out.bytes_before += static_cast<int64_t>(weight.nbytes());
    if (scaled) {
      // The scale takes each block's (or row's) largest magnitude to 448: nothing saturates.
      const bool rows = matmul_in_float8 && float8_matmul != nullptr && weight.dim() == 2;
      if (float8_matmul != nullptr) *float8_matmul = rows;
      if (rows) ++out.float8_matmuls;
      const at::Tensor scale = rows ? float8_row_scales(weight) : float8_scales(weight);
      weight.set_data(quantize_float8(weight, scale));
      // A layer stored before and widened again (the trainer's tries at the cache's fingerprint)
      // keeps its buffer: it takes the new scales.
      auto buffers = layer.named_buffers(/*recurse=*/false);
      if (at::Tensor* existing = buffers.find("scale_weight")) {
        existing->set_data(scale);
        weight_scale = *existing;
      } else {
        weight_scale = layer.register_buffer("scale_weight", scale);
      }
      out.bytes_after += static_cast<int64_t>(scale.nbytes());
    } else {
      at::Tensor w = weight.detach();
      if (w.abs().max().item<double>() > kFloat8E4m3Max) {
        ++out.saturated;
        w = w.clamp(-kFloat8E4m3Max, kFloat8E4m3Max);
      }
      weight.set_data(w.to(at::kFloat8_e4m3fn));
    }
    out.bytes_after += static_cast<int64_t>(weight.nbytes());
  };
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) {
      store(*linear, linear->weight, linear->bias, linear->weight_scale, &linear->float8_matmul);
    }
    if (auto conv = std::dynamic_pointer_cast<Conv2dImpl>(m)) {
      store(*conv, conv->weight, conv->bias, conv->weight_scale, nullptr);
    }
  }
  return out;
}

}  // namespace lorapipe::models
