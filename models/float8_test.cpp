// Base weights stored in float8 (models/float8.h): the layers compute what torch computes with the
// rounded weight, backward keeps no upcast copy, and storing converts exactly the adaptable
// layers' weights.
#include "models/float8.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "kernels/cuda_device.h"

#include "models/clip_text.h"
#include "models/flux.h"
#include "models/linear.h"
#include "models/lora.h"
#include "models/tensor_memory.h"
#include "models/t5.h"
#include "models/tiny.h"
#include "models/unet.h"

namespace lorapipe::models {
namespace {

// The float8 weight as torch's own layer would hold it: rounded, then widened (exact).
at::Tensor rounded(const at::Tensor& w, c10::ScalarType dtype) {
  return w.to(at::kFloat8_e4m3fn).to(dtype);
}

// Forward and input gradient of a float8 layer against torch's layer on the rounded weight, in
// fp32 and bf16. Linear's forward is the same at::linear call on the same values, so equal bit
// for bit; its backward is the matmul linear's own backward issues. A convolution's input
// gradient is computed here as a transposed convolution, a different kernel from
// convolution_backward's, so its sums may round differently: held to 1e-5 relative in fp32 (a
// few ulps of sums over at most 8 * 3 * 3 = 72 terms), 1e-2 in bf16 (two roundings of 8 bits).
TEST(Float8Weights, LayersComputeWhatTorchComputesWithTheRoundedWeight) {
  torch::manual_seed(3);
  for (const c10::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const double tolerance = dtype == torch::kFloat ? 1e-5 : 1e-2;
    Linear linear(torch::nn::LinearOptions(24, 16));
    at::Tensor w = linear->weight.detach().clone();
    store_weights_in_float8(*linear);
    ASSERT_EQ(linear->weight.scalar_type(), at::kFloat8_e4m3fn);
    linear->bias.set_data(linear->bias.detach().to(dtype));
    const at::Tensor x = torch::randn({2, 5, 24}).to(dtype).requires_grad_(true);
    const at::Tensor y = linear(x);
    const at::Tensor g = torch::randn_like(y);
    y.backward(g);
    const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
    const at::Tensor y_ref = at::linear(x_ref, rounded(w, dtype), linear->bias.detach());
    y_ref.backward(g);
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(y, y_ref)) << "linear forward, " << dtype;
    EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), tolerance, 0)) << "linear input grad";

    // 3x3 with stride 2 over an even and an odd side (the odd one needs no output padding in
    // the transposed convolution, the even one needs one row and column), and a 1x1.
    for (const auto& [kernel, stride, padding, side] :
         std::vector<std::tuple<int, int, int, int>>{{3, 2, 1, 10}, {3, 2, 1, 9}, {3, 1, 1, 7},
                                                     {1, 1, 0, 6}}) {
      Conv2d conv(torch::nn::Conv2dOptions(8, 6, kernel).stride(stride).padding(padding));
      const at::Tensor cw = conv->weight.detach().clone();
      store_weights_in_float8(*conv);
      conv->bias.set_data(conv->bias.detach().to(dtype));
      const at::Tensor in = torch::randn({2, 8, side, side}).to(dtype).requires_grad_(true);
      const at::Tensor out = conv(in);
      const at::Tensor go = torch::randn_like(out);
      out.backward(go);
      const at::Tensor in_ref = in.detach().clone().requires_grad_(true);
      const at::Tensor out_ref =
          at::conv2d(in_ref, rounded(cw, dtype), conv->bias.detach(), stride, padding);
      out_ref.backward(go);
      const std::string what = "conv " + std::to_string(kernel) + "x" + std::to_string(kernel) +
                               " stride " + std::to_string(stride) + " side " +
                               std::to_string(side);
      EXPECT_TRUE(torch::equal(out, out_ref)) << what;
      ASSERT_EQ(in.grad().sizes(), in.sizes()) << what;
      EXPECT_LE(((in.grad() - in_ref.grad()).abs().max() / in_ref.grad().abs().max())
                    .item<double>(),
                tolerance)
          << what << ", " << dtype;
    }
  }
}

