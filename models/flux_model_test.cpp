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
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/inspect.h"
#include "models/lora_merge.h"
#include "models/loading.h"
#include "models/parity_util.h"
#include "models/placement.h"
#include "models/safetensors.h"
#include "models/sd15_keys.h"
#include "models/t5.h"
#include "models/tiny.h"
#include "models/weights.h"
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
  // `module`'s tensors under `prefix`; `storage` keeps their bytes.
  static std::vector<TensorToWrite> tensors_of(const torch::nn::Module& module,
                                               std::vector<at::Tensor>& storage,
                                               const std::string& prefix) {
    return module_tensors(module, storage, prefix);
  }
  // The AE's tensors in Black Forest Labs' (ldm's) names under `prefix`, as ae.safetensors and
  // ComfyUI's all-in-one file hold them.
  static std::vector<TensorToWrite> ae_tensors(const FluxModel& model,
                                               std::vector<at::Tensor>& storage,
                                               const std::string& prefix) {
    const KeyMap vae_map = sd15_vae_key_map(layout_of(model.vae->config()));
    std::vector<TensorToWrite> tensors = module_tensors(*model.vae, storage);
    for (TensorToWrite& t : tensors) {
      const auto ldm = vae_map.to_ldm(t.name);
      EXPECT_TRUE(ldm.has_value()) << t.name;
      t.name = prefix + (ldm ? ldm->substr(kLdmVaePrefix.size()) : t.name);
      // ldm keeps the AE's mid-block attention projections as 1x1 convolutions.
      if (t.name.find("mid.attn_1.") != std::string::npos && t.shape.size() == 2) {
        t.shape.push_back(1);
        t.shape.push_back(1);
      }
    }
    return tensors;
  }
  // `loaded` computes what `folder` computes, bit for bit: the conditioning of the reference's
  // prompts, one denoiser call on it, the AE's decode and (where `encode`) its encode.
  static void expect_same_model(FluxModel& folder, DiffusionModel& loaded, bool encode) {
    const auto ref = testing::read_all(ref_ / "reference.safetensors");
    torch::NoGradGuard no_grad;
    const Conditioning a = folder.encode_prompts(prompts(), 1);
    const Conditioning b = loaded.encode_prompts(prompts(), 1);
    EXPECT_TRUE(torch::equal(a.hidden_states, b.hidden_states));
    EXPECT_TRUE(torch::equal(a.pooled, b.pooled));
    DenoiseInput input;
    input.latents = ref.at("latents");
    input.time = ref.at("sigma");
    input.conditioning = &a;
    EXPECT_TRUE(torch::equal(loaded.denoise(input), folder.denoise(input)));
    EXPECT_TRUE(torch::equal(loaded.decode_latents(ref.at("latents")),
                             folder.decode_latents(ref.at("latents"))));
    if (encode) {
      EXPECT_TRUE(torch::equal(loaded.encode_images(ref.at("image")).mean,
                               folder.encode_images(ref.at("image")).mean));
    }
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
  // Without --apply_t5_attn_mask nothing reads a mask, and none is made (or cached).
  EXPECT_FALSE(c.mask.defined());
  EXPECT_FALSE(model.padding_is_masked());
  // With it, the mask marks the caption and its </s>: the padding of the shorter caption is 0.
  model.apply_t5_attn_mask = true;
  const Conditioning masked = model.encode_text(tokens, /*clip_skip=*/1);
  ASSERT_TRUE(masked.mask.defined());
  EXPECT_EQ(masked.mask.sizes(), tokens.ids[1].sizes());
  EXPECT_LT(masked.mask.sum().item<int64_t>(), masked.mask.numel());
  EXPECT_TRUE(model.padding_is_masked());
}

