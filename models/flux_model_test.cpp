// Flux.1 through the model seam against diffusers' FluxPipeline on a tiny dev pipeline
// (models/reference/flux_pipeline_reference.py): the conditioning (CLIP-L's pooled output, T5's
// states over the T5 tokenizer's ids), one denoiser call with packing, ids and guidance, and the
// AE's decode with Flux's scale and shift, all from the diffusers folder diffusers saved.
//
// Tolerance: 1e-4 of the largest reference magnitude (the bound); both sides run fp32
// through SDPA on the CPU, so the difference is summation order.

#include "models/flux_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/parity_util.h"
#include "models/tiny.h"
#include "sampler/render.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;
using testing::expect_close;

class FluxPipelineParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("flux-pipeline");
    const TinyCheckpoint tiny = write_tiny_checkpoint(dir_ / "sd", /*seed=*/0);
    ref_ =
        testing::cached_reference("models/reference/flux_pipeline_reference.py", {tiny.diffusers});
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static FluxModel load() {
    FluxModel model = load_flux_diffusers_folder(ref_ / "flux");
    std::ifstream in(ref_ / "request.json");
    const nlohmann::json request = nlohmann::json::parse(in);
    model.t5_max_length = request["t5_length"];
    return model;
  }
  static std::vector<std::string> prompts() {
    std::ifstream in(ref_ / "request.json");
    return nlohmann::json::parse(in)["prompts"].get<std::vector<std::string>>();
  }

  static fs::path dir_, ref_;
};
fs::path FluxPipelineParity::dir_;
fs::path FluxPipelineParity::ref_;

TEST_F(FluxPipelineParity, ConditioningMatchesFluxPipelineEncodePrompt) {
  FluxModel model = load();
  EXPECT_EQ(model.model_family().name, "flux-dev");
  EXPECT_EQ(model.model_family().objective, ObjectiveKind::kFlowMatching);
  ASSERT_TRUE(model.has_tokenizer());
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  torch::NoGradGuard no_grad;
  const TokenBatch tokens = model.tokenize(prompts());
  ASSERT_EQ(tokens.ids.size(), 2u);
  EXPECT_EQ(tokens.ids[1].size(1), 16);
  const Conditioning c = model.encode_text(tokens, /*clip_skip=*/1);
  expect_close("flux pooled (CLIP-L)", c.pooled, ref.at("pooled"), 1e-4);
  expect_close("flux T5 states", c.hidden_states, ref.at("prompt_embeds"), 1e-4);
  // The mask marks the caption and its </s>: the padding of the shorter caption is 0.
  EXPECT_EQ(c.mask.sizes(), tokens.ids[1].sizes());
  EXPECT_LT(c.mask.sum().item<int64_t>(), c.mask.numel());
}

TEST_F(FluxPipelineParity, DenoiseAndDecodeMatchTheTransformerAndAe) {
  FluxModel model = load();
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  torch::NoGradGuard no_grad;
  Conditioning c;
  c.hidden_states = ref.at("prompt_embeds");
  c.pooled = ref.at("pooled");
  DenoiseInput input;
  input.latents = ref.at("latents");
  input.time = ref.at("sigma");
  input.conditioning = &c;
  input.guidance = 3.5;
  expect_close("flux velocity", model.denoise(input), ref.at("velocity"), 1e-4);
  // The guidance matters (dev).
  input.guidance = 1.0;
  EXPECT_GT(testing::relative_error(model.denoise(input), ref.at("velocity")), 1e-4);
  expect_close("flux AE decode", model.decode_latents(ref.at("latents")), ref.at("image"), 1e-4);
  // kohya's Flux LoRA on it: 1 double block x 10, 2 single blocks x 3.
  EXPECT_EQ(model.lora_targets(/*text_encoder=*/false, false).size(), 16u);
  EXPECT_GT(model.lora_targets(/*text_encoder=*/true, false).size(), 16u);
}

// A whole preview through the sampler's render, against FluxPipeline from the same initial
// latents: the flow schedule (dev's resolution shift), the Euler steps, guidance 3.5, the decode.
// Final latents within 1e-4 of their scale, every pixel within 1/255 (render_test's bounds).
TEST_F(FluxPipelineParity, RenderMatchesFluxPipeline) {
  FluxModel model = load();
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  std::ifstream in(ref_ / "request.json");
  const nlohmann::json request = nlohmann::json::parse(in);
  sampler::RenderRequest r;
  r.prompt = prompts()[0];
  r.width = r.height = 16;
  r.steps = request["render_steps"];
  r.cfg_scale = 3.5;
  sampler::RenderOptions options;
  options.initial_latents = ref.at("render_initial");
  const sampler::RenderResult result = sampler::render(model, r, options);
  expect_close("flux render latents", result.latents, ref.at("render_latents"), 1e-4);
  const int pixels = (result.image.to(torch::kInt32) - ref.at("render_image").to(torch::kInt32))
                         .abs()
                         .max()
                         .item<int>();
  std::printf("[flux render] largest pixel difference %d/255 (limit 1)\n", pixels);
  EXPECT_LE(pixels, 1);
}

// The dev schedule shifts by resolution (mu from the packed token count), schnell's not at all.
TEST(FluxSchedule, DevShiftsByResolutionSchnellDoesNot) {
  const at::Tensor dev = sampler::flow_sigmas(flux_model_family(true).flow, 4, 4096);
  const at::Tensor schnell = sampler::flow_sigmas(flux_model_family(false).flow, 4, 4096);
  EXPECT_EQ(dev.size(0), 5);
  EXPECT_FLOAT_EQ(schnell[1].item<float>(), 0.75f);  // linspace(1, 1/4, 4), unshifted
  EXPECT_FLOAT_EQ(dev[4].item<float>(), 0.0f);
  // mu = 1.15 at 4096 tokens: e^1.15 / (e^1.15 + 1/0.75 - 1).
  EXPECT_NEAR(dev[1].item<double>(), std::exp(1.15) / (std::exp(1.15) + 1 / 0.75 - 1), 1e-6);
}

}  // namespace
}  // namespace lorapipe::models
