// Block swap (models/block_swap.h) on a FLUX.1 transformer of four double and six single blocks,
// small enough for the CPU and deep enough for kohya's split to swap some of each: with the CPU
// as both device and host, training steps (forward, and backward through gradient
// checkpointing's recompute) and evaluation give exactly what the model without swap gives, no
// more than the ring's two blocks are ever resident, and the copies and waits come in the order
// the design says. The same on CUDA where there is one (tests/gpu/run.sh runs it there).
#include "models/block_swap.h"

#include <gtest/gtest.h>
#include <c10/core/StreamGuard.h>
#include <torch/torch.h>

#if __has_include(<ATen/cuda/Sleep.h>)
#include <ATen/cuda/Sleep.h>
#define LORAPIPE_TEST_CUDA_SLEEP 1
#endif

#include <cstdio>
#include <string>
#include <vector>

#include "common/error.h"
#include "models/flux.h"
#include "models/lora.h"
#include "models/pipeline.h"
#include "models/tiny.h"
#include "models/unet.h"

namespace lorapipe::models {
namespace {

// A device for sizing alone: weights on the meta device stay there, slots take no memory.
class MetaSwapDevice : public SwapDevice {
 public:
  std::string name() const override { return "meta"; }
  at::Tensor host(const at::Tensor& weight) override { return weight.detach(); }
  at::Tensor slot(int64_t bytes) override {
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
  }
  void copy(const at::Tensor&, const at::Tensor&) override {}
  void record_copied(int) override {}
  void wait_copied(int) override {}
  void record_used(int) override {}
  void wait_used(int) override {}
};

FluxConfig small_flux() {
  FluxConfig c;
  c.in_channels = 16, c.vec_in_dim = 8, c.context_in_dim = 12, c.hidden_size = 32;
  c.num_heads = 2, c.axes_dim = {4, 6, 6}, c.depth = 4, c.depth_single_blocks = 6;
  return c;
}

// The same weights every call (the constructor leaves them uninitialised), and a LoRA adapter on
// every Linear with a non-zero up, so every block trains and its input gradient is not zero.
FluxTransformer make_model(c10::Device device) {
  torch::manual_seed(3);
  FluxTransformer model(small_flux(), at::TensorOptions().dtype(at::kFloat));
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    p.normal_(0, 0.2);
    p.requires_grad_(false);
  }
  for (const auto& m : model->modules()) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(m);
    if (!linear) continue;
    auto adapter = std::make_shared<LoraAdapter>();
    const int64_t in = linear->options.in_features(), out = linear->options.out_features();
    adapter->down = torch::randn({2, in}) * 0.1;
    adapter->up = torch::randn({out, 2}) * 0.1;
    adapter->scale = 0.5;
    linear->lora = adapter;
  }
  return model;
}

// Adapters to the device and trainable, after the model moved (as the trainer places them).
void place_adapters(FluxTransformer& model, c10::Device device) {
  for (const auto& m : model->modules()) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) {
      linear->lora->down = linear->lora->down.to(device).requires_grad_(true);
      linear->lora->up = linear->lora->up.to(device).requires_grad_(true);
    }
  }
}

FluxInput make_input(c10::Device device, int seed) {
  torch::manual_seed(seed);
  const auto f = at::TensorOptions().device(device);
  FluxInput in;
  in.img = torch::randn({2, 16, 16}, f);  // 4x4 packed tokens
  in.img_ids = torch::zeros({16, 3}, f);
  for (int64_t i = 0; i < 16; ++i) {
    in.img_ids[i][1] = static_cast<double>(i / 4);
    in.img_ids[i][2] = static_cast<double>(i % 4);
  }
  in.txt = torch::randn({2, 5, 12}, f);
  in.txt_ids = torch::zeros({5, 3}, f);
  in.timesteps = torch::tensor({0.3, 0.8}, f);
  in.y = torch::randn({2, 8}, f);
  in.guidance = torch::tensor({3.5, 3.5}, f);
  return in;
}

struct StepResult {
  std::vector<at::Tensor> outputs, grads;
};