// kohya's partial caching: while CLIP-L's LoRA trains, T5's states come from the cache and T5
// is dropped. CLIP-L's pooled output is encoded anew over the cached states (here a stale pooled
// stands in the cached conditioning): equal, bit for bit, to encoding both.
TEST_F(FluxPipelineParity, PartialCachingEncodesClipLOverCachedT5States) {
  EXPECT_EQ(model_family("flux-dev").text.untrained_encoders, "T5-XXL");
  EXPECT_EQ(model_family("flux-schnell").text.untrained_encoders, "T5-XXL");
  EXPECT_TRUE(model_family("sd15").text.untrained_encoders.empty());
  EXPECT_TRUE(model_family("sdxl").text.untrained_encoders.empty());
  FluxModel model = load();
  model.apply_t5_attn_mask = true;
  torch::NoGradGuard no_grad;
  const TokenBatch tokens = model.tokenize(prompts());
  const Conditioning full = model.encode_text(tokens, /*clip_skip=*/1);
  const size_t clip_targets = model.lora_targets(/*text_encoder=*/true, false).size();
  model.release_untrained_text_encoders();
  size_t clip_params = 0;
  for (const auto& p : model.text_encoder_module().named_parameters()) {
    EXPECT_EQ(p.key().rfind("text_encoder.", 0), 0u) << p.key() << " is left after T5 went";
    ++clip_params;
  }
  EXPECT_GT(clip_params, 0u);
  EXPECT_EQ(model.lora_targets(/*text_encoder=*/true, false).size(), clip_targets);
  Conditioning cached = full;
  cached.pooled = torch::zeros_like(full.pooled);
  const Conditioning partial = model.encode_trained_text(tokens, /*clip_skip=*/1, cached);
  EXPECT_TRUE(torch::equal(partial.pooled, full.pooled));
  EXPECT_TRUE(partial.hidden_states.is_same(cached.hidden_states));
  EXPECT_TRUE(partial.mask.is_same(cached.mask));
  try {
    model.encode_text(tokens, /*clip_skip=*/1);
    ADD_FAILURE() << "encoded without T5";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("T5 was released"), std::string::npos) << e.what();
  }
}

// A LoRA in diffusers' PEFT naming (ai-toolkit's, SimpleTuner's and diffusers' own files)
// applies as FluxPipeline.load_lora_weights applies it (models/reference/peft_lora_reference.py):
// diffusers' split to_q/to_k/to_v/proj_mlp modules go into lorapipe's fused qkv and linear1, with
// parts the file leaves out; the other layers by diffusers' names; CLIP-L's modules; the scale
// from the file's lora_adapter_metadata, from `.alpha` tensors, or diffusers' default. In the
// layers' slots and merged, CLIP-L's pooled output and the velocity within 1e-4 of the
// reference's scale (both fp32; the LoRA changes them by 40% to 230%), and the base is restored.
// rsLoRA's alpha / sqrt(rank) is read from the metadata. A LoRA in ComfyUI's naming (the
// original layout's paths under diffusion_model. and text_encoders.clip_l.transformer.) applies
// as diffusers reads it too; the same LoRA as ComfyUI's lora_A / lora_B without alphas
// (diffusion-pipe's files), its scale folded into B, gives the same outputs.
TEST_F(FluxPipelineParity, DiffusersPeftLoraAppliesAsFluxPipelineLoadsIt) {
  const fs::path peft =
      testing::cached_reference("models/reference/peft_lora_reference.py", {ref_ / "flux"});
  const auto ref = testing::read_all(peft / "reference.safetensors");
  {
    std::map<std::string, at::Tensor> ab;
    const auto comfy = testing::read_all(peft / "comfy.safetensors");
    for (const auto& [key, t] : comfy) {
      const std::string down = ".lora_down.weight", up = ".lora_up.weight";
      if (key.ends_with(down)) {
        ab[key.substr(0, key.size() - down.size()) + ".lora_A.weight"] = t;
      } else if (key.ends_with(up)) {
        const std::string layer = key.substr(0, key.size() - up.size());
        const auto alpha = comfy.find(layer + ".alpha");
        const double scale =
            alpha == comfy.end() ? 1.0 : alpha->second.item<double>() / static_cast<double>(t.size(1));
        ab[layer + ".lora_B.weight"] = t * scale;
      }
    }
    testing::write_all(dir_ / "comfy_ab.safetensors", ab);
  }
  FluxModel model = load();
  torch::NoGradGuard no_grad;
  const at::Tensor base_pooled = model.encode_prompts(prompts(), 1).pooled;
  expect_close("flux pooled, no LoRA", base_pooled, ref.at("pooled_base"), 1e-4);
  for (const std::string file :
       {"with_metadata", "plain", "alphas", "rslora", "comfy", "comfy_ab"}) {
    const std::string name = file == "comfy_ab" ? "comfy" : file;
    const fs::path path =
        file == "comfy_ab" ? dir_ / (file + ".safetensors") : peft / (file + ".safetensors");
    for (auto application :
         {MergedLora::Application::kInSlots, MergedLora::Application::kMergedRestorable}) {
      const bool slots = application == MergedLora::Application::kInSlots;
      MergedLora lora(model, path, 1.0, application);
      EXPECT_TRUE(lora.changes_text_encoder()) << name;
      expect_close("lora " + file + (slots ? " in slots" : " merged") + ": pooled",
                   model.encode_prompts(prompts(), 1).pooled, ref.at("pooled_" + name), 1e-4);
      Conditioning c;
      c.hidden_states = ref.at("prompt_embeds");
      c.pooled = ref.at("pooled_" + name);
      DenoiseInput input;
      input.latents = ref.at("latents");
      input.time = ref.at("sigma");
      input.conditioning = &c;
      input.guidance = 3.5;
      expect_close("lora " + file + (slots ? " in slots" : " merged") + ": velocity",
                   model.denoise(input), ref.at("velocity_" + name), 1e-4);
    }
  }
  EXPECT_TRUE(torch::equal(model.encode_prompts(prompts(), 1).pooled, base_pooled));
  // .alpha tensors beside the metadata that would give another alpha: refused, as diffusers does.
  {
    const SafetensorsFile meta = SafetensorsFile::open(peft / "with_metadata.safetensors");
    testing::write_all(dir_ / "both.safetensors", testing::read_all(peft / "alphas.safetensors"),
                       meta.metadata());
    try {
      MergedLora lora(model, dir_ / "both.safetensors", 1.0);
      ADD_FAILURE() << "applied .alpha tensors beside lora_adapter_metadata";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("has both .alpha tensors and lora_adapter_metadata"),
                std::string::npos)
          << e.what();
    }
  }
  // A file of another model's layers is refused, naming them.
  auto tensors = testing::read_all(peft / "plain.safetensors");
  tensors["transformer.transformer_blocks.7.attn.to_q.lora_A.weight"] = torch::zeros({4, 32});
  tensors["transformer.transformer_blocks.7.attn.to_q.lora_B.weight"] = torch::zeros({32, 4});
  testing::write_all(dir_ / "other.safetensors", tensors);
  try {
    MergedLora lora(model, dir_ / "other.safetensors", 1.0);
    ADD_FAILURE() << "applied a LoRA with a module of no layer";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("transformer.transformer_blocks.7.attn.to_q"),
              std::string::npos)
        << e.what();
  }
}

