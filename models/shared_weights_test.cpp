// Shared weights (models/shared_weights.h) on the CPU, publisher and attachment in one process
// (the memfd is reached through /proc/self/fd as another process reaches it through
// /proc/PID/fd): the attached module's tensors are the publisher's memory, not a copy; what does
// not match is refused by name; a released manifest, or one whose publisher is gone, leaves the
// caller to place its own copy. SamplerWithTrainer.SamplerOverTheTrainersPublishedWeights-
// HoldsNoCopyOfThem runs it across a trainer and a sampler; tests/gpu/run.sh's stage test over
// CUDA IPC.
#include "models/shared_weights.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/error.h"
#include "models/float8.h"
#include "models/linear.h"
#include "models/placement.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl(int64_t width) {
    a = register_module("a", Linear(torch::nn::LinearOptions(64, width)));
    b = register_module("b", Linear(torch::nn::LinearOptions(width, 16)));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::gelu(a(x))); }
  Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoLayers);

class SharedWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("lorapipe_shared_weights_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SharedWeights, AttachedTensorsAreThePublishersMemoryWithItsFloat8AndScales) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(1);
  TwoLayers trainer(32);
  store_weights_in_float8(*trainer, /*scaled=*/true);  // placement's float8, scales as buffers
  const at::Tensor x = torch::randn({3, 64});
  const at::Tensor expected = trainer(x);
  const fs::path manifest = dir_ / "shared.json";
  SharedWeightsPublisher publisher(*trainer, c10::Device(c10::kCPU), manifest, "key");
  EXPECT_EQ(publisher.tensors(), 6);  // 2 weights, 2 biases, 2 scale buffers
  EXPECT_TRUE(torch::equal(trainer(x), expected)) << "the publisher's own tensors kept their values";

  torch::manual_seed(2);  // other values, the same structure
  TwoLayers sampler(32);
  store_weights_in_float8(*sampler, true);
  EXPECT_FALSE(torch::equal(sampler(x), expected));
  const auto attachment =
      attach_shared_weights(*sampler, c10::Device(c10::kCPU), manifest, "key");
  ASSERT_NE(attachment, nullptr);
  EXPECT_EQ(attachment->tensors(), 6);
  EXPECT_TRUE(torch::equal(sampler(x), expected));
  // The scale member and its buffer are still one tensor.
  EXPECT_TRUE(sampler->a->weight_scale.is_same(sampler->a->named_buffers()["scale_weight"]));
  // One memory, not a copy: the publisher's write shows through the attachment.
  trainer->b->bias.add_(1);
  EXPECT_TRUE(torch::equal(sampler->b->bias, trainer->b->bias));
  EXPECT_NE(sampler->b->bias.data_ptr(), trainer->b->bias.data_ptr()) << "two mappings";
}