// The point of float8 storage: while a graph waits for backward it holds the float8 weights and
// the activations, not a widened copy of every weight. Eight 512x512 layers: each fp32 copy is
// 1 MiB, the activations of a [2, 512] input 4 KiB a layer. The same stack run the way autocast
// runs it (upcast, then at::linear) shows what the measurement sees when copies are kept.
TEST(Float8Weights, BackwardKeepsNoWidenedCopyOfAWeight) {
  TensorMemoryCounter& memory = TensorMemoryCounter::install();
  torch::manual_seed(5);
  std::vector<Linear> layers;
  for (int i = 0; i < 8; ++i) {
    layers.emplace_back(torch::nn::LinearOptions(512, 512).bias(false));
    store_weights_in_float8(*layers.back());
  }
  const int64_t copy_bytes = 512 * 512 * 4;
  auto retained = [&](bool widened) {
    const at::Tensor x = torch::randn({2, 512}).requires_grad_(true);
    const size_t before = memory.alive_bytes();
    at::Tensor y = x;
    for (Linear& l : layers) {
      y = widened ? at::linear(y, l->weight.to(torch::kFloat)) : l(y);
    }
    const auto held = static_cast<int64_t>(memory.alive_bytes() - before);
    y.sum().backward();  // and backward runs through the float8 layers
    EXPECT_TRUE(x.grad().defined() && x.grad().abs().sum().item<double>() > 0);
    return held;
  };
  const int64_t ours = retained(false), autocast_like = retained(true);
  std::printf("[float8] a graph of 8 layers holds %lld bytes (widened copies kept: %lld)\n",
              static_cast<long long>(ours), static_cast<long long>(autocast_like));
  EXPECT_LT(ours, copy_bytes / 4) << "a float8 layer kept a widened weight for backward";
  EXPECT_GE(autocast_like, 8 * copy_bytes) << "the measurement does not see kept copies";
}

