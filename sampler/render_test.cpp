// sampler/render.h against diffusers' StableDiffusionPipeline on lorapipe's tiny SD1.5 (fp32,
// CPU, the same weights, prompt, negative prompt and initial latents; 20 steps, CFG 7.5), one
// render per sampler, with the schedulers kohya builds: sampler/reference/render_reference.py.
//
// Tolerances, the issue's: the final latents within 1e-4 of their own scale (the largest |latent|
// of the reference's), every step's latents within 1e-4 of the trajectory's scale, and every
// decoded pixel within 1/255. Both sides run the same fp32 kernels in the same formulation: the
// forced math attention follows diffusers' AttnProcessor in the UNet and VAE (heads folded into
// the batch, the scale inside baddbmm) and transformers' eager attention in the text encoder,
// and a LoRA is merged as diffusers' fuse_lora merges it (W + scale * up @ down), or computed
// beside float8 weights as peft computes it unfused. Measured (printed): every render is
// bit-identical to diffusers' (0 difference, 0/255) except where a sampler's timesteps are
// computed from its sigmas in fp32 on its own side (Euler Karras, DPM2, DPM2 a, LMS): at most
// 1.2e-6 of their scale. Before the formulations matched, DDIM measured 1.3e-4 of its final
// latents' scale, over the bound: rounding in each UNet call, scaled by CFG 7.5 over 20 steps.

#include "sampler/render.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "common/error.h"
#include "models/attention.h"
#include "models/float8.h"
#include "models/parity_util.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "models/lora_merge.h"

