// VAE against diffusers' AutoencoderKL on the same tiny random weights: encode (mean, logvar)
// and decode, square and non-square. Tolerance 1e-4 relative (fp32; the same operations in a
// different order).
#include "models/vae.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <iterator>

#include "models/attention.h"
#include "models/parity_util.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

class VaeParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("vae-parity");
    ASSERT_TRUE(testing::run_reference("vae_reference.py", dir_));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static fs::path dir_;
};
fs::path VaeParity::dir_;

TEST_F(VaeParity, EncodeAndDecodeMatchDiffusers) {
  set_force_math_attention(true);
  std::ifstream in(dir_ / "vae" / "config.json");
  const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  AutoencoderKL vae(VaeConfig::from_json(json));
  load_vae(vae, dir_ / "vae");
  vae->eval();
  EXPECT_DOUBLE_EQ(vae->config().scaling_factor, 0.18215);
  const auto io = testing::read_all(dir_ / "vae_io.safetensors");
  torch::NoGradGuard no_grad;
  constexpr double kTolerance = 1e-4;
  for (const std::string name : {"square", "wide"}) {
    const LatentDistribution dist = vae->encode(io.at(name + ".image"));
    testing::expect_close("vae " + name + " mean", dist.mean, io.at(name + ".mean"), kTolerance);
    testing::expect_close("vae " + name + " logvar", dist.logvar, io.at(name + ".logvar"),
                          kTolerance);
    testing::expect_close("vae " + name + " decode", vae->decode(io.at(name + ".latents")),
                          io.at(name + ".decoded"), kTolerance);
  }
}

TEST_F(VaeParity, SampleDrawsAroundTheMean) {
  // sample() = mean + std * noise: with a fixed generator it is reproducible, and its deviation
  // from the mean is the noise scaled by std.
  LatentDistribution dist{torch::zeros({1, 4, 8, 8}), torch::full({1, 4, 8, 8}, std::log(4.0))};
  auto a = dist.sample(at::make_generator<at::CPUGeneratorImpl>(7));
  auto b = dist.sample(at::make_generator<at::CPUGeneratorImpl>(7));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_NEAR(dist.std().mean().item<double>(), 2.0, 1e-6);
}

}  // namespace
}  // namespace lorapipe::models
