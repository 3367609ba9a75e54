// Which device and backend a trainer rank takes (trainer/ranks.h). Its own binary, with no
// preprocess or libvips, so that tests/gpu/run.sh builds and runs the CUDA half on a GPU machine.

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>

#include "common/error.h"
#include "trainer/ranks.h"

namespace lorapipe::trainer {
namespace {

RankEnvironment second_of_two() {
  RankEnvironment env;
  env.world_size = 2;
  env.rank = 1;
  env.local_rank = 1;
  return env;
}

TEST(TrainRanksDevice, TheBackendFollowsTheDevice) {
  const RankEnvironment env = second_of_two();
  EXPECT_EQ(rank_device("cpu", env), c10::Device(c10::kCPU));
  EXPECT_STREQ(rank_backend(c10::Device(c10::kCPU)), "gloo");
#if defined(LORAPIPE_NCCL_BUILT)
  EXPECT_STREQ(rank_backend(c10::Device(c10::kCUDA, 1)), "nccl");
#else
  EXPECT_STREQ(rank_backend(c10::Device(c10::kCUDA, 1)), "gloo");
#endif
  if (torch::cuda::device_count() == 0) {
    EXPECT_EQ(rank_device("auto", env), c10::Device(c10::kCPU)) << "no GPU: auto is the CPU";
  }
}

TEST(TrainRanksDevice, EachRankTakesItsLocalGpu) {
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  if (gpus == 0) GTEST_SKIP() << "lorapipe-skip: needs a CUDA device (tests/gpu/run.sh runs it)";
  RankEnvironment env = second_of_two();
  // LOCAL_RANK picks the GPU where there is one for it; an explicit index wins.
  if (gpus > 1) {
    EXPECT_EQ(rank_device("auto", env), c10::Device(c10::kCUDA, 1));
  }
  env.local_rank = 0;
  EXPECT_EQ(rank_device("auto", env), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(rank_device("cuda", env), c10::Device(c10::kCUDA, 0));
  env.local_rank = 1;
  EXPECT_EQ(rank_device("cuda:0", env), c10::Device(c10::kCUDA, 0)) << "an index wins";
  env.local_rank = static_cast<int>(gpus);
  try {
    rank_device("cuda", env);
    ADD_FAILURE() << "LOCAL_RANK past the last GPU must be refused";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("LOCAL_RANK=" + std::to_string(gpus)), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace lorapipe::trainer
