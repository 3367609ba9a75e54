// SDXL through the model seam against diffusers' StableDiffusionXLPipeline on lorapipe's tiny
// SDXL (models/reference/sdxl_reference.py): the conditioning of both encoders, the U-Net with
// its time ids and its input gradient, the single file against the folder, and renders per
// sampler with and without a LoRA in kohya's SDXL format.
//
// Tolerances: conditioning, U-Net output and input gradient within 1e-4 relative (the largest
// difference over the largest reference magnitude), the bound: both sides run the same
// fp32 math (forced math attention as diffusers' AttnProcessor, eager attention in the text
// encoders). Renders as sampler/render_test.cpp's: final latents within 1e-4 of their scale,
// every pixel within 1/255.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/attention.h"
#include "models/lora_merge.h"
#include "models/parity_util.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "models/sdxl.h"
#include "models/sdxl_lora.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "sampler/render.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;

double relative(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().max().item<double>() /
         want.abs().max().item<double>();
}

class SdxlPipelineParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("sdxl");
    tiny_ = write_tiny_sdxl_checkpoint(dir_ / "model", /*seed=*/9);
    ref_ = testing::cached_reference("models/reference/sdxl_reference.py",
                                     {tiny_.diffusers, tiny_.single_file});
    std::ifstream in(ref_ / "request.json");
    request_ = nlohmann::json::parse(in);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  std::map<std::string, at::Tensor> reference(const std::string& name) const {
    return read_tensors(SafetensorsFile::open(ref_ / name));
  }

  // The conditioning of the reference's prompts and the U-Net call on it, from `model`.
  void check_model(DiffusionModel& model, const std::string& what) {
    set_force_math_attention(true);
    const auto ref = reference("reference.safetensors");
    const std::vector<std::string> prompts = request_["prompts"];
    torch::NoGradGuard no_grad;
    const Conditioning c = model.encode_text(model.tokenize(prompts), /*clip_skip=*/1);
    ASSERT_EQ(c.hidden_states.sizes(), ref.at("prompt_embeds").sizes()) << what;
    ASSERT_EQ(c.pooled.sizes(), ref.at("pooled").sizes()) << what;
    const double states = relative(c.hidden_states, ref.at("prompt_embeds"));
    const double pooled = relative(c.pooled, ref.at("pooled"));
    // The sampler's way (kohya's sample-prompt conditioning) is the same for plain short prompts.
    const Conditioning p = model.encode_prompts(prompts, /*clip_skip=*/1);
    const double prompt_states = relative(p.hidden_states, ref.at("prompt_embeds"));
    std::printf("[sdxl] %s: states %.2e, pooled %.2e, sample-prompt states %.2e (limit 1e-4)\n",
                what.c_str(), states, pooled, prompt_states);
    EXPECT_LE(states, 1e-4) << what;
    EXPECT_LE(pooled, 1e-4) << what;
    EXPECT_LE(prompt_states, 1e-4) << what;
  }

  static fs::path dir_;
  static fs::path ref_;
  static TinyCheckpoint tiny_;
  static nlohmann::json request_;
};
fs::path SdxlPipelineParity::dir_;
fs::path SdxlPipelineParity::ref_;
TinyCheckpoint SdxlPipelineParity::tiny_;
nlohmann::json SdxlPipelineParity::request_;

TEST_F(SdxlPipelineParity, FolderAndSingleFileAreDetectedAsSdxl) {
  EXPECT_EQ(detect_family(tiny_.diffusers).family, "sdxl");
  const FamilyDetection file = detect_family(tiny_.single_file);
  EXPECT_EQ(file.family, "sdxl");
  // Without lorapipe's own metadata the keys alone tell it.
  const auto tensors = read_tensors(SafetensorsFile::open(tiny_.single_file));
  std::vector<torch::Tensor> storage;
  std::vector<TensorToWrite> plain;
  for (const auto& [name, tensor] : tensors) {
    storage.push_back(tensor.contiguous());
    const auto& t = storage.back();
    plain.push_back({name, to_safetensors_dtype(t.scalar_type()),
                     std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                     std::string_view(static_cast<const char*>(t.data_ptr()),
                                      t.numel() * t.element_size())});
  }
  write_safetensors(dir_ / "plain.safetensors", plain);
  const FamilyDetection by_keys = detect_family(dir_ / "plain.safetensors");
  EXPECT_EQ(by_keys.family, "sdxl");
  EXPECT_NE(by_keys.reason.find("conditioner.embedders.1.model."), std::string::npos)
      << by_keys.reason;
}