// A LoRA over a bf16 layer computes in bf16, as kohya's under autocast: its fp32 tensors are cast
// for the call (rank-sized copies), never the activations. A graph waiting for backward holds
// the layer's output and no fp32 copy of its input (before: a [512, 256] input kept 512 KiB of
// fp32 for down's gradient, and the backward made fp32 copies of the [512, 2560] output's
// gradient); the output is exactly that bf16 computation, and the gradients reach the fp32
// tensors in fp32.
TEST(ModelsLora, ComputesInTheBaseDtypeAndKeepsNoWideCopyOfAnActivation) {
  TensorMemoryCounter& memory = TensorMemoryCounter::install();
  torch::manual_seed(3);
  Linear layer(torch::nn::LinearOptions(256, 2560).bias(false));
  layer->to(torch::kBFloat16);
  layer->weight.requires_grad_(false);
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->down = (torch::randn({4, 256}) * 0.1).requires_grad_(true);
  adapter->up = (torch::randn({2560, 4}) * 0.1).requires_grad_(true);
  adapter->scale = 0.5;
  adapter->training = true;
  layer->lora = adapter;
  const at::Tensor x = torch::randn({512, 256}).to(torch::kBFloat16).requires_grad_(true);
  const size_t before = memory.alive_bytes();
  const at::Tensor y = layer(x);
  const auto held = static_cast<int64_t>(memory.alive_bytes() - before);
  const int64_t output_bytes = y.numel() * 2, input_fp32_bytes = x.numel() * 4;
  std::printf("[lora] a bf16 layer's graph holds %lld bytes beyond its %lld-byte output "
              "(an fp32 copy of the input: %lld)\n",
              static_cast<long long>(held - output_bytes), static_cast<long long>(output_bytes),
              static_cast<long long>(input_fp32_bytes));
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_LT(held - output_bytes, input_fp32_bytes / 4) << "an fp32 copy of the input was kept";
  {
    torch::NoGradGuard no_grad;
    const at::Tensor lx = at::linear(x, adapter->down.to(torch::kBFloat16));
    const at::Tensor expected =
        at::linear(x, layer->weight) + at::linear(lx, adapter->up.to(torch::kBFloat16)) * 0.5;
    EXPECT_TRUE(torch::equal(y, expected)) << "not the bf16 computation";
  }
  y.to(torch::kFloat).square().sum().backward();
  ASSERT_TRUE(adapter->down.grad().defined() && adapter->up.grad().defined());
  EXPECT_EQ(adapter->down.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(adapter->up.grad().scalar_type(), torch::kFloat);
  EXPECT_GT(adapter->up.grad().abs().sum().item<double>(), 0);
  EXPECT_TRUE(x.grad().defined());
}

// kohya's LoRAModule.forward while training: `dropout` zeroes single elements of down's output
// and scales the rest by 1 / (1 - p); `rank_dropout` zeroes whole ranks per sample (the same for
// every token) and scales the update by 1 / (1 - p); `module_dropout` skips the adapter for a
// call; the multiplier scales the update; outside training no dropout acts. The layer is built
// so that the output is the update alone: base weight 0, down(x) = 1 for every token and rank,
// up the identity, scale 0.5, so each output element is 0.5 x its rank's surviving factor.
// Drop fractions are held to 6 standard deviations of their binomial spread.
TEST(ModelsLora, DropoutsAndMultiplierActAsKohyas) {
  torch::manual_seed(5);
  constexpr int64_t kBatch = 64, kTokens = 16, kRank = 8;
  torch::NoGradGuard no_grad;
  Linear layer(torch::nn::LinearOptions(2, kRank).bias(false));
  layer->weight.zero_();
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->down = torch::zeros({kRank, 2});
  adapter->down.select(1, 0).fill_(1);
  adapter->up = torch::eye(kRank);
  adapter->scale = 0.5;
  adapter->dropout = 0.25;
  adapter->rank_dropout = 0.25;
  adapter->module_dropout = 0.5;
  layer->lora = adapter;
  at::Tensor x = torch::zeros({kBatch, kTokens, 2});
  x.select(2, 0).fill_(1);
  auto fraction_zero = [](const at::Tensor& t) {
    return t.eq(0).to(torch::kDouble).mean().item<double>();
  };
  auto only = [](const at::Tensor& t, double a, double b) {
    return (t.eq(a) | t.eq(b)).all().item<bool>();
  };

  // Outside training every dropout is off and the multiplier scales the update.
  EXPECT_TRUE(layer(x).eq(0.5).all().item<bool>());
  adapter->multiplier = 2;
  EXPECT_TRUE(layer(x).eq(1.0).all().item<bool>());
  adapter->multiplier = 1;
  adapter->training = true;

  // dropout alone: per element, 0 or 0.5 / 0.75, a quarter of them 0.
  adapter->rank_dropout = 0;
  adapter->module_dropout = 0;
  at::Tensor y = layer(x);
  EXPECT_TRUE(only(y, 0, 0.5 / 0.75)) << std::get<0>(at::_unique(y.flatten()));
  const double n_elements = kBatch * kTokens * kRank;
  EXPECT_NEAR(fraction_zero(y), 0.25, 6 * std::sqrt(0.25 * 0.75 / n_elements));
  EXPECT_GT((y.amax(1) - y.amin(1)).abs().max().item<double>(), 0) << "not per element";

  // rank_dropout alone: per (sample, rank), the same for every token.
  adapter->dropout = 0;
  adapter->rank_dropout = 0.25;
  y = layer(x);
  EXPECT_TRUE(only(y, 0, 0.5 / 0.75)) << std::get<0>(at::_unique(y.flatten()));
  EXPECT_TRUE(y.eq(y.select(1, 0).unsqueeze(1)).all().item<bool>()) << "a rank differs by token";
  const double n_ranks = kBatch * kRank;
  EXPECT_NEAR(fraction_zero(y.select(1, 0)), 0.25, 6 * std::sqrt(0.25 * 0.75 / n_ranks));

  // module_dropout alone: a call is either the base output (0) or the whole update.
  adapter->rank_dropout = 0;
  adapter->module_dropout = 0.5;
  int skipped = 0;
  constexpr int kCalls = 400;
  for (int i = 0; i < kCalls; ++i) {
    y = layer(x);
    const bool none = y.eq(0).all().item<bool>(), whole = y.eq(0.5).all().item<bool>();
    ASSERT_TRUE(none || whole) << "a call mixed skipped and applied elements";
    skipped += none;
  }
  EXPECT_NEAR(skipped / static_cast<double>(kCalls), 0.5, 6 * std::sqrt(0.25 / kCalls));
}

// Storing converts the weight of every Linear and Conv2d (a LoRA's targets and every other
// projection), each value rounded to nearest, and leaves norms, biases and embeddings in their
// dtype. Values beyond float8's range saturate at +-448 instead of becoming NaN.
TEST(Float8Weights, StoringConvertsEveryLinearAndConvWeightAndNothingElse) {
  torch::manual_seed(11);
  UNet unet(tiny_unet_config());
  ClipTextModel text(tiny_text_config());
  for (torch::nn::Module* module : std::vector<torch::nn::Module*>{unet.get(), text.get()}) {
    std::map<std::string, at::Tensor> before;
    for (const auto& item : module->named_parameters()) {
      before[item.key()] = item.value().detach().clone();
    }
    int64_t layers = 0;
    for (const auto& m : module->modules()) {
      layers +=
          std::dynamic_pointer_cast<LinearImpl>(m) || std::dynamic_pointer_cast<Conv2dImpl>(m);
    }
    const Float8Storage s = store_weights_in_float8(*module);
    EXPECT_EQ(s.tensors, layers);
    EXPECT_EQ(s.saturated, 0);
    EXPECT_EQ(s.bytes_after * 4, s.bytes_before);
    int64_t float8 = 0;
    for (const auto& item : module->named_parameters()) {
      const std::string& name = item.key();
      const at::Tensor& p = item.value();
      if (is_float8(p)) {
        ++float8;
        EXPECT_TRUE(name.ends_with("weight")) << name;
        EXPECT_TRUE(torch::equal(p.to(torch::kFloat), rounded(before[name], torch::kFloat)))
            << name;
      } else {
        EXPECT_EQ(p.scalar_type(), torch::kFloat) << name;
        EXPECT_TRUE(torch::equal(p, before[name])) << name;
      }
    }
    EXPECT_EQ(float8, layers);
  }
  EXPECT_GT(unet->parameters().size(), 0u);

  Linear big(torch::nn::LinearOptions(2, 2));
  {
    torch::NoGradGuard no_grad;
    big->weight.copy_(torch::tensor({{1000.0f, -1000.0f}, {0.5f, 448.0f}}));
  }
  const Float8Storage s = store_weights_in_float8(*big);
  EXPECT_EQ(s.saturated, 1);
  EXPECT_TRUE(torch::equal(big->weight.to(torch::kFloat),
                           torch::tensor({{448.0f, -448.0f}, {0.5f, 448.0f}})));
  // Stored once, a second call finds nothing left to convert.
  EXPECT_EQ(store_weights_in_float8(*big).tensors, 0);
}

// Scaled float8 (--fp8_scaled): the scales' layout (per 64 inputs of a row, per row where the
// width is no multiple of 64, per tensor for a convolution), every block's largest magnitude
// stored as float8's 448, and the layer computing exactly what a layer holding the dequantised
// weight computes, forward bit for bit; the input gradient as the plain float8 test holds it.
TEST(Float8Weights, ScaledLayersComputeWhatALayerHoldingTheDequantisedWeightComputes) {
  torch::manual_seed(21);
  for (const c10::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const double tolerance = dtype == torch::kFloat ? 1e-5 : 1e-2;
    for (const auto& [in, out, blocks] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{128, 48, 2}, {24, 16, 0}}) {
      Linear linear(torch::nn::LinearOptions(in, out));
      {
        torch::NoGradGuard no_grad;
        linear->weight.mul_(torch::rand({out, 1}) * 4);  // rows of different magnitudes
        linear->weight[3].zero_();                         // an all-zero row: scale 1, zeros
      }
      const at::Tensor w = linear->weight.detach().clone();
      const Float8Storage stored = store_weights_in_float8(*linear, /*scaled=*/true);
      ASSERT_EQ(linear->weight.scalar_type(), at::kFloat8_e4m3fn);
      const at::Tensor scale = linear->weight_scale;
      ASSERT_TRUE(scale.defined());
      EXPECT_TRUE(scale.is_same(linear->named_buffers()["scale_weight"]));
      EXPECT_EQ(stored.saturated, 0);
      EXPECT_EQ(stored.bytes_after, out * in + static_cast<int64_t>(scale.nbytes()));
      if (blocks > 0) {
        EXPECT_EQ(scale.sizes(), (std::vector<int64_t>{out, blocks, 1}));
      } else {
        EXPECT_EQ(scale.sizes(), (std::vector<int64_t>{out, 1}));
      }
      // Each scale widened over the inputs it covers.
      const at::Tensor full =
          blocks > 0 ? scale.expand({out, blocks, kFloat8ScaleBlock}).reshape({out, in})
                     : scale.expand({out, in});
      const at::Tensor w8 = linear->weight.to(torch::kFloat);
      EXPECT_TRUE(torch::equal(linear->weight, (w / full).to(at::kFloat8_e4m3fn)))
          << "float8(weight / scale)";
      const at::Tensor peak = (blocks > 0 ? w8.view({out, blocks, kFloat8ScaleBlock}).abs().amax(2)
                                          : w8.abs().amax(1, true));
      for (int64_t r = 0; r < out; ++r) {
        const double expected = r == 3 ? 0.0 : kFloat8E4m3Max;
        EXPECT_TRUE(torch::all(peak[r] == expected).item<bool>()) << "row " << r << ": " << peak[r];
      }
      linear->bias.set_data(linear->bias.detach().to(dtype));
      const at::Tensor dequantised = (w8 * full).to(dtype);
      const at::Tensor x = torch::randn({2, 5, in}).to(dtype).requires_grad_(true);
      const at::Tensor y = linear(x);
      const at::Tensor g = torch::randn_like(y);
      y.backward(g);
      const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
      const at::Tensor y_ref = at::linear(x_ref, dequantised, linear->bias.detach());
      y_ref.backward(g);
      EXPECT_TRUE(torch::equal(y, y_ref)) << "scaled linear " << in << ", " << dtype;
      EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), tolerance, 0)) << "input grad " << in;
      // Moving the layer moves its scales; the member and the buffer stay one tensor.
      linear->to(torch::Device(torch::kCPU));
      EXPECT_TRUE(linear->weight_scale.is_same(linear->named_buffers()["scale_weight"]));
      // Widened and stored again (the trainer's tries at a cache's fingerprint), the layer keeps
      // one buffer, which takes the new scales.
      {
        torch::NoGradGuard no_grad;
        linear->to(torch::kFloat);
        linear->weight.copy_(w * 2);
      }
      store_weights_in_float8(*linear, /*scaled=*/true);
      EXPECT_EQ(linear->named_buffers().size(), 1u);
      EXPECT_TRUE(linear->weight_scale.is_same(linear->named_buffers()["scale_weight"]));
      EXPECT_TRUE(torch::equal(linear->weight_scale, float8_scales(w * 2)));
    }
    Conv2d conv(torch::nn::Conv2dOptions(8, 6, 3).stride(2).padding(1));
    const at::Tensor cw = conv->weight.detach().clone();
    store_weights_in_float8(*conv, /*scaled=*/true);
    ASSERT_EQ(conv->weight_scale.dim(), 0) << "a convolution has one scale";
    EXPECT_EQ(conv->weight.to(torch::kFloat).abs().max().item<double>(), kFloat8E4m3Max);
    conv->bias.set_data(conv->bias.detach().to(dtype));
    const at::Tensor in = torch::randn({2, 8, 10, 10}).to(dtype).requires_grad_(true);
    const at::Tensor out = conv(in);
    const at::Tensor go = torch::randn_like(out);
    out.backward(go);
    const at::Tensor in_ref = in.detach().clone().requires_grad_(true);
    const at::Tensor out_ref =
        at::conv2d(in_ref, (conv->weight.to(torch::kFloat) * conv->weight_scale).to(dtype),
                   conv->bias.detach(), 2, 1);
    out_ref.backward(go);
    EXPECT_TRUE(torch::equal(out, out_ref)) << "scaled conv, " << dtype;
    EXPECT_LE(((in.grad() - in_ref.grad()).abs().max() / in_ref.grad().abs().max()).item<double>(),
              tolerance);
  }
}

