// The CUDA runtime that kernels/ links must see the same devices LibTorch sees: if they
// disagree, kernels would run on one device while tensors live on another.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <regex>
#include <set>

#include "kernels/cuda_device.h"

namespace lorapipe::kernels {
namespace {

TEST(KernelsCudaDevice, CountMatchesLibTorch) {
  const int torch_count = static_cast<int>(torch::cuda::device_count());
  if (built_with_cuda()) {
    EXPECT_EQ(cuda_device_count(), torch_count);
  } else {
    EXPECT_EQ(cuda_device_count(), 0);
  }
}

TEST(KernelsCudaDevice, DescribesEachDevice) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "lorapipe-skip: no CUDA device on this machine";
  for (int i = 0; i < cuda_device_count(); ++i) {
    const std::string name = cuda_device_name(i);
    EXPECT_NE(name.find("sm_"), std::string::npos) << name;
    // The capability the name shows, as a number (sm_90 is 90).
    const int capability = cuda_compute_capability(i);
    EXPECT_GE(capability, 50) << name;
    EXPECT_NE(name.find("sm_" + std::to_string(capability)), std::string::npos) << name;
  }
  EXPECT_TRUE(cuda_device_name(cuda_device_count()).empty());
  EXPECT_EQ(cuda_compute_capability(cuda_device_count()), 0);
  // UUIDs as nvidia-smi -L prints them, one per device (shared weights compare them).
  std::set<std::string> uuids;
  for (int i = 0; i < cuda_device_count(); ++i) {
    const std::string uuid = cuda_device_uuid(i);
    EXPECT_TRUE(std::regex_match(uuid, std::regex("GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")))
        << uuid;
    EXPECT_TRUE(uuids.insert(uuid).second) << "device " << i << " repeats " << uuid;
  }
  EXPECT_TRUE(cuda_device_uuid(cuda_device_count()).empty());
}

}  // namespace
}  // namespace lorapipe::kernels