TEST_F(SdxlPipelineParity, FolderConditioningMatchesDiffusersEncodePrompt) {
  const auto model = load_model(tiny_.diffusers);
  EXPECT_EQ(model->model_family().name, "sdxl");
  check_model(*model, "folder");
}

// The single file (bigG in OpenCLIP's layout) loads to the same model: the reference checked
// that diffusers' converters read it as the folder's weights, and its conditioning matches.
TEST_F(SdxlPipelineParity, SingleFileConditioningMatchesDiffusersEncodePrompt) {
  LoadOptions options;
  options.tokenizer = tiny_.tokenizer;
  const auto model = load_model(tiny_.single_file, options);
  EXPECT_EQ(model->model_family().name, "sdxl");
  check_model(*model, "single file");
}

TEST_F(SdxlPipelineParity, UNetWithTimeIdsAndItsInputGradientMatchDiffusers) {
  set_force_math_attention(true);
  const auto model = load_model(tiny_.diffusers);
  const auto ref = reference("reference.safetensors");
  Conditioning c;
  c.hidden_states = ref.at("prompt_embeds");
  c.pooled = ref.at("pooled");
  DenoiseInput input;
  const at::Tensor x = ref.at("unet_in").clone().requires_grad_(true);
  input.latents = x;
  input.time = ref.at("unet_t");
  input.conditioning = &c;
  for (const auto& g : request_["geometry"]) {
    input.geometry.push_back({g[0], g[1], g[2], g[3], g[4], g[5]});
  }
  const at::Tensor y = model->denoise(input);
  (y * ref.at("unet_w")).sum().backward();
  const double out = relative(y.detach(), ref.at("unet_out"));
  const double grad = relative(x.grad(), ref.at("unet_grad"));
  std::printf("[sdxl] U-Net output %.2e, input gradient %.2e (limit 1e-4)\n", out, grad);
  EXPECT_LE(out, 1e-4);
  EXPECT_LE(grad, 1e-4);
  // The time ids matter: the same call at the latents' own size and no crop differs.
  input.geometry.clear();
  torch::NoGradGuard no_grad;
  EXPECT_GT(relative(model->denoise(input), ref.at("unet_out")), 1e-3);
}

class SdxlSamplerParity : public SdxlPipelineParity {
 protected:
  void render_check(const std::string& sampler, bool with_lora) {
    set_force_math_attention(true);
    const auto model = load_model(tiny_.diffusers);
    std::optional<MergedLora> lora;
    if (with_lora) {
      lora.emplace(*model, ref_ / "lora.safetensors", /*multiplier=*/1.0);
      EXPECT_EQ(lora->module_count(), static_cast<size_t>(request_["lora_modules"]));
    }
    const std::string tag = sampler + (with_lora ? "_lora" : "");
    const auto ref = reference(tag + ".safetensors");
    sampler::RenderRequest r;
    r.prompt = request_["prompt"];
    r.negative_prompt = request_["negative_prompt"];
    r.width = request_["width"];
    r.height = request_["height"];
    r.steps = request_["steps"];
    r.cfg_scale = request_["cfg_scale"];
    r.seed = request_["seed"];
    r.sampler = sampler;
    sampler::RenderOptions options;
    options.initial_latents = ref.at("initial");
    const sampler::RenderResult result = sampler::render(*model, r, options);
    const at::Tensor& expected = ref.at("latents");
    ASSERT_EQ(result.latents.sizes(), expected.sizes());
    const double error = relative(result.latents, expected);
    const int pixels = (result.image.to(torch::kInt32) - ref.at("image").to(torch::kInt32))
                           .abs()
                           .max()
                           .item<int>();
    std::printf("[sdxl render] %-12s final latents %.2e of their scale (limit 1e-4), largest "
                "pixel difference %d/255 (limit 1)\n",
                tag.c_str(), error, pixels);
    EXPECT_LE(error, 1e-4) << tag;
    EXPECT_LE(pixels, 1) << tag;
    if (with_lora) {  // the LoRA matters, else the parity says nothing
      const auto plain = reference(sampler + ".safetensors");
      EXPECT_GT(relative(plain.at("latents"), expected), 1e-2) << tag;
    }
  }
};