// With --apply_t5_attn_mask the transformer never attends to T5's padding, so the cache keeps
// only the states up to </s> and the trainer pads zeros back: the velocity is then the same,
// bit for bit, as with every state T5 produced.
TEST_F(FluxPipelineParity, MaskedPaddingStatesDoNotChangeTheVelocity) {
  FluxModel model = load();
  model.apply_t5_attn_mask = true;
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  torch::NoGradGuard no_grad;
  const Conditioning full = model.encode_text(model.tokenize(prompts()), /*clip_skip=*/1);
  Conditioning cut = full;
  cut.hidden_states = full.hidden_states.clone();
  int64_t zeroed = 0;
  for (int64_t b = 0; b < full.mask.size(0); ++b) {
    const int64_t kept = full.mask[b].sum().item<int64_t>();
    cut.hidden_states[b].narrow(0, kept, full.mask.size(1) - kept).zero_();
    zeroed += full.mask.size(1) - kept;
  }
  ASSERT_GT(zeroed, 0) << "the prompts fill T5's length: nothing is left out";
  DenoiseInput input;
  input.latents = ref.at("latents");
  input.time = ref.at("sigma");
  input.guidance = 3.5;
  input.conditioning = &full;
  const at::Tensor expected = model.denoise(input);
  input.conditioning = &cut;
  EXPECT_TRUE(torch::equal(model.denoise(input), expected));
  // Without the mask the padding is attended, and it matters.
  model.apply_t5_attn_mask = false;
  const at::Tensor unmasked = model.denoise(input);
  input.conditioning = &full;
  EXPECT_FALSE(torch::equal(model.denoise(input), unmasked));
}