// Two training steps (forward, loss, backward; the adapters' gradients kept), then an evaluation
// forward under no-grad.
StepResult steps(FluxTransformer& model) {
  const c10::Device device = model->img_in->weight.device();
  StepResult r;
  std::vector<at::Tensor> adapters;
  for (const auto& m : model->modules()) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) {
      adapters.push_back(linear->lora->down);
      adapters.push_back(linear->lora->up);
    }
  }
  for (int step = 0; step < 2; ++step) {
    const at::Tensor out = model(make_input(device, 10 + step));
    r.outputs.push_back(out.detach().cpu());
    out.square().mean().backward();
    for (at::Tensor& a : adapters) {
      if (!a.grad().defined()) {  // its module dropped for the step (module_dropout)
        r.grads.push_back(torch::zeros(a.sizes()));
        continue;
      }
      r.grads.push_back(a.grad().detach().cpu().clone());
      a.mutable_grad().zero_();
    }
  }
  torch::NoGradGuard no_grad;
  r.outputs.push_back(model(make_input(device, 20)).cpu());
  return r;
}

void expect_identical(const StepResult& a, const StepResult& b) {
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.outputs.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.outputs[i], b.outputs[i])) << "output " << i;
  }
  size_t nonzero = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
    nonzero += a.grads[i].abs().sum().item<double>() > 0;
  }
  EXPECT_EQ(nonzero, a.grads.size()) << "every adapter learns: the comparison is not of zeros";
}

// The run without swap against the one with `n` swapped, on `device`; returns the swap.
std::shared_ptr<BlockSwap> compare(c10::Device device, int n,
                                   std::unique_ptr<SwapDevice> swap_device = nullptr) {
  if (!swap_device) swap_device = make_swap_device(device);
  FluxTransformer plain = make_model(device);
  plain->to(device);
  place_adapters(plain, device);
  plain->gradient_checkpointing = true;
  FluxTransformer swapped = make_model(device);
  const auto blocks = flux_swapped_blocks(n, 4, 6);
  swapped->block_swap =
      std::make_shared<BlockSwap>(swapped->blocks(), blocks, std::move(swap_device));
  swapped->to(device);
  place_adapters(swapped, device);
  swapped->gradient_checkpointing = true;
  swapped->block_swap->set_trace(true);
  expect_identical(steps(plain), steps(swapped));
  return swapped->block_swap;
}

// CUDA's pinned host copies go into arenas of a power of two (what LibTorch's pinned allocator
// rounds to): as small as what remains to place, 1 MiB at least, 1 GiB at most.
TEST(BlockSwap, PinnedArenasFitWhatRemainsInPowersOfTwo) {
  const int64_t mib = int64_t{1} << 20;
  EXPECT_EQ(pinned_arena_bytes(100 * mib, 0), 128 * mib);
  EXPECT_EQ(pinned_arena_bytes(100 * mib, 60 * mib), 256 * mib);
  EXPECT_EQ(pinned_arena_bytes(132 * mib, 20000 * mib), 1024 * mib) << "capped";
  EXPECT_EQ(pinned_arena_bytes(mib / 4, 0), mib) << "at least 1 MiB";
  EXPECT_EQ(pinned_arena_bytes(3 * mib, mib), 4 * mib);
}