namespace lorapipe::sampler {
namespace {

namespace fs = std::filesystem;
using models::MergedLora;
using models::MergedLoras;

class SamplerParityRender : public ::testing::Test {
 protected:
  // The tiny model is written per process (seed 5, the same bytes every time); the reference's
  // renders are computed once per build tree for those bytes (models/parity_util.h).
  static void SetUpTestSuite() {
    dir_ = models::testing::make_temp_dir("render");
    tiny_ = models::write_tiny_checkpoint(dir_ / "model", /*seed=*/5);
    ref_ = models::testing::cached_reference("sampler/reference/render_reference.py",
                                             {tiny_.diffusers});
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // `prompt`: "long" or "weighted" renders that prompt of request.json (conditioned as kohya's
  // sample images are) instead of the plain one.
  // `fp8`: the U-Net's and text encoder's Linear and Conv2d weights stored in float8 (the
  // sampler's --fp8_base), so the LoRA goes into the layers' slots.
  // `lora_file`: the LoRA of the *_lora renders, in kohya's naming, or lora_peft.safetensors, the
  // same LoRA as diffusers saves it (PEFT's naming).
  void check(const std::string& sampler, bool with_lora = false, const std::string& prompt = "",
             bool fp8 = false, const std::string& lora_file = "lora.safetensors") {
    models::set_force_math_attention(true);
    const auto owned = models::load_model(tiny_.diffusers);
    models::DiffusionModel& model = *owned;
    if (fp8) {
      models::store_weights_in_float8(model.denoiser_module());
      models::store_weights_in_float8(model.text_encoder_module());
    }
    std::optional<MergedLora> lora;
    std::map<std::string, torch::Tensor> before;  // in fp32: float8 widens exactly
    if (with_lora) {
      for (const auto& item : model.denoiser_module().named_parameters())
        before[item.key()] = item.value().to(torch::kFloat);
      for (const auto& item : model.text_encoder_module().named_parameters()) {
        before["te." + item.key()] = item.value().to(torch::kFloat);
      }
      lora.emplace(model, ref_ / lora_file, /*multiplier=*/1.0);
      ASSERT_GT(lora->module_count(), 0u);
      // In the layers' slots (the sampler's way), over float8 weights or not: no weight is copied.
      EXPECT_EQ(lora->slotted_count(), lora->module_count());
      EXPECT_EQ(lora->copied_bytes(), 0);
    }
    std::ifstream in(ref_ / "request.json");
    const nlohmann::json r = nlohmann::json::parse(in);
    const std::string tag = sampler + (with_lora ? "_lora" : "") +
                            (prompt.empty() ? "" : "_" + prompt) + (fp8 ? "_fp8" : "");
    const auto ref =
        models::read_tensors(models::SafetensorsFile::open(ref_ / (tag + ".safetensors")));
    RenderRequest request;
    request.prompt = r[prompt.empty() ? "prompt" : prompt + "_prompt"];
    request.negative_prompt = r["negative_prompt"];
    request.width = r["width"];
    request.height = r["height"];
    request.steps = r["steps"];
    request.cfg_scale = r["cfg_scale"];
    request.seed = r["seed"];
    request.sampler = sampler;
    RenderOptions options;
    options.initial_latents = ref.at("initial");
    // Every step's latents against the pipeline's (its callback_on_step_end), relative to the
    // trajectory's scale: the error must not grow faster than the rounding it carries.
    const double scale = ref.at("trajectory_scale").item<double>();
    double worst_step = 0;
    options.on_step = [&](int i, const at::Tensor& latents) {
      const double e =
          (latents.cpu() - ref.at("step." + std::to_string(i))).abs().max().item<double>() / scale;
      if (std::getenv("LORAPIPE_RENDER_TRACE")) std::printf("  step %2d: %.2e\n", i, e);
      worst_step = std::max(worst_step, e);
    };
    const RenderResult result = render(model, request, options);
    const torch::Tensor& expected = ref.at("latents");
    ASSERT_EQ(result.latents.sizes(), expected.sizes());
    // The final latents against their own scale (the largest |latent| of the reference's).
    const double final_scale = expected.abs().max().item<double>();
    const double latent_error =
        (result.latents - expected).abs().max().item<double>() / final_scale;
    const int pixel_error = (result.image.to(torch::kInt32) - ref.at("image").to(torch::kInt32))
                                .abs()
                                .max()
                                .item<int>();
    std::printf(
        "[render] %-12s final latents: %.2e of their scale %.3g (limit 1e-4), %.2e absolute; "
        "steps: %.2e of the trajectory's scale %.3g (limit 1e-4); largest pixel difference "
        "%d/255 (limit 1)\n",
        tag.c_str(), latent_error, final_scale,
        (result.latents - expected).abs().max().item<double>(), worst_step, scale, pixel_error);
    EXPECT_LE(latent_error, 1e-4) << sampler;
    EXPECT_LE(worst_step, 1e-4) << sampler << ": some step's latents";
    if (with_lora) {
      // The LoRA matters: its render is far from the plain one (else the parity says nothing).
      const auto plain = models::read_tensors(
          models::SafetensorsFile::open(ref_ / (sampler + ".safetensors")));
      EXPECT_GT((expected - plain.at("latents")).abs().max().item<double>(), 1e-2 * scale);
      // Taken out again, the base is bit-identical to before, and no slot holds anything.
      lora->restore();
      for (const auto& item : model.denoiser_module().named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value().to(torch::kFloat), before.at(item.key())))
            << item.key();
      }
      for (const auto& item : model.text_encoder_module().named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value().to(torch::kFloat), before.at("te." + item.key())))
            << item.key();
      }
      for (const auto& target : model.lora_targets(true, true)) {
        EXPECT_EQ(target.slot(), nullptr) << target.name;
      }
    }
    EXPECT_LE(pixel_error, 1) << sampler;
  }

  static fs::path dir_;
  static fs::path ref_;
  static models::TinyCheckpoint tiny_;
};
fs::path SamplerParityRender::dir_;
fs::path SamplerParityRender::ref_;
models::TinyCheckpoint SamplerParityRender::tiny_;

