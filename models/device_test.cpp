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

TEST(ModelsDevice, TensorsLandOnTheResolvedDevice) {
  const c10::Device device = resolve_device("auto");
  const torch::Tensor t = torch::ones({2, 3}, torch::TensorOptions().device(device));
  EXPECT_EQ(t.device(), device);
  EXPECT_EQ(t.sum().item<float>(), 6.0f);
  EXPECT_FALSE(describe_device(device).empty());
}

}  // namespace
}  // namespace lorapipe::models