// kohya's split: n / 2 double blocks and (n - n / 2) * 2 single blocks, the last of each list;
// two of each stay. FLUX.1's 19 and 38 blocks take at most 35.
TEST(BlockSwap, FluxSplitIsKohyas) {
  const std::vector<size_t> eight = flux_swapped_blocks(8, 19, 38);
  ASSERT_EQ(eight.size(), 4u + 8u);
  EXPECT_EQ(eight.front(), 15u);   // double 15..18
  EXPECT_EQ(eight[4], 19u + 30u);  // single 30..37
  EXPECT_EQ(eight.back(), 19u + 37u);
  EXPECT_EQ(flux_swapped_blocks(35, 19, 38).size(), 17u + 36u);
  EXPECT_TRUE(flux_swapped_blocks(0, 19, 38).empty());
  try {
    (void)flux_swapped_blocks(36, 19, 38);
    ADD_FAILURE() << "36 blocks were taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("at most 35"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)flux_swapped_blocks(1, 1, 2), InputError);  // the tiny model swaps none
}

// The CPU as device and host: bit-identical training steps and evaluation, at most the ring's
// two blocks resident, and every block not in a slot holding no weights.
TEST(BlockSwap, OnTheCpuStepsAreBitIdenticalAndTheRingBoundsResidency) {
  const auto swap = compare(c10::Device(c10::kCPU), 4);  // doubles 2, 3; singles 2..5 (6..9)
  EXPECT_EQ(swap->swapped_count(), 6u);
  EXPECT_EQ(swap->max_resident(), 2);
  EXPECT_GT(swap->host_bytes(), 0);
  EXPECT_LE(swap->slot_bytes() * 2, swap->host_bytes()) << "two slots hold less than six blocks";
}

// The protocol on one training step of four double and six single blocks (swapped: 2, 3 and
// 6..9), two slots: a demand load for the first, then each block waits for its copy and starts
// the next one's into the other slot once the block last there is done with it; backward
// (the recompute) walks the same ring the other way, starting from the two blocks forward left.
TEST(BlockSwap, CopiesAndWaitsComeInTheDesignsOrder) {
  FluxTransformer model = make_model(c10::Device(c10::kCPU));
  model->block_swap = std::make_shared<BlockSwap>(model->blocks(), flux_swapped_blocks(4, 4, 6),
                                                  make_swap_device(c10::Device(c10::kCPU)));
  place_adapters(model, c10::Device(c10::kCPU));
  model->gradient_checkpointing = true;
  BlockSwap& swap = *model->block_swap;
  swap.set_trace(true);
  const at::Tensor out = model(make_input(c10::Device(c10::kCPU), 1));
  std::vector<std::string> forward;
  for (const SwapEvent& e : swap.trace()) forward.push_back(e.str());
  const std::vector<std::string> expected_forward{
      "load 2 -> slot 0",        "wait copied 2 in slot 0", "prefetch 3 -> slot 1",
      "used 2 in slot 0",        "wait copied 3 in slot 1", "wait used slot 0 by 2",
      "evict 2 from slot 0",     "prefetch 6 -> slot 0",    "used 3 in slot 1",
      "wait copied 6 in slot 0", "wait used slot 1 by 3",   "evict 3 from slot 1",
      "prefetch 7 -> slot 1",    "used 6 in slot 0",        "wait copied 7 in slot 1",
      "wait used slot 0 by 6",   "evict 6 from slot 0",     "prefetch 8 -> slot 0",
      "used 7 in slot 1",        "wait copied 8 in slot 0", "wait used slot 1 by 7",
      "evict 7 from slot 1",     "prefetch 9 -> slot 1",    "used 8 in slot 0",
      "wait copied 9 in slot 1", "used 9 in slot 1"};
  EXPECT_EQ(forward, expected_forward);
  swap.clear_trace();
  out.square().mean().backward();
  std::vector<std::string> backward;
  for (const SwapEvent& e : swap.trace()) backward.push_back(e.str());
  const std::vector<std::string> expected_backward{
      "wait copied 9 in slot 1", "used 9 in slot 1",        "wait copied 8 in slot 0",
      "wait used slot 1 by 9",   "evict 9 from slot 1",     "prefetch 7 -> slot 1",
      "used 8 in slot 0",        "wait copied 7 in slot 1", "wait used slot 0 by 8",
      "evict 8 from slot 0",     "prefetch 6 -> slot 0",    "used 7 in slot 1",
      "wait copied 6 in slot 0", "wait used slot 1 by 7",   "evict 7 from slot 1",
      "prefetch 3 -> slot 1",    "used 6 in slot 0",        "wait copied 3 in slot 1",
      "wait used slot 0 by 6",   "evict 6 from slot 0",     "prefetch 2 -> slot 0",
      "used 3 in slot 1",        "wait copied 2 in slot 0", "used 2 in slot 0"};
  EXPECT_EQ(backward, expected_backward);
  // After backward, blocks 2 and 3 are in the slots (the next step's first); a block in none
  // holds nothing a layer could compute with.
  EXPECT_GT(model->double_blocks[3]->as<FluxDoubleBlockImpl>()->img_attn->qkv->weight.numel(), 0);
  EXPECT_EQ(model->single_blocks[5]->as<FluxSingleBlockImpl>()->linear1->weight.numel(), 0);
  // The host copy is where a block in no slot keeps its values (what the trainer's look for NaN
  // reads), the same values a fresh model holds; a weight the swap never took has none.
  FluxTransformer fresh = make_model(c10::Device(c10::kCPU));
  const at::Tensor evicted = model->single_blocks[5]->as<FluxSingleBlockImpl>()->linear1->weight;
  const at::Tensor host = swap.host_copy(evicted);
  ASSERT_TRUE(host.defined());
  EXPECT_TRUE(
      torch::equal(host, fresh->single_blocks[5]->as<FluxSingleBlockImpl>()->linear1->weight));
  EXPECT_FALSE(
      swap.host_copy(model->double_blocks[0]->as<FluxDoubleBlockImpl>()->img_attn->qkv->weight)
          .defined())
      << "double block 0 does not swap";
  EXPECT_FALSE(swap.host_copy(model->img_in->weight).defined());
}

// Training without gradient checkpointing would read a swapped block's weights in backward after
// they left: refused by name rather than computed wrong.
TEST(BlockSwap, TrainingWithoutCheckpointingIsRefused) {
  FluxTransformer model = make_model(c10::Device(c10::kCPU));
  model->block_swap = std::make_shared<BlockSwap>(model->blocks(), flux_swapped_blocks(2, 4, 6),
                                                  make_swap_device(c10::Device(c10::kCPU)));
  place_adapters(model, c10::Device(c10::kCPU));
  try {
    (void)model(make_input(c10::Device(c10::kCPU), 1));
    ADD_FAILURE() << "a swapped block ran for training without checkpointing";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--gradient_checkpointing"), std::string::npos)
        << e.what();
  }
}

// What swap keeps off the device for the full-size FLUX.1 [dev] transformer in bf16, built on
// the meta device (no weights): the swapped blocks' bytes, against kohya's split counted from the
// config (a double block 339.7 M parameters, a single block 141.6 M), and what the device then
// holds of the weights: the rest, plus two slots of the largest swapped block. float8 halves
// every figure. Printed for kohya's tiers.
TEST(BlockSwap, FullSizeFluxBytesAreTheSplitsAnalyticFigures) {
  const FluxConfig config = FluxConfig::dev();
  FluxTransformer model(config, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += static_cast<int64_t>(p.nbytes());
  auto linear_bytes = [](torch::nn::Module& block) {
    int64_t bytes = 0;
    for (const auto& m : block.modules()) {
      if (auto l = std::dynamic_pointer_cast<LinearImpl>(m)) bytes += l->weight.numel() * 2;
    }
    return bytes;
  };
  const int64_t h = config.hidden_size, mlp = config.mlp_hidden();
  // Per stream: modulation (6h), qkv (3h), proj, MLP up and down; single: linear1 (3h + mlp),
  // linear2 (h + mlp -> h), modulation (3h). Weights only, 2 bytes each.
  const int64_t double_bytes = 2 * 2 * (h * 6 * h + h * 3 * h + h * h + 2 * h * mlp);
  const int64_t single_bytes = 2 * (h * (3 * h + mlp) + (h + mlp) * h + h * 3 * h);
  ASSERT_EQ(linear_bytes(*model->double_blocks[0]), double_bytes);
  ASSERT_EQ(linear_bytes(*model->single_blocks[0]), single_bytes);
  for (const int n : {8, 16, 28, 35}) {
    FluxTransformer tier(config, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
    for (auto& p : tier->parameters()) p.requires_grad_(false);  // frozen, as placed
    BlockSwap swap(tier->blocks(), flux_swapped_blocks(n, 19, 38),
                   std::make_unique<MetaSwapDevice>());
    const int64_t doubles = n / 2, singles = (n - n / 2) * 2;
    EXPECT_EQ(swap.host_bytes(), doubles * double_bytes + singles * single_bytes) << n;
    // A slot holds the largest swapped block, each weight aligned to 256 bytes (a few KiB more).
    EXPECT_GE(swap.slot_bytes(), double_bytes);
    EXPECT_LT(swap.slot_bytes(), double_bytes + 64 * 256);
    const int64_t device = total - swap.host_bytes() + 2 * swap.slot_bytes();
    std::printf(
        "[block swap] FLUX.1 [dev] bf16, --blocks_to_swap=%d (%lld double, %lld single): "
        "%.2f GiB to host memory, %.2f GiB of weights on the device (of %.2f GiB)\n",
        n, static_cast<long long>(doubles), static_cast<long long>(singles),
        static_cast<double>(swap.host_bytes()) / (1 << 30), static_cast<double>(device) / (1 << 30),
        static_cast<double>(total) / (1 << 30));
  }
}

// The U-Net families' reading: the transformer blocks of the last N kohya blocks that have any.
// The tiny SD1.5 U-Net has six (IN01, IN02, MID, OUT03-OUT05 at its size); N = 4 swaps those of
// MID and the three OUT blocks. Two checkpointed training steps and an evaluation equal the
// unswapped U-Net's bit for bit, and at most two transformer blocks are ever resident.
TEST(BlockSwap, UNetStepsAreBitIdenticalOnTheCpu) {
  auto make = [](int swap) {
    torch::manual_seed(5);
    auto sd = std::make_unique<StableDiffusion>();
    sd->family = model_family("sd15");
    sd->unet = UNet(tiny_unet_config());
    torch::NoGradGuard no_grad;
    for (auto& p : sd->unet->parameters()) {
      p.normal_(0, 0.1);
      p.requires_grad_(false);
    }
    for (const auto& m : sd->unet->modules()) {
      auto linear = std::dynamic_pointer_cast<LinearImpl>(m);
      if (!linear) continue;
      auto adapter = std::make_shared<LoraAdapter>();
      adapter->down = (torch::randn({2, linear->options.in_features()}) * 0.1).requires_grad_(true);
      adapter->up = (torch::randn({linear->options.out_features(), 2}) * 0.1).requires_grad_(true);
      adapter->scale = 0.5;
      linear->lora = adapter;
    }
    if (swap > 0) sd->enable_block_swap(swap, c10::Device(c10::kCPU), 2);
    sd->unet->gradient_checkpointing = true;
    return sd;
  };
  auto run = [](StableDiffusion& sd) {
    StepResult r;
    std::vector<at::Tensor> adapters;
    for (const auto& m : sd.unet->modules()) {
      if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) {
        adapters.push_back(linear->lora->down);
        adapters.push_back(linear->lora->up);
      }
    }
    const int64_t context = sd.unet->config().cross_attention_dim;
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(30 + step);
      const at::Tensor sample = torch::randn({2, 4, 16, 16});
      const at::Tensor text = torch::randn({2, 7, context});
      if (step == 2) {
        torch::NoGradGuard no_grad;
        r.outputs.push_back(sd.unet(sample, torch::tensor({10, 500}), text));
        break;
      }
      const at::Tensor out = sd.unet(sample, torch::tensor({10, 500}), text);
      r.outputs.push_back(out.detach().clone());
      out.square().mean().backward();
      for (at::Tensor& a : adapters) {
        r.grads.push_back(a.grad().detach().clone());
        a.mutable_grad().zero_();
      }
    }
    return r;
  };
  auto plain = make(0), swapped = make(4);
  expect_identical(run(*plain), run(*swapped));
  ASSERT_TRUE(swapped->unet->block_swap);
  EXPECT_EQ(swapped->unet->block_swap->swapped_count(), 4u);  // one transformer block each
  EXPECT_EQ(swapped->unet->block_swap->max_resident(), 2);
  EXPECT_THROW(make(7), InputError);
}

// Gradient checkpointing's recompute draws the adapters' dropout masks the forward drew
// (models/checkpoint.h): the CPU generator (module dropout's draw) and the inputs' CUDA device's
// (dropout and rank dropout there) are put back around it. A checkpointed model with kohya's
// three dropouts trains as the same model without checkpointing: the same outputs bit for bit
// (the same kernels on the same masks) and the same gradients, to 1e-5 relative: autograd adds
// a weight's terms in its own order through the recompute, float rounding apart; masks drawn
// anew there would change them by their own size. On the CPU here, on CUDA in tests/gpu/run.sh.
TEST(CheckpointDropout, TheRecomputeDrawsTheForwardsMasks) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (torch::cuda::is_available()) devices.emplace_back(c10::kCUDA, 0);
  for (const c10::Device& device : devices) {
    SCOPED_TRACE(device.str());
    StepResult runs[2];
    for (const bool checkpointed : {false, true}) {
      FluxTransformer model = make_model(device);
      model->to(device);
      place_adapters(model, device);
      for (const auto& m : model->modules()) {
        if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) {
          linear->lora->dropout = 0.3;
          linear->lora->rank_dropout = 0.3;
          linear->lora->module_dropout = 0.2;
          linear->lora->training = true;
        }
      }
      model->gradient_checkpointing = checkpointed;
      runs[checkpointed] = steps(model);
    }
    const StepResult& plain = runs[0];
    const StepResult& checkpointed = runs[1];
    ASSERT_EQ(plain.outputs.size(), checkpointed.outputs.size());
    for (size_t i = 0; i < plain.outputs.size(); ++i) {
      EXPECT_TRUE(torch::equal(plain.outputs[i], checkpointed.outputs[i])) << "output " << i;
    }
    ASSERT_EQ(plain.grads.size(), checkpointed.grads.size());
    size_t nonzero = 0;
    for (size_t i = 0; i < plain.grads.size(); ++i) {
      const at::Tensor& a = plain.grads[i];
      const at::Tensor& b = checkpointed.grads[i];
      const double scale = a.abs().max().item<double>();
      if (scale > 0) ++nonzero;
      EXPECT_LE((a - b).abs().max().item<double>(), 1e-5 * scale + 1e-12) << "gradient " << i;
    }
    EXPECT_GT(nonzero, plain.grads.size() / 2);  // dropout leaves most adapters training
  }
}