TEST_F(SamplerParityRender, Ddim) { check("ddim"); }
TEST_F(SamplerParityRender, Euler) { check("euler"); }
TEST_F(SamplerParityRender, EulerAncestral) { check("euler_a"); }
TEST_F(SamplerParityRender, DpmSolverPlusPlus2M) { check("dpmsolver++"); }
TEST_F(SamplerParityRender, DpmSolverPlusPlus2MKarras) { check("dpmsolver++_karras"); }
TEST_F(SamplerParityRender, EulerKarras) { check("euler_karras"); }
TEST_F(SamplerParityRender, DpmSolver2M) { check("dpmsolver"); }
TEST_F(SamplerParityRender, DpmSolverPlusPlus2SSinglestep) { check("dpmsingle"); }
// Two model calls a step (the second at an fp32 timestep between the table's), and for DPM2
// ancestral fresh noise after each pair: the render loop follows the scheduler's calls.
TEST_F(SamplerParityRender, Heun) { check("heun"); }
TEST_F(SamplerParityRender, Dpm2) { check("dpm_2"); }
TEST_F(SamplerParityRender, Dpm2Ancestral) { check("dpm_2_a"); }
TEST_F(SamplerParityRender, Lms) { check("lms"); }
TEST_F(SamplerParityRender, PndmWithItsRungeKuttaWarmUp) { check("pndm"); }
TEST_F(SamplerParityRender, Ddpm) { check("ddpm"); }
// A kohya-format LoRA on the UNet and the text encoder: diffusers' load_lora_weights against
// lorapipe's merge, then the merge taken out bit for bit.
TEST_F(SamplerParityRender, DdimWithLora) { check("ddim", /*with_lora=*/true); }
// The same LoRA as diffusers saves it (PEFT's naming: unet.….lora_A.weight, its alpha in the
// file's lora_adapter_metadata; U-Net convolutions and text-encoder layers among its modules),
// against the render diffusers makes with it loaded.
TEST_F(SamplerParityRender, DdimWithTheLoraInDiffusersNaming) {
  check("ddim", /*with_lora=*/true, "", /*fp8=*/false, "lora_peft.safetensors");
}
// A prompt of about 100 tokens, conditioned as kohya's sample images are (two whole chunks, kept
// whole: 154 states), the reference's handed to the pipeline as prompt_embeds.
TEST_F(SamplerParityRender, DdimWithALongPrompt) {
  check("ddim", /*with_lora=*/false, "long");
}
// A1111 attention syntax ((x:1.3), [x], ((x)), escaped brackets) weighs the states as kohya's
// sample images do.
TEST_F(SamplerParityRender, DdimWithAttentionWeights) {
  check("ddim", /*with_lora=*/false, "weighted");
}
TEST_F(SamplerParityRender, EulerAncestralWithLora) { check("euler_a", /*with_lora=*/true); }
TEST_F(SamplerParityRender, EulerWithLora) { check("euler", /*with_lora=*/true); }
TEST_F(SamplerParityRender, DpmSolverPlusPlus2MWithLora) { check("dpmsolver++", /*with_lora=*/true); }
TEST_F(SamplerParityRender, DpmSolverPlusPlus2MKarrasWithLora) {
  check("dpmsolver++_karras", /*with_lora=*/true);
}
// Over float8 base weights (--fp8_base): diffusers with its base weights rounded to float8 and
// the LoRA computed beside them, as lorapipe's slots compute it. A LoRA merged into the float8
// weights instead would be mostly rounded away, far outside the tolerance.
TEST_F(SamplerParityRender, DdimWithLoraOverFloat8Weights) {
  check("ddim", /*with_lora=*/true, "", /*fp8=*/true);
}