TEST_F(SharedWeights, WhatDoesNotMatchIsRefusedByName) {
  TwoLayers trainer(32);
  const fs::path manifest = dir_ / "shared.json";
  SharedWeightsPublisher publisher(*trainer, c10::Device(c10::kCPU), manifest, "model A fp32");
  auto refusal = [&](TwoLayers module, const std::string& key) {
    try {
      attach_shared_weights(*module, c10::Device(c10::kCPU), manifest, key);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("attached");
  };
  EXPECT_NE(refusal(TwoLayers(32), "model B fp32").find("'model A fp32', this sampler's of "
                                                        "'model B fp32'"),
            std::string::npos);
  EXPECT_NE(refusal(TwoLayers(48), "model A fp32").find("a.weight is Float [32,64] there"),
            std::string::npos)
      << refusal(TwoLayers(48), "model A fp32");
  TwoLayers half(32);
  half->to(torch::kBFloat16);
  EXPECT_NE(refusal(half, "model A fp32").find("a.weight is Float"), std::string::npos);
  TwoLayers more(32);
  more->register_buffer("extra", torch::zeros({1}));
  EXPECT_NE(refusal(more, "model A fp32").find("4 shared tensors, this model has 5"),
            std::string::npos)
      << refusal(more, "model A fp32");
}

TEST_F(SharedWeights, ReleasedOrOrphanedManifestLeavesTheCallerToPlaceItsOwn) {
  TwoLayers trainer(32);
  const fs::path manifest = dir_ / "shared.json";
  {
    SharedWeightsPublisher publisher(*trainer, c10::Device(c10::kCPU), manifest, "k");
    TwoLayers early(32);
    EXPECT_NE(attach_shared_weights(*early, c10::Device(c10::kCPU), manifest, "k"), nullptr);
  }  // released at the publisher's end, after the CPU attachment let go at once
  TwoLayers late(32);
  const at::Tensor own = late->a->weight.clone();
  EXPECT_EQ(attach_shared_weights(*late, c10::Device(c10::kCPU), manifest, "k"), nullptr);
  EXPECT_TRUE(torch::equal(late->a->weight, own)) << "a released attach changes nothing";
  // A manifest whose publisher died without releasing it (pid 2^22 + 1 is beyond Linux's
  // largest pid).
  std::ofstream(manifest) << R"({"version":1,"state":"shared","pid":4194305,"device":"cpu",)"
                          << R"("key":"k","backend":"memfd","fd":3,"bytes":64,"tensors":[]})";
  EXPECT_EQ(attach_shared_weights(*late, c10::Device(c10::kCPU), manifest, "k"), nullptr);
}

// The lifetime rule CUDA needs, with the lock a CUDA attachment holds taken here by hand: the
// publisher's release waits while a process holds the weights, then marks them released; a
// release without waiting (a failed trainer's) does not wait.
TEST_F(SharedWeights, ReleaseWaitsForAProcessThatHoldsTheWeights) {
  TwoLayers trainer(32);
  const fs::path manifest = dir_ / "shared.json";
  SharedWeightsPublisher publisher(*trainer, c10::Device(c10::kCPU), manifest, "k");
  const int held = open(manifest.c_str(), O_RDONLY);
  ASSERT_EQ(flock(held, LOCK_SH), 0);
  std::atomic<bool> released{false};
  std::thread releasing([&] {
    publisher.release();
    released = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(released) << "released while a process held the weights";
  close(held);  // the lock goes with it
  releasing.join();
  EXPECT_TRUE(released);
  TwoLayers late(32);
  EXPECT_EQ(attach_shared_weights(*late, c10::Device(c10::kCPU), manifest, "k"), nullptr);

  SharedWeightsPublisher failed(*trainer, c10::Device(c10::kCPU), manifest, "k");
  const int still = open(manifest.c_str(), O_RDONLY);
  ASSERT_EQ(flock(still, LOCK_SH), 0);
  failed.release(/*wait=*/false);  // returns at once
  close(still);
  EXPECT_EQ(attach_shared_weights(*late, c10::Device(c10::kCPU), manifest, "k"), nullptr);
}

TEST_F(SharedWeights, AttachWaitsForTheManifestAndCanBeGivenUp) {
  TwoLayers trainer(32), sampler(32);
  const fs::path manifest = dir_ / "shared.json";
  std::unique_ptr<SharedWeightsPublisher> publisher;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    publisher = std::make_unique<SharedWeightsPublisher>(*trainer, c10::Device(c10::kCPU),
                                                         manifest, "k");
  });
  int waits = 0;
  const auto attachment = attach_shared_weights(*sampler, c10::Device(c10::kCPU), manifest, "k",
                                                [&] { ++waits; });
  later.join();
  EXPECT_NE(attachment, nullptr);
  EXPECT_GE(waits, 2) << "it waited, calling back meanwhile";
  EXPECT_THROW(attach_shared_weights(*sampler, c10::Device(c10::kCPU), dir_ / "never.json", "k",
                                     [] { throw InputError("given up"); }),
               InputError);
}

// The key follows the model file and the flags that decide the placed values, and nothing else.
TEST_F(SharedWeights, KeyFollowsTheModelAndThePlacementFlags) {
  std::ofstream(dir_ / "model.safetensors") << "x";
  Placement p;
  const std::string base = shared_weights_key(dir_ / "model.safetensors", p);
  Placement bf16 = p;
  bf16.dtype = c10::kBFloat16;
  Placement fp8 = p;
  fp8.fp8_denoiser = true;
  Placement fast = fp8;
  fast.fp8_scaled = fast.fp8_fast = true;
  Placement device = p;
  device.blocks_to_swap = 3;  // not a value of the placed tensors: the same key
  EXPECT_EQ(shared_weights_key(dir_ / "model.safetensors", device), base);
  for (const Placement& other : {bf16, fp8, fast}) {
    EXPECT_NE(shared_weights_key(dir_ / "model.safetensors", other), base);
  }
  std::ofstream(dir_ / "other.safetensors") << "x";
  EXPECT_NE(shared_weights_key(dir_ / "other.safetensors", p), base);
}

}  // namespace
}  // namespace lorapipe::models