// kohya's --cpu_offload_checkpointing on CUDA: each checkpointed block's inputs wait for
// backward in pinned host memory; the steps are those without it, bit for bit, with block swap
// as without.
TEST(CheckpointOffload, OnCudaStepsAreBitIdentical) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  for (const int swap : {0, 4}) {
    StepResult runs[2];
    for (const bool offload : {false, true}) {
      FluxTransformer model = make_model(cuda);
      if (swap > 0) {
        model->block_swap = std::make_shared<BlockSwap>(
            model->blocks(), flux_swapped_blocks(swap, 4, 6), make_swap_device(cuda));
      }
      model->to(cuda);
      place_adapters(model, cuda);
      model->gradient_checkpointing = true;
      model->cpu_offload_checkpointing = offload;
      runs[offload] = steps(model);
    }
    expect_identical(runs[0], runs[1]);
  }
}

// On CUDA: pinned host copies, a copy stream and events, the same bit-identical results.
TEST(BlockSwap, OnCudaStepsAreBitIdentical) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const auto swap = compare(c10::Device(c10::kCUDA, 0), 4);
  EXPECT_EQ(swap->max_resident(), 2);
}

#ifdef LORAPIPE_TEST_CUDA_SLEEP
// Every call passed to the CUDA swap device it wraps; the two below hold one side back.
class DelegatingDevice : public SwapDevice {
 public:
  explicit DelegatingDevice(std::unique_ptr<SwapDevice> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  at::Tensor host(const at::Tensor& weight) override { return inner_->host(weight); }
  at::Tensor slot(int64_t bytes) override { return inner_->slot(bytes); }
  void copy(const at::Tensor& dst, const at::Tensor& src) override { inner_->copy(dst, src); }
  void record_copied(int slot) override { inner_->record_copied(slot); }
  void wait_copied(int slot) override { inner_->wait_copied(slot); }
  void record_used(int slot) override { inner_->record_used(slot); }
  void wait_used(int slot) override { inner_->wait_used(slot); }
  void drain() override { inner_->drain(); }
  std::optional<c10::Stream> copy_stream() const override { return inner_->copy_stream(); }

 protected:
  std::unique_ptr<SwapDevice> inner_;
};

// The CUDA swap device with each block's compute held back on the GPU (a few milliseconds of
// spinning on the compute stream once its copy has landed), so the host runs far ahead of the
// GPU: a prefetch that did not wait for the slot's last block to be done with it (wait_used)
// would overwrite weights still to be read, and the steps would differ. On tiny blocks without
// the delay, every kernel is done before the next copy is issued and a missing wait goes unseen.
class SlowComputeDevice : public DelegatingDevice {
 public:
  using DelegatingDevice::DelegatingDevice;
  void wait_copied(int slot) override {
    inner_->wait_copied(slot);
    at::cuda::sleep(10'000'000);  // about 5 ms at 2 GHz, on the current (compute) stream
  }
};

TEST(BlockSwap, OnCudaAComputeFarBehindItsCopiesStepsBitIdentically) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  compare(cuda, 4, std::make_unique<SlowComputeDevice>(make_swap_device(cuda)));
}

// The other way round: each copy held back on the copy stream, so a block's weights land long
// after the host has queued its compute. Compute that did not wait for its slot's copies
// (wait_copied) would read the block before, and the steps would differ.
class SlowCopyDevice : public DelegatingDevice {
 public:
  using DelegatingDevice::DelegatingDevice;
  void copy(const at::Tensor& dst, const at::Tensor& src) override {
    {
      const c10::StreamGuard on_copies(inner_->copy_stream().value());
      at::cuda::sleep(2'000'000);  // about 1 ms at 2 GHz, before each weight's copy
    }
    inner_->copy(dst, src);
  }
};

TEST(BlockSwap, OnCudaCopiesFarBehindTheComputeStepBitIdentically) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  ASSERT_TRUE(make_swap_device(cuda)->copy_stream().has_value());
  compare(cuda, 4, std::make_unique<SlowCopyDevice>(make_swap_device(cuda)));
}
#endif

}  // namespace
}  // namespace lorapipe::models