// Without weights and within 75 tokens, the sample conditioning is exactly the plain one (what
// the short-prompt parities above rely on); a weight changes it.
TEST_F(SamplerParityRender, PromptConditioningIsPlainWithoutWeights) {
  const auto owned = models::load_model(tiny_.diffusers);
  models::DiffusionModel& model = *owned;
  const std::vector<std::string> plain = {"blurry", "a red circle on a blue background"};
  const models::Conditioning a = model.encode_prompts(plain, /*clip_skip=*/1);
  const models::Conditioning b = model.encode_text(model.tokenize(plain), /*clip_skip=*/1);
  EXPECT_TRUE(torch::equal(a.hidden_states, b.hidden_states));
  const models::Conditioning w =
      model.encode_prompts({"blurry", "a (red:1.5) circle on a blue background"}, 1);
  EXPECT_TRUE(torch::equal(w.hidden_states[0], a.hidden_states[0])) << "the negative prompt";
  EXPECT_GT((w.hidden_states[1] - a.hidden_states[1]).abs().max().item<double>(), 1e-3);
}

// A LoRA in ComfyUI's naming (its layers by the single file's ldm paths under diffusion_model.,
// CLIP-L's under text_encoders.clip_l.transformer.) is the kohya file the diffusers renders above
// check, renamed: half of its modules as lora_down / lora_up / alpha, the rest as lora_A / lora_B
// with no alpha and the scale folded into B (diffusion-pipe's files; alpha = rank). Merged, every
// weight equals the kohya file's merge: bit for bit where the tensors are the same, within 1e-6
// relative where B carries the scale (fp32 rounds a scaled product and a product scaled apart).
TEST_F(SamplerParityRender, LoraInComfyUiNamingMergesAsItsKohyaNaming) {
  const auto owned = models::load_model(tiny_.diffusers);
  models::DiffusionModel& model = *owned;
  const auto kohya = models::testing::read_all(ref_ / "lora.safetensors");
  std::map<std::string, torch::Tensor> comfy;
  std::set<std::string> folded;
  size_t index = 0, text = 0;
  for (const models::LoraTarget& t : model.lora_targets(true, true)) {
    if (!kohya.count(t.name + ".lora_down.weight")) continue;
    const torch::Tensor down = kohya.at(t.name + ".lora_down.weight");
    const torch::Tensor up = kohya.at(t.name + ".lora_up.weight");
    const torch::Tensor alpha = kohya.at(t.name + ".alpha");
    text += t.text_encoder;
    EXPECT_TRUE(t.comfy_path.starts_with(t.text_encoder ? "text_encoders.clip_l.transformer.text_model."
                                                        : "diffusion_model."))
        << t.comfy_path;
    if (index++ % 2 == 0) {
      comfy[t.comfy_path + ".lora_down.weight"] = down;
      comfy[t.comfy_path + ".lora_up.weight"] = up;
      comfy[t.comfy_path + ".alpha"] = alpha;
    } else {
      comfy[t.comfy_path + ".lora_A.weight"] = down;
      comfy[t.comfy_path + ".lora_B.weight"] =
          up * (alpha.item<double>() / static_cast<double>(down.size(0)));
      folded.insert(t.name);
    }
    if (t.module_path == "down_blocks.0.attentions.0.proj_in") {
      EXPECT_EQ(t.comfy_path, "diffusion_model.input_blocks.1.1.proj_in");
    }
  }
  ASSERT_EQ(index * 3, kohya.size()) << "every module of the kohya file renamed";
  ASSERT_GT(text, 0u) << "the reference LoRA adapts the text encoder";
  models::testing::write_all(dir_ / "comfy.safetensors", comfy);

  std::map<std::string, torch::Tensor> expected;
  {
    MergedLora lora(model, ref_ / "lora.safetensors", 0.8, MergedLora::Application::kMergedRestorable);
    for (const models::LoraTarget& t : model.lora_targets(true, true)) {
      expected[t.name] = t.weight().clone();
    }
  }
  MergedLora lora(model, dir_ / "comfy.safetensors", 0.8, MergedLora::Application::kMergedRestorable);
  EXPECT_TRUE(lora.changes_text_encoder());
  EXPECT_EQ(lora.module_count(), index);
  for (const models::LoraTarget& t : model.lora_targets(true, true)) {
    if (folded.count(t.name)) {
      EXPECT_TRUE(torch::allclose(t.weight(), expected.at(t.name), 1e-6, 1e-7)) << t.name;
    } else {
      EXPECT_TRUE(torch::equal(t.weight(), expected.at(t.name))) << t.name;
    }
  }
}