// FLUX.1 as kohya users hold it: the transformer alone in Black Forest Labs' names (here with
// ComfyUI's model.diffusion_model. prefix), and --clip_l, --t5xxl, --ae and --t5_tokenizer
// beside it, written from the diffusers folder's weights. load_model detects dev by its keys and
// the model it builds conditions, denoises and decodes exactly as the folder's does. Without a
// part, the error names the flag that gives it.
TEST_F(FluxPipelineParity, SingleFileTransformerWithKohyasPartsEqualsTheFolder) {
  FluxModel folder = load();
  const fs::path dir = dir_ / "kohya";
  fs::create_directories(dir);
  auto write = [&](const fs::path& file, const std::vector<TensorToWrite>& tensors,
                   const char* config) {
    write_safetensors(file, tensors,
                      {{"lorapipe.config", read_text(ref_ / "flux" / config / "config.json")}});
  };
  std::vector<at::Tensor> storage;
  write(dir / "flux1-dev.safetensors",
        tensors_of(*folder.transformer, storage, "model.diffusion_model."), "transformer");
  write(dir / "clip_l.safetensors", tensors_of(*folder.clip, storage, ""), "text_encoder");
  write(dir / "t5xxl.safetensors", tensors_of(*folder.t5, storage, ""), "text_encoder_2");
  write(dir / "ae.safetensors", ae_tensors(folder, storage, ""), "vae");

  const fs::path transformer = dir / "flux1-dev.safetensors";
  EXPECT_EQ(detect_family(transformer).family, "flux-dev");
  LoadOptions options;
  try {
    (void)load_model(transformer, options);
    ADD_FAILURE() << "loaded without --clip_l";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--clip_l"), std::string::npos) << e.what();
  }
  options.parts.clip_l = dir / "clip_l.safetensors";
  options.parts.t5xxl = dir / "t5xxl.safetensors";
  options.parts.ae = dir / "ae.safetensors";
  options.tokenizer = ref_ / "flux" / "tokenizer";
  try {
    (void)load_model(transformer, options);
    ADD_FAILURE() << "loaded without --t5_tokenizer";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--t5_tokenizer"), std::string::npos) << e.what();
  }
  options.parts.t5_tokenizer = ref_ / "flux" / "tokenizer_2";
  options.parts.t5_max_length = folder.t5_max_length;
  const std::unique_ptr<DiffusionModel> loaded = load_model(transformer, options);
  EXPECT_EQ(loaded->model_family().name, "flux-dev");
  expect_same_model(folder, *loaded, /*encode=*/true);

  // SD options are refused for it by name, and FLUX.1's for an SD checkpoint.
  const TinyCheckpoint sd = write_tiny_checkpoint(dir_ / "sd2", /*seed=*/1);
  LoadOptions sd_options;
  sd_options.parts.apply_t5_attn_mask = true;
  try {
    (void)load_model(sd.diffusers, sd_options);
    ADD_FAILURE() << "an SD checkpoint took --apply_t5_attn_mask";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--apply_t5_attn_mask is FLUX.1's"), std::string::npos)
        << e.what();
  }
}

// kohya's 8 and 10 GB tiers give --t5xxl a file stored in float8 (t5xxl_fp8_e4m3fn.safetensors:
// every Linear weight float8 e4m3). Under --fp8_base (not --fp8_base_unet) kohya encodes with it
// as it is; here it loads widened into the compute dtype (exact: every float8 value is a bf16
// value) and the placement's float8 cast gives back the file's own bits, so T5 computes with the
// file's weights, not a second rounding of them. Without --fp8_base it computes in bf16 with
// those values, as kohya's load in the weight dtype does.
TEST_F(FluxPipelineParity, Float8T5FileComputesWithItsOwnFloat8Weights) {
  FluxModel folder = load();
  const fs::path dir = dir_ / "t5-float8";
  fs::create_directories(dir);
  std::vector<at::Tensor> storage;
  std::vector<TensorToWrite> t5 = tensors_of(*folder.t5, storage, "");
  std::map<std::string, at::Tensor> stored;  // the float8 weights the file holds, by name
  for (TensorToWrite& t : t5) {
    if (t.shape.size() != 2 || t.name.find("embed") != std::string::npos ||
        t.name.find("shared") != std::string::npos ||
        t.name.find("relative_attention_bias") != std::string::npos) {  // embeddings
      continue;
    }
    const at::Tensor wide = folder.t5->named_parameters()[t.name];
    storage.push_back(wide.to(at::kFloat8_e4m3fn).contiguous());
    stored[t.name] = storage.back();
    t.dtype = Dtype::kF8E4M3;
    t.bytes = std::string_view(static_cast<const char*>(storage.back().data_ptr()),
                               storage.back().nbytes());
  }
  ASSERT_GT(stored.size(), 6u);
  write_safetensors(dir / "t5xxl_fp8_e4m3fn.safetensors", t5,
                    {{"lorapipe.config", read_text(ref_ / "flux" / "text_encoder_2" / "config.json")}});
  for (const bool fp8_base : {true, false}) {
    LoadOptions options;
    options.dtype = at::kBFloat16;
    options.parts.t5xxl = dir / "t5xxl_fp8_e4m3fn.safetensors";
    options.parts.t5_max_length = folder.t5_max_length;
    const std::unique_ptr<DiffusionModel> loaded = load_model(ref_ / "flux", options);
    Placement placement;
    placement.dtype = at::kBFloat16;
    placement.fp8_text_encoders = fp8_base;
    place(*loaded, placement);
    const auto params = dynamic_cast<FluxModel&>(*loaded).t5->named_parameters();
    for (const auto& [name, file] : stored) {
      const at::Tensor& placed = params[name];
      ASSERT_EQ(placed.scalar_type(), fp8_base ? at::kFloat8_e4m3fn : at::kBFloat16) << name;
      EXPECT_TRUE(torch::equal(placed.view(at::kByte), file.to(placed.scalar_type()).view(at::kByte)))
          << name << (fp8_base ? ": not the file's float8 bits" : ": not the file's values");
    }
  }
}