// --fp8_fast: a Linear stored with float8 matmuls holds float8(weight / row scale) with one scale
// per output row, and computes (float8 input times its row scale) by (float8 weight times its
// row scale): checked against that product written out here in float64 from torch's own float8
// rounding. In fp32 the only difference is the order of the fp32 sums over at most 128 terms
// (held to 1e-5 of the output's largest magnitude); in bf16 the output's one rounding to 8 bits
// as well (held to 1e-2). Its input gradient is the dequantising layer's (the same matmul on the
// same dequantised weight), so equal to at::linear's backward within the float8 tests' tolerances.
// A layer whose widths are not multiples of 16 (_scaled_mm's rule) widens its weight: bit for bit
// the --fp8_scaled layer. A convolution under the option keeps its one scale and its widening.
TEST(Float8Weights, FastLayersMultiplyTheirInputsAndWeightsInFloat8) {
  torch::manual_seed(34);
  for (const c10::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const double tolerance = dtype == torch::kFloat ? 1e-5 : 1e-2;
    for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{128, 48}, {24, 40}}) {
      Linear linear(torch::nn::LinearOptions(in, out));
      {
        torch::NoGradGuard no_grad;
        linear->weight.mul_(torch::rand({out, 1}) * 4);
        linear->weight[3].zero_();
      }
      const at::Tensor w = linear->weight.detach().clone();
      const Float8Storage stored = store_weights_in_float8(*linear, /*scaled=*/true, /*fast=*/true);
      EXPECT_TRUE(linear->float8_matmul);
      EXPECT_EQ(stored.float8_matmuls, 1);
      const at::Tensor scale = linear->weight_scale;
      ASSERT_EQ(scale.sizes(), (std::vector<int64_t>{out, 1})) << "one scale per row";
      EXPECT_TRUE(torch::equal(scale, float8_row_scales(w)));
      EXPECT_TRUE(torch::equal(linear->weight, (w / scale).to(at::kFloat8_e4m3fn)));
      EXPECT_EQ(scale[3].item<float>(), 1.0f) << "an all-zero row keeps scale 1";
      linear->bias.set_data(linear->bias.detach().to(dtype));
      at::Tensor x = torch::randn({2, 5, in});
      x[1][2].zero_();  // an all-zero input row: scale 1, zeros
      x = x.mul(torch::rand({2, 5, 1}) * 8).to(dtype).requires_grad_(true);
      const at::Tensor y = linear(x);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 5, out}));
      ASSERT_EQ(y.scalar_type(), dtype);
      const at::Tensor dequantised = (linear->weight.to(torch::kFloat) * scale).to(dtype);
      const at::Tensor bias = linear->bias.detach();
      if (in % 16 == 0 && out % 16 == 0) {
        // The product written out: each input row scaled to 448 at its largest magnitude,
        // rounded to float8 by torch's own cast, then widened.
        const at::Tensor x64 = x.detach().to(torch::kDouble).reshape({-1, in});
        at::Tensor xs = x64.abs().amax(1, true) / kFloat8E4m3Max;
        xs = torch::where(xs > 0, xs, torch::ones_like(xs));
        const at::Tensor xq = (x64 / xs).to(torch::kFloat).to(at::kFloat8_e4m3fn).to(torch::kDouble);
        const at::Tensor wq = linear->weight.to(torch::kDouble) * scale.to(torch::kDouble);
        const at::Tensor expected =
            (at::matmul(xq * xs, wq.t()) + bias.to(torch::kDouble)).reshape({2, 5, out});
        const double error = ((y.to(torch::kDouble) - expected).abs().max() /
                              expected.abs().max()).item<double>();
        EXPECT_LE(error, tolerance) << in << "x" << out << ", " << dtype;
        // And it is not the widening path: the inputs were rounded to float8.
        EXPECT_FALSE(torch::equal(y, at::linear(x.detach(), dequantised, bias)));
        EXPECT_TRUE(torch::all(y[1][2] == bias.to(y.scalar_type())).item<bool>())
            << "a zero input row gives the bias";
      } else {
        EXPECT_TRUE(torch::equal(y, at::linear(x.detach(), dequantised, bias)))
            << in << "x" << out << ": widths _scaled_mm does not take widen the weight";
      }
      const at::Tensor g = torch::randn_like(y);
      y.backward(g);
      const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
      at::linear(x_ref, dequantised, bias).backward(g);
      EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), tolerance, 0)) << "input grad " << in;
    }
  }
  Conv2d conv(torch::nn::Conv2dOptions(8, 16, 3).padding(1));
  const Float8Storage stored = store_weights_in_float8(*conv, true, true);
  EXPECT_EQ(stored.float8_matmuls, 0);
  EXPECT_EQ(conv->weight_scale.dim(), 0) << "a convolution keeps one scale";
  EXPECT_THROW(store_weights_in_float8(*Linear(torch::nn::LinearOptions(16, 16)), false, true),
               c10::Error)
      << "float8 matmuls without scales";
}