TEST_F(SamplerParityRender, LoraForAnotherModelOrBrokenIsRefusedAndChangesNothing) {
  const auto owned = models::load_model(tiny_.diffusers);
  models::DiffusionModel& model = *owned;
  const torch::Tensor probe = model.denoiser_module().named_parameters()["conv_in.weight"].clone();
  // Keys of another model: named.
  auto tensors =
      models::read_tensors(models::SafetensorsFile::open(ref_ / "lora.safetensors"));
  tensors["lora_unet_down_blocks_9_attentions_0_proj_in.lora_down.weight"] = torch::zeros({4, 8});
  tensors["lora_unet_down_blocks_9_attentions_0_proj_in.lora_up.weight"] = torch::zeros({8, 4});
  std::vector<torch::Tensor> keep;
  std::vector<models::TensorToWrite> out;
  for (const auto& [key, value] : tensors) {
    keep.push_back(value.to(torch::kFloat32).contiguous());
    out.push_back(
        {key, models::Dtype::kF32, keep.back().sizes().vec(),
         std::string_view(static_cast<const char*>(keep.back().data_ptr()), keep.back().nbytes())});
  }
  models::write_safetensors(dir_ / "other.safetensors", out);
  try {
    MergedLora lora(model, dir_ / "other.safetensors", 1.0);
    FAIL() << "merged a LoRA with a layer this model lacks";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("lora_unet_down_blocks_9_attentions_0_proj_in"),
              std::string::npos)
        << e.what();
  }
  // A LoRA in dotted module paths: ComfyUI's with a weight missing, and older diffusers' (not
  // read): each named as such, not as LoHa.
  for (const auto& [key, says] :
       {std::pair{"diffusion_model.input_blocks.1.1.proj_in.lora_down.weight",
                  "layer diffusion_model.input_blocks.1.1.proj_in lacks its up"},
        std::pair{"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor."
                  "to_q_lora.down.weight",
                  "by a dotted module path lorapipe does not read (older diffusers'"}}) {
    const torch::Tensor down = torch::zeros({4, 8});
    models::write_safetensors(
        dir_ / "dotted.safetensors",
        {{key, models::Dtype::kF32, {4, 8},
          std::string_view(static_cast<const char*>(down.data_ptr()), down.nbytes())}});
    try {
      MergedLora lora(model, dir_ / "dotted.safetensors", 1.0);
      FAIL() << "merged a LoRA of dotted names";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  // Half written: named, nothing merged.
  const auto size = fs::file_size(ref_ / "lora.safetensors");
  fs::copy_file(ref_ / "lora.safetensors", dir_ / "half.safetensors",
                fs::copy_options::overwrite_existing);
  fs::resize_file(dir_ / "half.safetensors", size / 2);
  EXPECT_THROW(MergedLora(model, dir_ / "half.safetensors", 1.0), InputError);
  EXPECT_TRUE(torch::equal(model.denoiser_module().named_parameters()["conv_in.weight"], probe));
  const auto target = model.lora_targets(true, true).front();
  const torch::Tensor untouched = target.weight().clone();
  EXPECT_THROW(MergedLora(model, dir_ / "other.safetensors", 1.0), InputError);
  EXPECT_TRUE(torch::equal(target.weight(), untouched)) << "a refused file merged nothing";

  // A module that is no LoRA's: named with the module and what is wrong, before anything merges
  // (NaN or infinity would merge into the weights and render black; rank 0 divides by zero).
  const auto lora = models::read_tensors(models::SafetensorsFile::open(ref_ / "lora.safetensors"));
  std::string module;
  for (const auto& [key, value] : lora) {
    const std::string suffix = ".lora_down.weight";
    if (key.ends_with(suffix)) {
      module = key.substr(0, key.size() - suffix.size());
      break;
    }
  }
  ASSERT_FALSE(module.empty());
  const at::Tensor down = lora.at(module + ".lora_down.weight");
  const at::Tensor up = lora.at(module + ".lora_up.weight");
  auto broken = [&](const std::map<std::string, at::Tensor>& change, const std::string& expected) {
    auto changed = lora;
    for (const auto& [key, value] : change) changed[key] = value;
    models::testing::write_all(dir_ / "broken.safetensors", changed);
    for (auto application :
         {MergedLora::Application::kInSlots, MergedLora::Application::kMergedRestorable,
          MergedLora::Application::kMergedForGood}) {
      try {
        MergedLora merged(model, dir_ / "broken.safetensors", 1.0, application);
        ADD_FAILURE() << "merged a LoRA expected to fail with: " << expected;
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("module " + module + ": " + expected),
                  std::string::npos)
            << e.what();
      }
    }
    EXPECT_TRUE(torch::equal(target.weight(), untouched)) << expected;
  };
  at::Tensor nan_up = up.clone();
  nan_up.view(-1)[0] = std::nan("");
  broken({{module + ".lora_up.weight", nan_up}}, "lora_up holds NaN or infinity");
  broken({{module + ".alpha", torch::full({}, INFINITY)}}, "alpha is inf");
  broken({{module + ".alpha", torch::ones({2})}}, "alpha has shape [2], not one number");
  broken({{module + ".lora_down.weight", down.flatten()}}, "lora_down has shape");
  broken({{module + ".lora_down.weight", down.to(torch::kInt8)}}, "lora_down is Char");
  broken({{module + ".lora_down.weight", down.narrow(0, 0, 0)},
          {module + ".lora_up.weight", up.narrow(1, 0, 0)}},
         "lora_down is empty");
  // diffusers' naming is read (models/peft_lora.h): a module in it without its lora_B is named.
  models::testing::write_all(dir_ / "peft.safetensors",
                             {{"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight", down}});
  try {
    MergedLora merged(model, dir_ / "peft.safetensors", 1.0);
    ADD_FAILURE() << "merged a PEFT-named LoRA without its lora_B";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "module unet.down_blocks.0.attentions.0.proj_in lacks its lora_B weight"),
              std::string::npos)
        << e.what();
  }
}

