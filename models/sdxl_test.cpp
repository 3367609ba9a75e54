// SDXL through the model seam against diffusers' StableDiffusionXLPipeline on lorapipe's tiny
// SDXL (models/reference/sdxl_reference.py): the conditioning of both encoders (and of kohya's
// 150-token captions, chunked as kohya chunks them), the U-Net with
// its time ids and its input gradient, the single file against the folder, and renders per
// sampler with and without a LoRA in kohya's SDXL format.
//
// Tolerances: conditioning, U-Net output and input gradient within 1e-4 relative (the largest
// difference over the largest reference magnitude), the issue's bound: both sides run the same
// fp32 math (forced math attention as diffusers' AttnProcessor, eager attention in the text
// encoders). Renders as sampler/render_test.cpp's: final latents within 1e-4 of their scale,
// every pixel within 1/255.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/attention.h"
#include "models/inspect.h"
#include "models/lora_merge.h"
#include "models/parity_util.h"
#include "models/placement.h"
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

    // kohya's long captions (--max_token_length 150): both encoders chunked as kohya chunks them.
    const std::vector<std::string> long_prompts = request_["long_prompts"];
    const Conditioning l = model.encode_text(
        model.tokenize(long_prompts, request_["max_token_length"].get<int>()), /*clip_skip=*/1);
    ASSERT_EQ(l.hidden_states.sizes(), ref.at("long_prompt_embeds").sizes()) << what;
    ASSERT_EQ(l.pooled.sizes(), ref.at("long_pooled").sizes()) << what;
    const double long_states = relative(l.hidden_states, ref.at("long_prompt_embeds"));
    const double long_pooled = relative(l.pooled, ref.at("long_pooled"));
    std::printf("[sdxl] %s: 150-token captions as kohya: states %.2e, pooled %.2e (limit 1e-4)\n",
                what.c_str(), long_states, long_pooled);
    EXPECT_LE(long_states, 1e-4) << what;
    EXPECT_LE(long_pooled, 1e-4) << what;
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
  // lorapipe-inspect names it.
  const std::string described = inspect_checkpoint(dir_ / "plain.safetensors");
  EXPECT_NE(described.find("family: sdxl (Stable Diffusion XL)"), std::string::npos) << described;
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
  // `lora_file`: the LoRA to merge (the reference's kohya file by default).
  void render_check(const std::string& sampler, bool with_lora, fs::path lora_file = {}) {
    set_force_math_attention(true);
    const auto model = load_model(tiny_.diffusers);
    std::optional<MergedLora> lora;
    if (with_lora) {
      lora.emplace(*model, lora_file.empty() ? ref_ / "lora.safetensors" : lora_file,
                   /*multiplier=*/1.0);
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
// The same LoRA with its U-Net modules under diffusers' module names (lora_unet_down_blocks_...,
// as some trainers write SDXL LoRAs and kohya converts on load) renders the same.
TEST_F(SdxlSamplerParity, DdimWithLoraInDiffusersModuleNames) {
  const auto model = load_model(tiny_.diffusers);
  std::map<std::string, std::string> alias;
  for (const LoraTarget& t : model->lora_targets(true, true)) {
    if (!t.alias.empty()) alias[t.name] = t.alias;
  }
  ASSERT_FALSE(alias.empty());
  const auto tensors = read_tensors(SafetensorsFile::open(ref_ / "lora.safetensors"));
  std::vector<torch::Tensor> storage;
  std::vector<TensorToWrite> renamed;
  size_t moved = 0;
  for (const auto& [key, tensor] : tensors) {
    const std::string module = key.substr(0, key.find('.'));
    const auto it = alias.find(module);
    moved += it != alias.end();
    storage.push_back(tensor.contiguous());
    const auto& t = storage.back();
    renamed.push_back({(it != alias.end() ? it->second : module) + key.substr(module.size()),
                       to_safetensors_dtype(t.scalar_type()),
                       std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                       std::string_view(static_cast<const char*>(t.data_ptr()),
                                        t.numel() * t.element_size())});
  }
  EXPECT_GT(moved, 0u);
  write_safetensors(dir_ / "diffusers-names.safetensors", renamed);
  render_check("ddim", true, dir_ / "diffusers-names.safetensors");
}

// kohya's names for SDXL: the U-Net's layers by their Stability AI paths, the text encoders
// under lora_te1 / lora_te2, and kohya's 23-block numbering.
TEST(SdxlLora, TinyTargetsAreNamedAndNumberedAsKohya) {
  const auto dir = testing::make_temp_dir("sdxl-lora");
  const TinyCheckpoint tiny = write_tiny_sdxl_checkpoint(dir, 1);
  const auto model = load_model(tiny.diffusers);
  size_t unet = 0, te1 = 0, te2 = 0;
  for (const LoraTarget& t : model->lora_targets(/*text_encoder=*/true, /*conv_kxk=*/false)) {
    // ComfyUI's name for the layer (models/comfy_lora.h): SDXL's encoders are its clip_l and
    // clip_g, the U-Net's layers their single-file paths, which kohya's names spell with '_'.
    std::string comfy = t.comfy_path;
    std::replace(comfy.begin(), comfy.end(), '.', '_');
    if (t.text_encoder) {
      (t.encoder == 0 ? te1 : te2) += 1;
      EXPECT_EQ(t.name.rfind(t.encoder == 0 ? "lora_te1_text_model_encoder_layers_"
                                            : "lora_te2_text_model_encoder_layers_", 0), 0u)
          << t.name;
      EXPECT_EQ(t.comfy_path.rfind(t.encoder == 0 ? "text_encoders.clip_l.transformer.text_model."
                                                  : "text_encoders.clip_g.transformer.text_model.",
                                   0),
                0u)
          << t.comfy_path;
      continue;
    }
    ++unet;
    EXPECT_EQ("lora_unet_" + comfy.substr(std::string("diffusion_model_").size()), t.name)
        << t.comfy_path;
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

// What a checkpoint declares of itself holds the flags to it: ComfyUI's v_pred / ztsnr markers
// (NoobAI-XL v-pred's; SD1.x files carry them too) in a single file, or a diffusers folder's
// scheduler config, make a run without --v_parameterization (--zero_terminal_snr) a clear error,
// from the header alone, and lorapipe-inspect says so; EDM's markers are refused by name. Broken
// parts are named: a 0-D or int OpenCLIP tensor, a tokenizer_2/special_tokens_map.json whose pad
// token is no token.
TEST(SdxlCheckpoint, DeclaredVPredictionHoldsTheFlagsAndBrokenPartsAreNamed) {
  const auto dir = testing::make_temp_dir("sdxl-declared");
  const TinyCheckpoint tiny = write_tiny_sdxl_checkpoint(dir / "model", 4);
  LoadOptions options;
  options.tokenizer = tiny.tokenizer;
  const auto plain = load_model(tiny.single_file, options);
  EXPECT_TRUE(plain->model_family().declared_by.empty());
  EXPECT_NO_THROW(check_declared_objective(plain->model_family(), "plain", false, false));

  const SafetensorsFile original = SafetensorsFile::open(tiny.single_file);
  const auto metadata = original.metadata();
  auto tensors = read_tensors(original);
  auto with = [&](std::map<std::string, at::Tensor> extra, const std::string& name) {
    auto changed = tensors;
    for (auto& [key, value] : extra) changed[key] = value;
    testing::write_all(dir / name, changed, {metadata.begin(), metadata.end()});
    return dir / name;
  };
  const fs::path vpred = with({{"v_pred", torch::empty({0})}, {"ztsnr", torch::empty({0})}},
                              "vpred.safetensors");
  const auto model = load_model(vpred, options);
  const ModelFamily& family = model->model_family();
  EXPECT_EQ(family.prediction_type, "v_prediction");
  EXPECT_TRUE(family.declares_zero_terminal_snr);
  auto refusal = [&](bool v, std::optional<bool> zsnr) -> std::string {
    try {
      check_declared_objective(family, vpred.string(), v, zsnr);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal(false, false).find("its keys v_pred and ztsnr): pass --v_parameterization and "
                                       "--zero_terminal_snr"),
            std::string::npos)
      << refusal(false, false);
  EXPECT_NE(refusal(true, false).find("pass --zero_terminal_snr"), std::string::npos)
      << refusal(true, false);
  EXPECT_EQ(refusal(true, true), "");
  EXPECT_EQ(refusal(true, std::nullopt), "") << "the sampler has no --zero_terminal_snr";
  EXPECT_NE(refusal(false, std::nullopt).find("pass --v_parameterization,"), std::string::npos)
      << refusal(false, std::nullopt);
  EXPECT_NE(refusal(false, true).find("pass --v_parameterization,"), std::string::npos)
      << "--zero_terminal_snr is given already: " << refusal(false, true);
  // From the header alone, as the stages' --check_flags read it before anything loads.
  EXPECT_THROW(check_declared_objective(vpred, false, false), InputError);
  EXPECT_NO_THROW(check_declared_objective(vpred, true, true));
  EXPECT_NO_THROW(check_declared_objective(tiny.single_file, false, false));
  const std::string described = inspect_checkpoint(vpred);
  EXPECT_NE(described.find("prediction: v-prediction, zero terminal SNR"), std::string::npos)
      << described;

  // A diffusers folder says it in its scheduler config.
  const fs::path folder = dir / "folder";
  fs::copy(tiny.diffusers, folder, fs::copy_options::recursive);
  fs::create_directories(folder / "scheduler");
  std::ofstream(folder / "scheduler" / "scheduler_config.json")
      << R"({"_class_name": "EulerDiscreteScheduler", "prediction_type": "v_prediction"})";
  const auto from_folder = load_model(folder);
  EXPECT_EQ(from_folder->model_family().prediction_type, "v_prediction");
  EXPECT_FALSE(from_folder->model_family().declares_zero_terminal_snr);
  EXPECT_THROW(check_declared_objective(from_folder->model_family(), "folder", false, false),
               InputError);

  // A pad token that is no token: named, not passed over for the default.
  std::ofstream(folder / "tokenizer_2" / "special_tokens_map.json")
      << R"({"pad_token": {"content": 5}})";
  try {
    (void)load_model(folder);
    ADD_FAILURE() << "a pad token of 5 was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("special_tokens_map.json: pad_token"), std::string::npos)
        << e.what();
  }

  auto refused = [&](const fs::path& file, const std::string& expected) {
    try {
      (void)load_model(file, options);
      ADD_FAILURE() << file << " loaded";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused(with({{"edm_mean", torch::zeros({1, 4, 1, 1})}, {"edm_std", torch::ones({1, 4, 1, 1})}},
               "edm.safetensors"),
          "marks an EDM model");
  const std::string bias = "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_bias";
  ASSERT_TRUE(tensors.count(bias));
  refused(with({{bias, torch::zeros({})}}, "bias.safetensors"), bias + " is 0-D");
  const std::string norm = "conditioner.embedders.1.model.ln_final.weight";
  ASSERT_TRUE(tensors.count(norm));
  refused(with({{norm, tensors.at(norm).to(torch::kInt)}}, "int.safetensors"),
          norm + " is Int, not a floating-point tensor");

  // SD1.x files carry the same markers (ComfyUI writes v_pred into any v-prediction model).
  const TinyCheckpoint sd = write_tiny_checkpoint(dir / "sd15", 4);
  const SafetensorsFile sd_file = SafetensorsFile::open(sd.single_file);
  auto sd_tensors = read_tensors(sd_file);
  sd_tensors["v_pred"] = torch::empty({0});
  testing::write_all(dir / "sd15-vpred.safetensors", sd_tensors, sd_file.metadata());
  LoadOptions sd_options;
  sd_options.tokenizer = sd.tokenizer;
  const auto sd_model = load_model(dir / "sd15-vpred.safetensors", sd_options);
  EXPECT_EQ(sd_model->model_family().name, "sd15");
  EXPECT_EQ(sd_model->model_family().declared_by, "its key v_pred");
  fs::remove_all(dir);
}

// SDXL's VAE overflows in fp16: its decoder's activations pass 65504 (why the fixed fp16 VAE
// exists). Its weights cannot be had here, so the tiny SDXL's decoder input convolution is
// scaled up until its activations pass fp16's range as the real VAE's do: decoded in fp16 the
// image is not finite; in the dtype the stages pick for SDXL (vae_compute_dtype: fp32 unless
// --vae gives another VAE) it is, and equals the fp32 decode.
TEST(SdxlVae, OverflowsInFp16AndTheDefaultDtypeAvoidsIt) {
  const ModelFamily& sdxl = model_family("sdxl");
  const ModelFamily& sd15 = model_family("sd15");
  EXPECT_EQ(vae_compute_dtype(sdxl, torch::kHalf, /*vae_given=*/false, false), torch::kFloat);
  EXPECT_EQ(vae_compute_dtype(sdxl, torch::kHalf, /*vae_given=*/true, false), torch::kHalf);
  EXPECT_EQ(vae_compute_dtype(sdxl, torch::kBFloat16, false, false), torch::kBFloat16);
  EXPECT_EQ(vae_compute_dtype(sd15, torch::kHalf, false, false), torch::kHalf);
  EXPECT_EQ(vae_compute_dtype(sd15, torch::kHalf, false, /*no_half_vae=*/true), torch::kFloat);

  const auto dir = testing::make_temp_dir("sdxl-vae");
  const TinyCheckpoint tiny = write_tiny_sdxl_checkpoint(dir, 2);
  auto decode = [&](c10::ScalarType dtype) {
    LoadOptions options;
    options.vae_dtype = dtype;
    const auto model = load_model(tiny.diffusers, options);
    {
      torch::NoGradGuard no_grad;
      auto& conv_in = *model->vae_module().named_parameters().find("decoder.conv_in.weight");
      conv_in.mul_(4e4);
    }
    torch::NoGradGuard no_grad;
    const at::Tensor latents =
        torch::randn({1, 4, 8, 8}, at::detail::createCPUGenerator(3), torch::kFloat32);
    return model->decode_latents(latents).to(torch::kFloat32);
  };
  const at::Tensor half = decode(torch::kHalf);
  const at::Tensor chosen = decode(vae_compute_dtype(sdxl, torch::kHalf, false, false));
  const at::Tensor wide = decode(torch::kFloat);
  EXPECT_FALSE(torch::isfinite(half).all().item<bool>()) << "fp16 should overflow";
  EXPECT_TRUE(torch::isfinite(chosen).all().item<bool>());
  EXPECT_TRUE(torch::equal(chosen, wide));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lorapipe::models