// ComfyUI's all-in-one FLUX.1 file (flux1-dev-fp8.safetensors and the like: every part in one
// file under its prefix) loads as the folder it was written from, each part from its prefix,
// and a part given by its flag still replaces the file's own.
TEST_F(FluxPipelineParity, ComfyAllInOneFileEqualsTheFolder) {
  FluxModel folder = load();
  const fs::path dir = dir_ / "comfy";
  fs::create_directories(dir);
  std::vector<at::Tensor> storage;
  std::vector<TensorToWrite> tensors =
      tensors_of(*folder.transformer, storage, "model.diffusion_model.");
  for (auto part : {tensors_of(*folder.clip, storage, "text_encoders.clip_l.transformer."),
                    tensors_of(*folder.t5, storage, "text_encoders.t5xxl.transformer."),
                    ae_tensors(folder, storage, "vae.")}) {
    tensors.insert(tensors.end(), part.begin(), part.end());
  }
  const fs::path file = dir / "flux1-dev-all-in-one.safetensors";
  auto config = [&](const char* part) { return read_text(ref_ / "flux" / part / "config.json"); };
  write_safetensors(file, tensors,
                    {{"lorapipe.config", config("transformer")},
                     {"lorapipe.config.clip_l", config("text_encoder")},
                     {"lorapipe.config.t5xxl", config("text_encoder_2")},
                     {"lorapipe.config.ae", config("vae")}});
  EXPECT_EQ(detect_family(file).family, "flux-dev");
  const std::string described = inspect_checkpoint(file);
  EXPECT_NE(described.find("parts: CLIP-L, T5 and the AE are in the file"), std::string::npos)
      << described;
  LoadOptions options;
  options.tokenizer = ref_ / "flux" / "tokenizer";
  options.parts.t5_tokenizer = ref_ / "flux" / "tokenizer_2";
  options.parts.t5_max_length = folder.t5_max_length;
  const std::unique_ptr<DiffusionModel> loaded = load_model(file, options);
  expect_same_model(folder, *loaded, /*encode=*/false);

  // --ae still names the part: an SD VAE there is refused by its own path, not the file's.
  const TinyCheckpoint sd = write_tiny_checkpoint(dir / "sd", /*seed=*/5);
  options.parts.ae = sd.diffusers / "vae";
  try {
    (void)load_model(file, options);
    ADD_FAILURE() << "--ae was passed over for the file's own AE";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find((sd.diffusers / "vae").string()), std::string::npos)
        << e.what();
  }
}

// The text cache's key names both tokenizers by their bytes (the same spiece.model elsewhere is
// the same key; another is another), and parts of another model are refused when loaded, naming
// the file: a T5 tokenizer with more ids than the encoder embeds, an SD VAE given as the AE.
TEST_F(FluxPipelineParity, TokenizersKeyTheTextAndPartsOfAnotherModelAreRefused) {
  const fs::path dir = dir_ / "parts";
  fs::create_directories(dir);
  const fs::path spiece = ref_ / "flux" / "tokenizer_2" / "spiece.model";
  auto settings = [&](const fs::path& t5_tokenizer) {
    LoadOptions options;
    options.parts.t5_tokenizer = t5_tokenizer;
    return load_flux_diffusers_folder(ref_ / "flux", options).text_encoder_settings(1);
  };
  const std::string plain = load_flux_diffusers_folder(ref_ / "flux").text_encoder_settings(1);
  fs::copy_file(spiece, dir / "copy.model", fs::copy_options::overwrite_existing);
  EXPECT_EQ(settings(dir / "copy.model"), plain) << "the same bytes under another name";
  // The same pieces and one field SentencePiece does not read (number 100, varint 1): a file
  // that tokenizes alike but is not the same file.
  fs::copy_file(spiece, dir / "other.model", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "other.model", std::ios::app | std::ios::binary) << "\xA0\x06\x01";
  EXPECT_NE(settings(dir / "other.model"), plain);

  // A T5 whose embedding has 64 rows, fewer than the tokenizer's ids.
  const fs::path small = dir / "small";
  fs::copy(ref_ / "flux", small, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  nlohmann::json config = nlohmann::json::parse(read_text(small / "text_encoder_2" / "config.json"));
  config["vocab_size"] = 64;
  std::ofstream(small / "text_encoder_2" / "config.json") << config.dump();
  {
    T5Encoder t5(T5Config::from_json(config.dump(), "config.json"), at::TensorOptions());
    std::vector<at::Tensor> storage;
    write_safetensors(small / "text_encoder_2" / "model.safetensors", module_tensors(*t5, storage));
  }
  try {
    (void)load_flux_diffusers_folder(small);
    ADD_FAILURE() << "a T5 of 64 rows took a larger tokenizer";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("spiece.model"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("embeds 64"), std::string::npos) << e.what();
  }

  // SD's 4-channel VAE as --ae.
  const TinyCheckpoint sd = write_tiny_checkpoint(dir / "sd", /*seed=*/3);
  LoadOptions options;
  options.parts.ae = sd.diffusers / "vae";
  try {
    (void)load_flux_diffusers_folder(ref_ / "flux", options);
    ADD_FAILURE() << "a 4-channel VAE was taken as FLUX.1's AE";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find((sd.diffusers / "vae").string() + ": an AE with 4 latent"),
              std::string::npos)
        << e.what();
  }
}

