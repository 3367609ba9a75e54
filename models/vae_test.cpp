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

// Encodes and decodes the reference's images and latents with the VAE saved in dir_/<name>.
void check_vae(const fs::path& dir, const std::string& vae_name, AutoencoderKL& vae) {
  set_force_math_attention(true);
  load_vae(vae, dir / vae_name);
  vae->eval();
  const auto io = testing::read_all(dir / (vae_name + "_io.safetensors"));
  torch::NoGradGuard no_grad;
  constexpr double kTolerance = 1e-4;
  for (const std::string name : {"square", "wide"}) {
    const LatentDistribution dist = vae->encode(io.at(name + ".image"));
    testing::expect_close(vae_name + " " + name + " mean", dist.mean, io.at(name + ".mean"),
                          kTolerance);
    testing::expect_close(vae_name + " " + name + " logvar", dist.logvar, io.at(name + ".logvar"),
                          kTolerance);
    testing::expect_close(vae_name + " " + name + " decode", vae->decode(io.at(name + ".latents")),
                          io.at(name + ".decoded"), kTolerance);
  }
}

VaeConfig config_of(const fs::path& folder) {
  std::ifstream in(folder / "config.json");
  const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return VaeConfig::from_json(json);
}

TEST_F(VaeParity, EncodeAndDecodeMatchDiffusers) {
  AutoencoderKL vae(config_of(dir_ / "vae"));
  EXPECT_DOUBLE_EQ(vae->config().scaling_factor, 0.18215);
  EXPECT_TRUE(vae->config().use_quant_conv);
  check_vae(dir_, "vae", vae);
}

// Flux.1's AE: 16 latent channels and no 1x1 convolutions around the latents (diffusers'
// use_quant_conv / use_post_quant_conv false), its scale and shift read from the config.
TEST_F(VaeParity, FluxAutoencoderWithoutQuantConvsMatchesDiffusers) {
  AutoencoderKL vae(config_of(dir_ / "flux_vae"));
  EXPECT_EQ(vae->config().latent_channels, 16);
  EXPECT_FALSE(vae->config().use_quant_conv);
  EXPECT_FALSE(vae->config().use_post_quant_conv);
  EXPECT_DOUBLE_EQ(vae->config().scaling_factor, 0.3611);
  EXPECT_DOUBLE_EQ(vae->config().shift_factor, 0.1159);
  for (const auto& item : vae->named_parameters()) {
    EXPECT_EQ(item.key().find("quant_conv"), std::string::npos) << item.key();
  }
  check_vae(dir_, "flux_vae", vae);
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