TEST_F(SdxlSamplerParity, Ddim) { render_check("ddim", false); }
TEST_F(SdxlSamplerParity, Euler) { render_check("euler", false); }
TEST_F(SdxlSamplerParity, EulerAncestral) { render_check("euler_a", false); }
TEST_F(SdxlSamplerParity, DpmSolverPlusPlus2M) { render_check("dpmsolver++", false); }
// kohya's SDXL LoRA format (SAI module names, lora_te1/lora_te2), as diffusers loads it.
TEST_F(SdxlSamplerParity, DdimWithKohyaLora) { render_check("ddim", true); }
TEST_F(SdxlSamplerParity, EulerWithKohyaLora) { render_check("euler", true); }

// kohya's names for SDXL: the U-Net's layers by their Stability AI paths, the text encoders
// under lora_te1 / lora_te2, and kohya's 23-block numbering.
TEST(SdxlLora, TinyTargetsAreNamedAndNumberedAsKohya) {
  const auto dir = testing::make_temp_dir("sdxl-lora");
  const TinyCheckpoint tiny = write_tiny_sdxl_checkpoint(dir, 1);
  const auto model = load_model(tiny.diffusers);
  size_t unet = 0, te1 = 0, te2 = 0;
  for (const LoraTarget& t : model->lora_targets(/*text_encoder=*/true, /*conv_kxk=*/false)) {
    if (t.text_encoder) {
      (t.encoder == 0 ? te1 : te2) += 1;
      EXPECT_EQ(t.name.rfind(t.encoder == 0 ? "lora_te1_text_model_encoder_layers_"
                                            : "lora_te2_text_model_encoder_layers_", 0), 0u)
          << t.name;
      continue;
    }
    ++unet;
    EXPECT_TRUE(t.name.rfind("lora_unet_input_blocks_", 0) == 0 ||
                t.name.rfind("lora_unet_middle_block_1_", 0) == 0 ||
                t.name.rfind("lora_unet_output_blocks_", 0) == 0)
        << t.name;
    EXPECT_GE(t.block, 1) << t.name;
    EXPECT_LE(t.block, 21) << t.name;
  }
  // The tiny U-Net's Transformer2Ds, all of depth 2: two in down level 1, one in the middle,
  // three in up level 0; each proj_in, proj_out and 10 layers per transformer block.
  EXPECT_EQ(unet, 6u * (2u + 2u * 10u));
  EXPECT_EQ(te1, 2u * 6u);  // two layers: q, k, v, out_proj, fc1, fc2
  EXPECT_EQ(te2, 2u * 6u);
  EXPECT_EQ(sdxl_kohya_block_index("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"), 5);
  EXPECT_EQ(sdxl_kohya_block_index("lora_unet_middle_block_1_proj_in"), 11);
  EXPECT_EQ(sdxl_kohya_block_index("lora_unet_output_blocks_8_0_in_layers_2"), 21);
  EXPECT_EQ(sdxl_kohya_block_index("lora_unet_time_embed_0"), 0);
  EXPECT_EQ(sdxl_kohya_block_index("lora_unet_out_2"), 22);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lorapipe::models