// --fp8_base through the one placement call, for FLUX.1 as for every family: the transformer's
// and both text encoders' Linear weights (T5's wo too) in float8, plain or scaled
// (--fp8_scaled), computing in bf16. The conditioning and the velocity are, bit for bit, those of
// the same model placed in bf16 holding the dequantised weights.
TEST_F(FluxPipelineParity, Float8BaseThroughThePlacementComputesTheDequantisedModel) {
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  auto layers = [](torch::nn::Module& module) {
    std::vector<std::shared_ptr<LinearImpl>> out;
    for (const auto& m : module.modules()) {
      if (auto l = std::dynamic_pointer_cast<LinearImpl>(m)) out.push_back(l);
    }
    return out;
  };
  for (const bool scaled : {false, true}) {
    FluxModel model = load();
    Placement placement;
    placement.dtype = at::kBFloat16;
    placement.fp8_denoiser = placement.fp8_text_encoders = true;
    placement.fp8_scaled = scaled;
    const PlacementReport report = place(model, placement);
    EXPECT_EQ(report.float8_saturated, 0);
    auto* block = (*model.t5->blocks)[0]->as<T5BlockImpl>();
    ASSERT_TRUE(is_float8(block->wo->weight));
    EXPECT_EQ(block->wo->weight_scale.defined(), scaled);
    FluxModel dequantised = load();
    int64_t converted = 0;
    for (const auto& [a, b] : std::vector<std::pair<torch::nn::Module*, torch::nn::Module*>>{
             {model.transformer.get(), dequantised.transformer.get()},
             {model.clip.get(), dequantised.clip.get()},
             {model.t5.get(), dequantised.t5.get()}}) {
      const auto from = layers(*a), to = layers(*b);
      ASSERT_EQ(from.size(), to.size());
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < from.size(); ++i) {
        ASSERT_TRUE(is_float8(from[i]->weight));
        to[i]->weight.set_data(
            dequantize_float8(from[i]->weight, from[i]->weight_scale, at::kFloat));
        ++converted;
      }
    }
    EXPECT_EQ(report.float8_tensors, converted);
    Placement bf16;
    bf16.dtype = at::kBFloat16;
    place(dequantised, bf16);
    torch::NoGradGuard no_grad;
    const Conditioning c = model.encode_prompts(prompts(), 1);
    const Conditioning d = dequantised.encode_prompts(prompts(), 1);
    EXPECT_TRUE(torch::equal(c.hidden_states, d.hidden_states)) << scaled;
    EXPECT_TRUE(torch::equal(c.pooled, d.pooled)) << scaled;
    DenoiseInput input;
    input.latents = ref.at("latents");
    input.time = ref.at("sigma");
    input.conditioning = &c;
    input.guidance = 3.5;
    const at::Tensor velocity = model.denoise(input);
    EXPECT_TRUE(torch::isfinite(velocity).all().item<bool>());
    EXPECT_TRUE(torch::equal(velocity, dequantised.denoise(input))) << scaled;
  }
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
  // kohya's Flux LoRA on it: 1 double block x 10, 2 single blocks x 3; then the input layers
  // network_args in_dims can adapt (img_in, time_in x 2, vector_in x 2, guidance_in x 2, txt_in).
  const std::vector<LoraTarget> targets = model.lora_targets(/*text_encoder=*/false, false);
  ASSERT_EQ(targets.size(), 24u);
  for (size_t i = 0; i < targets.size(); ++i) EXPECT_EQ(targets[i].in_dims >= 0, i >= 16) << i;
  EXPECT_EQ(targets[16].name, "lora_unet_img_in");
  EXPECT_EQ(targets[23].name, "lora_unet_txt_in");
  EXPECT_GT(model.lora_targets(/*text_encoder=*/true, false).size(), 24u);
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
  r.guidance = 3.5;  // --g; --l is not given: no classifier-free pass
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
  // A prompt without --s renders the family's default step count (here made the reference's):
  // the same render, so every step reads the resolved count and not the request's 0.
  r.steps = 0;
  model.family.default_sample_steps = request["render_steps"];
  expect_close("flux render, the family's default steps", sampler::render(model, r, options).latents,
               ref.at("render_latents"), 1e-4);
}

