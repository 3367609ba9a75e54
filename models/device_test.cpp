#include "models/device.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/error.h"

namespace lorapipe::models {
namespace {

TEST(ModelsDevice, ParsesEverySpelling) {
  EXPECT_EQ(resolve_device("cpu"), c10::Device(c10::kCPU));
  const c10::Device automatic = resolve_device("auto");
  if (torch::cuda::is_available()) {
    EXPECT_EQ(automatic, c10::Device(c10::kCUDA, 0));
    EXPECT_EQ(resolve_device("cuda"), c10::Device(c10::kCUDA, 0));
    EXPECT_EQ(resolve_device("cuda:0"), c10::Device(c10::kCUDA, 0));
  } else {
    EXPECT_EQ(automatic, c10::Device(c10::kCPU));
  }
}

TEST(ModelsDevice, RefusesMalformedAndMissingDevicesNamingTheValue) {
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda0", "cuda:1x", ""}) {
    try {
      resolve_device(bad);
      FAIL() << "accepted --device=" << bad;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + std::string(bad) + "'"), std::string::npos)
          << e.what();
    }
  }
  const std::string beyond = "cuda:" + std::to_string(torch::cuda::device_count());
  EXPECT_THROW(resolve_device(beyond), InputError);
}

// What the sampler and the plan's probe take for the device's memory running out (a render or a
// candidate skipped, the process goes on), and what they must not.
TEST(ModelsDevice, KnowsOutOfMemoryByTypeAndByWhatTheLibrariesSay) {
  auto c10_error = [](const std::string& message) {
    return c10::Error({__func__, __FILE__, __LINE__}, message);
  };
  EXPECT_TRUE(is_out_of_memory(c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, "CUDA")));
  EXPECT_TRUE(is_out_of_memory(std::bad_alloc()));
  EXPECT_TRUE(is_out_of_memory(c10_error("DefaultCPUAllocator: not enough memory: you tried")));
  EXPECT_TRUE(is_out_of_memory(
      c10_error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")));
  EXPECT_TRUE(is_out_of_memory(c10_error("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")));
  EXPECT_FALSE(is_out_of_memory(c10_error("CUDA error: an illegal memory access was encountered")));
  EXPECT_FALSE(is_out_of_memory(std::runtime_error("out of memory")));  // not the library's
}

TEST(ModelsDevice, TensorsLandOnTheResolvedDevice) {
  const c10::Device device = resolve_device("auto");
  const torch::Tensor t = torch::ones({2, 3}, torch::TensorOptions().device(device));
  EXPECT_EQ(t.device(), device);
  EXPECT_EQ(t.sum().item<float>(), 6.0f);
  EXPECT_FALSE(describe_device(device).empty());
}

}  // namespace
}  // namespace lorapipe::models