// On a CUDA device with float8 matrix units (tests/gpu/run.sh): the row-wise scaled _scaled_mm in
// bf16 computes the CPU's product (the same float8 operands and scales, summed in fp32, rounded
// once to bf16: held to 1e-2 of the output's largest magnitude, bf16's rounding plus the sums'
// order), and its time against the widening path on FLUX.1's widest projections at 1024^2 (4096
// image and 512 text tokens) is printed.
TEST(Float8Weights, FastOnCudaComputesTheCpusProductAndIsTimed) {
  if (kernels::cuda_device_count() == 0) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  if (!float8_matmul_supported(cuda)) {
    GTEST_SKIP() << kernels::cuda_device_name(0) << " has no float8 matrix units";
  }
  torch::NoGradGuard no_grad;
  torch::manual_seed(35);
  for (const auto& [tokens, in, out] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {4608, 3072, 9216}, {4608, 3072, 21504}, {4608, 15360, 3072}}) {
    const at::Tensor w = (torch::rand({out, in}) * 2 - 1) / std::sqrt(static_cast<double>(in));
    const at::Tensor scale = float8_row_scales(w);
    const at::Tensor wq = quantize_float8(w, scale);
    const at::Tensor bias = torch::randn({out}).to(torch::kBFloat16);
    const at::Tensor x = torch::randn({1, tokens, in}).to(torch::kBFloat16);
    const at::Tensor on_cpu = float8_matmul(x, wq, scale, bias);
    const at::Tensor wq_d = wq.to(cuda), scale_d = scale.to(cuda), bias_d = bias.to(cuda);
    const at::Tensor x_d = x.to(cuda);
    const at::Tensor on_cuda = float8_matmul(x_d, wq_d, scale_d, bias_d);
    const double error = ((on_cuda.cpu().to(torch::kFloat) - on_cpu.to(torch::kFloat)).abs().max() /
                          on_cpu.to(torch::kFloat).abs().max()).item<double>();
    EXPECT_LE(error, 1e-2) << in << "x" << out;
    // Against bf16 weights and inputs (the error both float8 paths make):
    const at::Tensor ref =
        at::linear(x_d, w.to(cuda).to(torch::kBFloat16), bias_d).to(torch::kFloat);
    const at::Tensor widened = float8_linear(x_d, wq_d, bias_d, scale_d, false);
    auto relative = [&](const at::Tensor& y) {
      return ((y.to(torch::kFloat) - ref).norm() / ref.norm()).item<double>();
    };
    auto time = [&](auto&& f) {
      for (int i = 0; i < 3; ++i) f();
      torch::cuda::synchronize();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < 20; ++i) f();
      torch::cuda::synchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                 .count() / 20;
    };
    const double fast_ms = time([&] { return float8_matmul(x_d, wq_d, scale_d, bias_d); });
    const double widen_ms = time([&] { return float8_linear(x_d, wq_d, bias_d, scale_d, false); });
    const at::Tensor w_bf16 = w.to(cuda).to(torch::kBFloat16);
    const double bf16_ms = time([&] { return at::linear(x_d, w_bf16, bias_d); });
    std::printf("[float8] %s %lldx%lld by %lld tokens: float8 matmul %.3f ms, widened scaled float8 "
                "%.3f ms (%.2fx), bf16 weights %.3f ms; error against bf16: float8 matmul %.4f, "
                "widened %.4f; CUDA against the CPU's product %.2g\n",
                kernels::cuda_device_name(0).c_str(), static_cast<long long>(out),
                static_cast<long long>(in), static_cast<long long>(tokens), fast_ms, widen_ms,
                widen_ms / fast_ms, bf16_ms, relative(on_cuda), relative(widened), error);
  }
  // SDXL's proj_in at batch 1 hands the layer a column-major view of its permuted feature map;
  // sm90's _scaled_mm takes only a row-major first operand, so the layer must lay it out first.
  const int64_t channels = 640;
  const at::Tensor w = (torch::rand({channels, channels}) * 2 - 1) / std::sqrt(640.0);
  const at::Tensor scale = float8_row_scales(w).to(cuda);
  const at::Tensor wq = quantize_float8(w.to(cuda), scale);
  const at::Tensor map = torch::randn({1, channels, 32, 32}).to(torch::kBFloat16).to(cuda);
  const at::Tensor view = map.permute({0, 2, 3, 1}).reshape({1, 32 * 32, channels});
  ASSERT_FALSE(view.reshape({-1, channels}).is_contiguous());
  EXPECT_TRUE(at::equal(float8_matmul(view, wq, scale, {}),
                        float8_matmul(view.contiguous(), wq, scale, {})));
}