// --l 2 with a negative prompt: true classifier-free guidance, as FluxPipeline's true_cfg_scale
// (the negative and positive passes, uncond + 2 * (cond - uncond)), from the same initial
// latents; the final latents within 1e-4 of their scale. Without --l the negative prompt is not
// used (kohya's default scale for Flux is 1); --l without a negative prompt guides against the
// empty prompt, as kohya's Flux sampling does (FluxPipeline with negative_prompt="").
TEST_F(FluxPipelineParity, TrueCfgWithANegativePromptMatchesFluxPipeline) {
  FluxModel model = load();
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  std::ifstream in(ref_ / "request.json");
  const nlohmann::json request = nlohmann::json::parse(in);
  sampler::RenderRequest r;
  r.prompt = prompts()[0];
  r.negative_prompt = request["negative"];
  r.width = r.height = 16;
  r.steps = request["render_steps"];
  sampler::RenderOptions options;
  options.initial_latents = ref.at("render_initial");
  EXPECT_FALSE(sampler::classifier_free(model.model_family(), r));
  expect_close("flux render, negative prompt without --l", sampler::render(model, r, options).latents,
               ref.at("render_latents"), 1e-4);
  r.cfg_scale = 2.0;
  r.cfg_scale_given = true;
  EXPECT_TRUE(sampler::classifier_free(model.model_family(), r));
  expect_close("flux render, true CFG 2", sampler::render(model, r, options).latents,
               ref.at("render_cfg_latents"), 1e-4);
  r.negative_prompt.clear();
  EXPECT_TRUE(sampler::classifier_free(model.model_family(), r));
  expect_close("flux render, true CFG 2 against the empty prompt",
               sampler::render(model, r, options).latents, ref.at("render_cfg_empty_latents"),
               1e-4);
}

// Flux previews round their size down to what 2x2 packing takes (16 px for an 8x AE; 4 px for
// the tiny 2x AE), as FluxPipeline does; a size under that is refused by name.
TEST_F(FluxPipelineParity, RenderSizesRoundDownToWhatPackingTakes) {
  FluxModel model = load();
  sampler::RenderRequest r;
  r.prompt = prompts()[0];
  r.width = 24;   // 12 latents at 2x: packs as 12
  r.height = 16;  // 8 latents
  r.steps = 1;
  model.family.vae_downsample = 2;  // the tiny AE's factor (FLUX.1's is 8)
  const sampler::RenderResult sized = sampler::render(model, r, {});
  EXPECT_EQ(sized.latents.size(2), 8);
  EXPECT_EQ(sized.latents.size(3), 12);
  r.width = 24 + 2;  // not a multiple of 8: the render's own check refuses it first
  EXPECT_THROW(sampler::render(model, r, {}), InputError);
  model.family.vae_downsample = 8;  // as FLUX.1's: 16 px per packed token
  r.width = 40;                     // 5 latents: rounded down to 4
  r.height = 16;
  const at::Tensor rounded = sampler::render(model, r, {}).latents;
  EXPECT_EQ(rounded.size(3), 4);
  EXPECT_EQ(rounded.size(2), 2);
  r.height = 8;  // 1 latent: nothing to pack
  try {
    (void)sampler::render(model, r, {});
    ADD_FAILURE() << "an 8 px tall Flux preview was rendered";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("under 16 px"), std::string::npos) << e.what();
  }
}