// Two LoRAs on top of one another come out newest first, so the base is bit-identical to before:
// in the layers' slots (the sampler's way: no weight changes, the slots are empty after) and
// merged into the weights with copies kept; and a stored alpha of 0 means the rank (kohya), not a
// LoRA that does nothing.
TEST_F(SamplerParityRender, StackedLorasRestoreTheBaseAndAlphaZeroMeansTheRank) {
  const auto owned = models::load_model(tiny_.diffusers);
  models::DiffusionModel& model = *owned;
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : model.denoiser_module().named_parameters()) before[item.key()] = item.value().clone();
  for (const auto application :
       {MergedLora::Application::kInSlots, MergedLora::Application::kMergedRestorable}) {
    {
      MergedLoras stack;
      stack.add(model, ref_ / "lora.safetensors", 1.0, application);
      stack.add(model, ref_ / "lora.safetensors", 0.5, application);
      ASSERT_EQ(stack.size(), 2u);
    }
    for (const auto& item : model.denoiser_module().named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), before.at(item.key()))) << item.key() << " changed";
    }
    for (const auto& target : model.lora_targets(true, true)) {
      EXPECT_EQ(target.slot(), nullptr) << target.name;
    }
  }

  // The same LoRA with every alpha written as 0, and as its rank: the same merge.
  auto unet_weights = [&] {
    std::map<std::string, torch::Tensor> out;
    for (const auto& item : model.denoiser_module().named_parameters()) out[item.key()] = item.value().clone();
    return out;
  };
  const auto tensors =
      models::read_tensors(models::SafetensorsFile::open(ref_ / "lora.safetensors"));
  auto write_with_alpha = [&](const fs::path& path, bool zero) {
    std::vector<torch::Tensor> keep;
    std::vector<models::TensorToWrite> out;
    auto add = [&](const std::string& key, const torch::Tensor& value) {
      keep.push_back(value.to(torch::kFloat32).contiguous());
      const torch::Tensor& t = keep.back();
      out.push_back({key, models::Dtype::kF32, t.sizes().vec(),
                     std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
    };
    const std::string down_suffix = ".lora_down.weight";
    for (const auto& [key, value] : tensors) {
      if (key.ends_with(".alpha")) continue;
      add(key, value);
      if (key.ends_with(down_suffix)) {
        const std::string module = key.substr(0, key.size() - down_suffix.size());
        add(module + ".alpha", torch::tensor(zero ? 0.0f : static_cast<float>(value.size(0))));
      }
    }
    models::write_safetensors(path, out);
  };
  write_with_alpha(dir_ / "alpha0.safetensors", true);
  write_with_alpha(dir_ / "alpha_rank.safetensors", false);
  std::map<std::string, torch::Tensor> with_zero, with_rank;
  {
    MergedLora zero(model, dir_ / "alpha0.safetensors", 1.0,
                    MergedLora::Application::kMergedRestorable);
    with_zero = unet_weights();
  }
  {
    MergedLora rank(model, dir_ / "alpha_rank.safetensors", 1.0,
                    MergedLora::Application::kMergedRestorable);
    with_rank = unet_weights();
  }
  int changed = 0;
  for (const auto& [name, weight] : with_zero) {
    EXPECT_TRUE(torch::equal(weight, with_rank.at(name))) << name;
    changed += torch::equal(weight, before.at(name)) ? 0 : 1;
  }
  EXPECT_GT(changed, 0) << "an alpha of 0 merged nothing";
}

// Over float8 weights a stack shares each layer's slot: the file at 1.0 and again at 0.5 compute
// what it computes alone at 1.5 (the same sums in another grouping: 1e-5 relative), and taken
// out newest first the slots are empty again.
TEST_F(SamplerParityRender, StackedLorasOverFloat8WeightsShareTheSlots) {
  models::set_force_math_attention(true);
  const auto owned = models::load_model(tiny_.diffusers);
  models::DiffusionModel& model = *owned;
  models::store_weights_in_float8(model.denoiser_module());
  torch::manual_seed(3);
  const torch::Tensor latents = torch::randn({1, 4, 8, 8});
  const torch::Tensor t = torch::tensor({500}, torch::kInt64);
  // The tiny model's cross-attention width, from its first attention's key projection.
  const int64_t width = model.denoiser_module()
                            .named_parameters()["down_blocks.0.attentions.0.transformer_blocks.0"
                                                ".attn2.to_k.weight"]
                            .size(1);
  models::Conditioning context;
  context.hidden_states = torch::randn({1, model.model_family().text.max_length, width});
  auto denoise = [&] {
    torch::NoGradGuard no_grad;
    return model.denoise(latents, t, context);
  };
  torch::Tensor once;
  {
    MergedLora single(model, ref_ / "lora.safetensors", 1.5);
    once = denoise();
  }
  {
    MergedLoras stack;
    stack.add(model, ref_ / "lora.safetensors", 1.0);
    stack.add(model, ref_ / "lora.safetensors", 0.5);
    const torch::Tensor twice = denoise();
    EXPECT_LE(models::testing::relative_error(twice, once), 1e-5);
  }
  for (const auto& target : model.lora_targets(true, true)) {
    EXPECT_EQ(target.slot(), nullptr) << target.name;
  }
  EXPECT_GT(models::testing::relative_error(denoise(), once), 1e-3) << "the LoRA changed nothing";
}

}  // namespace
}  // namespace lorapipe::sampler