// The error of plain and scaled float8 against the bf16 weights, over every Linear and Conv2d
// shape of each family's tiny model and over its full-width layers (at their widths, with torch's
// default initialisation U(+-1/sqrt(fan_in)): no trained weights here). Each layer gets a random
// input; the error is |y - y_bf16| / |y_bf16| with every product in fp32, so it is the weights'
// rounding alone. Printed per family. At full width the weights (+-1/sqrt(3072) = 0.018 for
// FLUX.1, as trained ones: most entries near 0.02) sit inside float8's subnormal range, where a
// plain cast keeps one or two bits: scaled must be the smaller on average and at the worst layer.
// A tiny layer's weights (+-1/sqrt(32) and wider) sit in float8's normal range, where both keep
// its 3 mantissa bits and their average errors agree up to the draw: there scaled must be the
// smaller at the worst layer (each row's peak lands on 448 exactly, no row loses a binade) and
// within 5% of plain on average. The same for --fp8_fast's float8 matmuls on every Linear whose
// widths _scaled_mm takes (multiples of 16), printed beside them.
TEST(Float8Weights, ScaledErrorIsBelowPlainOnEveryFamilysLayers) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  struct Shape {
    int64_t out, in, kernel;  // kernel 0: a Linear
  };
  auto shapes_of = [](torch::nn::Module& m) {
    std::vector<Shape> out;
    for (const auto& layer : m.modules()) {
      if (auto l = std::dynamic_pointer_cast<LinearImpl>(layer)) {
        out.push_back({l->options.out_features(), l->options.in_features(), 0});
      } else if (auto c = std::dynamic_pointer_cast<Conv2dImpl>(layer)) {
        out.push_back({c->options.out_channels(), c->options.in_channels(),
                       (*c->options.kernel_size())[0]});
      }
    }
    return out;
  };
  auto measure = [](const std::string& family, const std::vector<Shape>& shapes,
                    bool full_width) {
    double plain_sum = 0, scaled_sum = 0, plain_worst = 0, scaled_worst = 0;
    double fast_sum = 0, fast_worst = 0;
    int64_t fast_layers = 0;
    for (const Shape& s : shapes) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(s.in * std::max<int64_t>(s.kernel * s.kernel, 1)));
      const std::vector<int64_t> wshape =
          s.kernel == 0 ? std::vector<int64_t>{s.out, s.in}
                        : std::vector<int64_t>{s.out, s.in, s.kernel, s.kernel};
      const at::Tensor w = ((torch::rand(wshape) * 2 - 1) * bound).to(torch::kBFloat16).to(torch::kFloat);
      const at::Tensor x = s.kernel == 0 ? torch::randn({8, s.in}) : torch::randn({1, s.in, 8, 8});
      auto apply = [&](const at::Tensor& weight) {
        return s.kernel == 0 ? at::linear(x, weight) : at::conv2d(x, weight, {}, 1, s.kernel / 2);
      };
      const at::Tensor ref = apply(w);
      auto error = [&](const at::Tensor& weight) {
        return ((apply(weight) - ref).norm() / ref.norm()).item<double>();
      };
      const double plain = error(w.to(at::kFloat8_e4m3fn).to(torch::kFloat));
      const at::Tensor scale = float8_scales(w);
      const double scaled = error(dequantize_float8(quantize_float8(w, scale), scale, torch::kFloat));
      plain_sum += plain, scaled_sum += scaled;
      plain_worst = std::max(plain_worst, plain), scaled_worst = std::max(scaled_worst, scaled);
      if (s.kernel == 0 && s.in % 16 == 0 && s.out % 16 == 0) {
        // --fp8_fast: row-scaled weights, and the input rounded to float8 too.
        const at::Tensor rows = float8_row_scales(w);
        const at::Tensor y = float8_matmul(x, quantize_float8(w, rows), rows, {});
        const double fast = ((y - ref).norm() / ref.norm()).item<double>();
        fast_sum += fast, fast_worst = std::max(fast_worst, fast), ++fast_layers;
      }
    }
    const double n = static_cast<double>(shapes.size());
    std::printf("[float8] %-22s %3zu layers: plain float8 error mean %.4f worst %.4f; scaled "
                "mean %.4f worst %.4f; %lld Linear layers in float8 matmuls (--fp8_fast) mean "
                "%.4f worst %.4f\n",
                family.c_str(), shapes.size(), plain_sum / n, plain_worst, scaled_sum / n,
                scaled_worst, static_cast<long long>(fast_layers),
                fast_sum / std::max<double>(fast_layers, 1), fast_worst);
    EXPECT_LT(scaled_worst, plain_worst) << family;
    // --fp8_fast rounds the input to float8 as well as the (row-scaled) weight: two independent
    // roundings of the size scaled float8's one, so about sqrt(2) = 1.41 times its error
    // (measured 1.40 to 1.47 per family); held to 1.6 of it, which a scale applied wrongly or
    // an input rounded per tensor instead of per row would exceed.
    ASSERT_GT(fast_layers, 0) << family;
    EXPECT_LT(fast_sum / fast_layers, 1.6 * scaled_sum / n) << family;
    if (full_width) {
      EXPECT_LT(scaled_sum, plain_sum) << family;
    } else {
      EXPECT_LT(scaled_sum, 1.05 * plain_sum) << family;
    }
  };
  UNet sd15(tiny_unet_config());
  measure("SD1.5 tiny U-Net", shapes_of(*sd15), false);
  UNet sdxl(tiny_sdxl_unet_config());
  measure("SDXL tiny U-Net", shapes_of(*sdxl), false);
  ClipTextModel clip(tiny_text_config());
  measure("CLIP tiny", shapes_of(*clip), false);
  FluxConfig flux_config;
  flux_config.hidden_size = 64, flux_config.num_heads = 2, flux_config.axes_dim = {8, 12, 12};
  flux_config.depth = 1, flux_config.depth_single_blocks = 1, flux_config.context_in_dim = 32;
  flux_config.vec_in_dim = 32;
  FluxTransformer flux(flux_config, at::TensorOptions().dtype(at::kFloat));
  measure("FLUX.1 tiny", shapes_of(*flux), false);
  T5Config t5_config;
  t5_config.vocab_size = 100, t5_config.d_model = 32, t5_config.d_kv = 8, t5_config.d_ff = 48;
  t5_config.num_layers = 2, t5_config.num_heads = 4;
  T5Encoder t5(t5_config, at::TensorOptions().dtype(at::kFloat));
  measure("T5 tiny", shapes_of(*t5), false);
  // Full width: the layers that hold most of each family's weights.
  measure("SD1.5 full width", {{320, 320, 0}, {320, 768, 0}, {10240, 1280, 0}, {1280, 5120, 0},
                               {1280, 320, 0}, {320, 320, 3}, {1280, 1280, 3}},
          true);
  measure("SDXL full width", {{10240, 1280, 0}, {1280, 5120, 0}, {1280, 2048, 0}, {1280, 2816, 0},
                              {640, 640, 3}},
          true);
  measure("CLIP-L/bigG full width", {{3072, 768, 0}, {768, 768, 0}, {5120, 1280, 0}, {1280, 5120, 0}},
          true);
  measure("FLUX.1 full width", {{9216, 3072, 0}, {21504, 3072, 0}, {3072, 15360, 0},
                                {18432, 3072, 0}, {3072, 4096, 0}, {3072, 64, 0}, {3072, 256, 0}},
          true);
  measure("T5-XXL full width", {{10240, 4096, 0}, {4096, 10240, 0}, {4096, 4096, 0}}, true);
}

}  // namespace
}  // namespace lorapipe::models