// The sampler's placement under --blocks_to_swap: a swapped block's weights are empty tensors
// while the block is off the device, so a checkpoint's LoRA fits its layers by their shapes, not
// their weights', and goes into the slots of swapped layers as of any other; the text encoders
// stay in host memory. The tiny reference has too few blocks to swap (two of each list stay), so
// its transformer is replaced by a random one of 3 double and 6 single blocks. A render with a
// LoRA on every layer kohya adapts (the transformer's and CLIP-L's) gives the unswapped render's
// latents bit for bit on the CPU (the GPU's machinery but for its copy stream). Merging into a
// swapped weight is refused by name.
TEST_F(FluxPipelineParity, BlockSwapRendersALoraBitIdentically) {
  const fs::path file = dir_ / "swap-lora.safetensors";
  auto deeper = [] {
    FluxModel model = load();
    FluxConfig config = model.transformer->config;
    config.depth = 3;
    config.depth_single_blocks = 6;
    torch::manual_seed(11);
    FluxTransformer transformer(config, at::TensorOptions().dtype(at::kFloat));
    torch::NoGradGuard no_grad;
    for (auto& p : transformer->parameters()) p.normal_(0, 0.1);
    model.transformer = transformer;
    return model;
  };
  {
    FluxModel model = deeper();
    auto gen = at::detail::createCPUGenerator(5);
    std::vector<at::Tensor> keep;
    std::vector<TensorToWrite> out;
    auto add = [&](const std::string& name, const at::Tensor& t) {
      keep.push_back(t.contiguous());
      out.push_back({name, Dtype::kF32, keep.back().sizes().vec(),
                     std::string_view(static_cast<const char*>(keep.back().data_ptr()),
                                      keep.back().nbytes())});
    };
    for (const LoraTarget& t : model.lora_targets(/*text_encoder=*/true, false)) {
      if (t.in_dims >= 0) continue;  // kohya adapts the input layers only with in_dims
      add(t.name + ".lora_down.weight", torch::randn({2, t.in_features()}, gen) * 0.2);
      add(t.name + ".lora_up.weight", torch::randn({t.out_features(), 2}, gen) * 0.2);
      add(t.name + ".alpha", torch::tensor(2.0f));
    }
    write_safetensors(file, out, {});
  }
  sampler::RenderRequest r;
  r.prompt = prompts()[0];
  r.width = r.height = 16;
  r.steps = 2;
  r.guidance = 3.5;
  const auto ref = testing::read_all(ref_ / "reference.safetensors");
  sampler::RenderOptions options;
  options.initial_latents = ref.at("render_initial");
  auto render = [&](int swap, bool lora) {
    FluxModel model = deeper();
    Placement placement;
    placement.blocks_to_swap = swap;
    placement.text_encoders_on_device = swap == 0;
    const PlacementReport report = place(model, placement);
    EXPECT_EQ(report.swap_host_bytes > 0, swap > 0);
    std::optional<MergedLora> merged;
    if (lora) {
      merged.emplace(model, file, 1.0);
      EXPECT_TRUE(merged->changes_text_encoder());
    }
    if (swap > 0) {
      try {
        MergedLora into(model, file, 1.0, MergedLora::Application::kMergedRestorable);
        ADD_FAILURE() << "a LoRA merged into weights the swap keeps in host memory";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("--blocks_to_swap"), std::string::npos) << e.what();
      }
    }
    return sampler::render(model, r, options).latents;
  };
  const at::Tensor base = render(0, false), plain = render(0, true);
  ASSERT_FALSE(torch::equal(base, plain)) << "the LoRA changed nothing";
  for (const int swap : {1, 2}) {
    EXPECT_TRUE(torch::equal(render(swap, true), plain)) << "--blocks_to_swap=" << swap;
  }
}

// FLUX.1's AE gives NaN in fp16 as SDXL's VAE does, and there is no fixed fp16 AE: a stage asked
// for fp16 loads the transformer in fp16 and the AE in fp32; bf16 and --no_half_vae as for SDXL.
TEST_F(FluxPipelineParity, AeRunsInFp32WhereFp16IsAsked) {
  for (const bool dev : {true, false}) {
    const ModelFamily& flux = flux_model_family(dev);
    EXPECT_EQ(vae_compute_dtype(flux, torch::kHalf, /*vae_given=*/false, false), torch::kFloat);
    EXPECT_EQ(vae_compute_dtype(flux, torch::kBFloat16, false, false), torch::kBFloat16);
    EXPECT_EQ(vae_compute_dtype(flux, torch::kBFloat16, false, /*no_half_vae=*/true),
              torch::kFloat);
  }
  LoadOptions options;
  options.dtype = torch::kHalf;
  options.vae_dtype = vae_compute_dtype(flux_model_family(true), torch::kHalf, false, false);
  FluxModel model = load_flux_diffusers_folder(ref_ / "flux", options);
  for (const auto& p : model.vae_module().parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  for (const auto& p : model.denoiser_module().parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kHalf);
  }
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
