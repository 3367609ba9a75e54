#include "models/family.h"

#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/safetensors.h"
#include "models/sd15_keys.h"

namespace lorapipe::models {
namespace fs = std::filesystem;

namespace {

ModelFamily make_sd15() {
  ModelFamily f;
  f.name = "sd15";
  f.display_name = "Stable Diffusion 1.5";
  f.latent_channels = 4;
  f.vae_scaling_factor = 0.18215;
  f.vae_shift_factor = 0;
  f.vae_downsample = 8;
  f.prediction_type = "epsilon";
  f.default_resolution = 512;
  f.text = {"clip-l", 77, 768, /*uses_pooled=*/false, /*default_clip_skip=*/1};
  // diffusers' SD1.5 scheduler_config.json; kohya's DDPMScheduler for SD1.x the same.
  f.schedule = {/*beta_start=*/0.00085, /*beta_end=*/0.012, /*steps=*/1000};
  f.kohya = KohyaFamilyNames{};  // networks.lora, sd_v1, not v2, stable-diffusion-v1, 25 blocks
  f.single_file_components = {{"unet", std::string(kLdmUnetPrefix)},
                              {"vae", std::string(kLdmVaePrefix)},
                              {"text_encoder", std::string(kLdmTextPrefix)}};
  return f;
}

ModelFamily make_sdxl() {
  ModelFamily f;
  f.name = "sdxl";
  f.display_name = "Stable Diffusion XL";
  f.latent_channels = 4;
  f.vae_scaling_factor = 0.13025;  // SDXL's VAE (diffusers' vae/config.json scaling_factor)
  f.vae_overflows_in_fp16 = true;  // madebyollin's sdxl-vae-fp16-fix exists for this reason
  f.vae_shift_factor = 0;
  f.vae_downsample = 8;
  f.prediction_type = "epsilon";  // v-prediction models (NoobAI-XL v-pred): --v_parameterization
  f.default_resolution = 1024;
  f.default_max_bucket_reso = 2048;
  f.bucket_reso_multiple = 32;  // kohya's sdxl_train_util: bucket_reso_steps % 32 == 0
  // CLIP-L's 768 and OpenCLIP ViT-bigG's 1280 penultimate states side by side; the pooled
  // output is bigG's projected end-of-text state. kohya's SDXL ignores --clip_skip.
  f.text = {"clip-l+clip-g", 77, 2048, /*uses_pooled=*/true, /*default_clip_skip=*/1};
  f.schedule = {/*beta_start=*/0.00085, /*beta_end=*/0.012, /*steps=*/1000};
  f.kohya.network_module = "networks.lora";
  f.kohya.base_model_version = "sdxl_base_v1-0";
  f.kohya.v2 = false;
  f.kohya.modelspec_architecture = "stable-diffusion-xl-v1-base";
  // kohya's sai_model_spec names Stability AI's implementation for SDXL LoRAs.
  f.kohya.modelspec_implementation = "https://github.com/Stability-AI/generative-models";
  f.kohya.blocks = KohyaBlocks{/*side=*/9, /*mid=*/3, /*head=*/1, /*tail=*/1};
  f.single_file_components = {{"unet", std::string(kLdmUnetPrefix)},
                              {"vae", std::string(kLdmVaePrefix)},
                              {"text_encoder", std::string(kSdxlClipLPrefix)},
                              {"text_encoder_2", "conditioner.embedders.1.model."}};
  return f;
}

// FLUX.1 [dev] and [schnell]: one transformer layout, told apart by dev's guidance embedding.
ModelFamily make_flux(bool dev) {
  ModelFamily f;
  f.name = dev ? "flux-dev" : "flux-schnell";
  f.display_name = dev ? "FLUX.1 [dev]" : "FLUX.1 [schnell]";
  f.latent_channels = 16;
  f.vae_scaling_factor = 0.3611;  // the AE's (diffusers' vae/config.json)
  f.vae_shift_factor = 0.1159;
  // Its AE gives NaN in fp16 as SDXL's VAE does (InvokeAI forces bf16 or fp32 for it, #7213),
  // and no fixed fp16 AE exists: fp16 runs encode in fp32.
  f.vae_overflows_in_fp16 = true;
  f.vae_downsample = 8;
  f.prediction_type = "flow";
  f.default_resolution = 1024;
  f.default_max_bucket_reso = 2048;  // as SDXL's: 1024 px of area in buckets of any aspect
  f.bucket_reso_multiple = 32;  // kohya's flux_train_network: bucket_reso_steps % 32 == 0
  f.previews_beside_training = false;  // its T5 XXL is a second large model
  f.default_sample_steps = dev ? 20 : 4;
  // T5's states (kohya's --t5xxl_max_token_length default: 512 for dev, 256 for schnell) and
  // CLIP-L's pooled output. kohya's Flux ignores --clip_skip.
  f.text = {"t5+clip-l", dev ? 512 : 256, 4096, /*uses_pooled=*/true, /*default_clip_skip=*/1};
  f.text.untrained_encoders = "T5-XXL";  // networks.lora_flux: CLIP-L's LoRA, never T5's
  f.text.weighted_captions = false;
  f.text.long_prompts = false;
  f.cpu_offload_checkpointing = true;
  f.objective = ObjectiveKind::kFlowMatching;
  // FLUX.1's scheduler_config.json: dev shifts by resolution, schnell not at all.
  f.flow.dynamic_shifting = dev;
  f.flow.shift = dev ? 3.0 : 1.0;
  f.kohya.network_module = "networks.lora_flux";
  // No block table: networks.lora_flux reads no block-wise network_args (the trainer refuses
  // them by name rather than weigh every module by the U-Net's last block).
  f.kohya.blocks = KohyaBlocks{/*side=*/0, /*mid=*/0, /*head=*/0, /*tail=*/0};
  f.kohya.base_model_version = "flux1";
  f.kohya.modelspec_architecture = dev ? "flux-1-dev" : "flux-1-schnell";
  f.kohya.modelspec_implementation = "https://github.com/black-forest-labs/flux";
  f.kohya.train_blocks = {{"double", "lora_unet_double_blocks_"},
                          {"single", "lora_unet_single_blocks_"}};
  f.kohya.in_dims = {"img_in", "time_in", "vector_in", "guidance_in", "txt_in"};
  // Only the transformer lives in a FLUX.1 single file; kohya takes the others by flag.
  f.single_file_components = {{"transformer", ""}};
  return f;
}

const std::vector<ModelFamily>& families() {
  static const std::vector<ModelFamily> all{make_sd15(), make_sdxl(), make_flux(true),
                                            make_flux(false)};
  return all;
}

std::string known_families() {
  std::string known;
  for (const ModelFamily& f : families()) known += (known.empty() ? "" : ", ") + f.name;
  return known;
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// The part of a key that names its component: the first two dotted parts for the wrapped
// layouts (model.diffusion_model., cond_stage_model.transformer.), else the first.
std::string top_prefix(const std::string& key) {
  const size_t first = key.find('.');
  if (first == std::string::npos) return key;
  const std::string head = key.substr(0, first);
  if (head == "model" || head == "cond_stage_model" || head == "conditioner") {
    const size_t second = key.find('.', first + 1);
    if (second != std::string::npos) return key.substr(0, second + 1);
  }
  return key.substr(0, first + 1);
}

// What a file that fits no family holds, for the error: its first top-level prefixes by count.
std::string found_in(const SafetensorsFile& file) {
  std::map<std::string, int> prefixes;
  for (const TensorInfo& t : file.tensors()) ++prefixes[top_prefix(t.name)];
  std::string found;
  int shown = 0;
  for (const auto& [prefix, count] : prefixes) {
    if (shown++ == 8) {
      found += ", ...";
      break;
    }
    found += (found.empty() ? "" : ", ") + prefix + (prefix.back() == '.' ? "* (" : " (") +
             std::to_string(count) + ")";
  }
  return found.empty() ? "no tensors" : std::to_string(file.tensors().size()) +
                                            " tensors under " + found;
}

// A family lorapipe recognises but does not train yet, from a single file's keys; empty if none.
std::string not_yet_supported(const SafetensorsFile& file) {
  bool ldm_unet = false, openclip_text = false, sdxl_refiner = false;
  for (const TensorInfo& t : file.tensors()) {
    ldm_unet |= starts_with(t.name, kLdmUnetPrefix);
    openclip_text |= starts_with(t.name, "cond_stage_model.model.");
    sdxl_refiner |= starts_with(t.name, "conditioner.embedders.0.model.");
  }
  if (sdxl_refiner) return "the SDXL refiner (OpenCLIP alone, conditioner.embedders.0.model.*)";
  if (ldm_unet && openclip_text) return "SD2.x (an OpenCLIP text encoder, cond_stage_model.model.*)";
  return "";
}

FamilyDetection detect_file(const fs::path& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  const auto& meta = file.metadata();
  if (const auto it = meta.find("lorapipe.family"); it != meta.end()) {
    (void)model_family(it->second);  // a family this build does not know is refused by name
    return {it->second, "its lorapipe.family metadata"};
  }
  bool ldm_unet = false, clip_text = false, vae = false, sdxl_clip_l = false, sdxl_clip_g = false;
  bool flux_img_in = false, flux_double = false, flux_guidance = false;
  for (const TensorInfo& t : file.tensors()) {
    // A FLUX.1 transformer as Black Forest Labs ship it, or with ComfyUI's and kohya's
    // model.diffusion_model. prefix.
    const std::string_view bare = starts_with(t.name, kLdmUnetPrefix)
                                      ? std::string_view(t.name).substr(kLdmUnetPrefix.size())
                                      : std::string_view(t.name);
    flux_img_in |= bare == "img_in.weight";
    flux_double |= starts_with(bare, "double_blocks.");
    flux_guidance |= starts_with(bare, "guidance_in.");
    ldm_unet |= starts_with(t.name, kLdmUnetPrefix);
    clip_text |= starts_with(t.name, std::string(kLdmTextPrefix) + "text_model.");
    vae |= starts_with(t.name, kLdmVaePrefix);
    sdxl_clip_l |= starts_with(t.name, std::string(kSdxlClipLPrefix) + "text_model.");
    sdxl_clip_g |= starts_with(t.name, "conditioner.embedders.1.model.");
  }
  if (ldm_unet && clip_text && vae) {
    return {"sd15", "its keys (model.diffusion_model.*, first_stage_model.*, and a CLIP-L text "
                    "encoder under cond_stage_model.transformer.*)"};
  }
  if (ldm_unet && vae && sdxl_clip_l && sdxl_clip_g) {
    return {"sdxl", "its keys (model.diffusion_model.*, first_stage_model.*, CLIP-L under "
                    "conditioner.embedders.0.transformer.* and OpenCLIP ViT-bigG under "
                    "conditioner.embedders.1.model.*)"};
  }
  if (flux_img_in && flux_double) {
    return flux_guidance
               ? FamilyDetection{"flux-dev", "its keys (a FLUX.1 transformer: img_in, "
                                             "double_blocks.*, and dev's guidance_in)"}
               : FamilyDetection{"flux-schnell", "its keys (a FLUX.1 transformer: img_in and "
                                                 "double_blocks.*, without dev's guidance_in)"};
  }
  const std::string other = not_yet_supported(file);
  throw InputError(path.string() + ": " +
                   (other.empty() ? "no known model family fits its keys"
                                  : "its keys are those of " + other +
                                        ", a family lorapipe does not train yet") +
                   "; found " + found_in(file) + " (known families: " + known_families() +
                   "; --model_family names one)");
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot read " + path.string());
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path.string() + ": not JSON: " + e.what());
  }
  if (!json.is_object()) {
    throw InputError(path.string() + ": not a JSON object, as diffusers writes");
  }
  return json;
}

FamilyDetection detect_folder(const fs::path& folder) {
  std::string found;
  if (fs::exists(folder / "model_index.json")) {
    const nlohmann::json index = read_json(folder / "model_index.json");
    const std::string pipeline = index.value("_class_name", std::string());
    if (pipeline == "StableDiffusionPipeline" || pipeline == "StableDiffusionImg2ImgPipeline") {
      return {"sd15", "its model_index.json (" + pipeline + ")"};
    }
    if ((pipeline == "StableDiffusionXLPipeline" || pipeline == "StableDiffusionXLImg2ImgPipeline") &&
        index.contains("text_encoder") && !index["text_encoder"].is_null()) {
      return {"sdxl", "its model_index.json (" + pipeline + ")"};
    }
    if ((pipeline == "FluxPipeline" || pipeline == "FluxImg2ImgPipeline") &&
        fs::exists(folder / "transformer" / "config.json")) {
      const nlohmann::json transformer = read_json(folder / "transformer" / "config.json");
      const bool dev = transformer.value("guidance_embeds", false);
      return {dev ? "flux-dev" : "flux-schnell",
              "its model_index.json (" + pipeline + ") and transformer/config.json (" +
                  (dev ? "guidance_embeds" : "no guidance_embeds") + ")"};
    }
    found = "model_index.json names " + (pipeline.empty() ? "no pipeline" : pipeline);
    if (pipeline.find("XL") != std::string::npos) {
      found += ", a family lorapipe does not train yet (the SDXL refiner has no CLIP-L)";
    }
  } else if (fs::exists(folder / "unet" / "config.json") && fs::is_directory(folder / "text_encoder")) {
    const nlohmann::json unet = read_json(folder / "unet" / "config.json");
    const bool added = unet.contains("addition_embed_type") && !unet["addition_embed_type"].is_null();
    if (unet.value("_class_name", std::string()) == "UNet2DConditionModel" && !added &&
        !fs::is_directory(folder / "text_encoder_2")) {
      return {"sd15", "its unet/config.json (a UNet2DConditionModel without added conditions) "
                      "and one text encoder"};
    }
    const bool text_time = added && unet["addition_embed_type"] == "text_time";
    if (unet.value("_class_name", std::string()) == "UNet2DConditionModel" && text_time &&
        fs::is_directory(folder / "text_encoder_2")) {
      return {"sdxl", "its unet/config.json (a UNet2DConditionModel with text_time added "
                      "conditions) and two text encoders"};
    }
    found = "unet/config.json names a UNet with other added conditions or text encoders";
  } else {
    std::string parts;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(folder, ec)) {
      parts += (parts.empty() ? "" : ", ") + entry.path().filename().string() +
               (entry.is_directory() ? "/" : "");
    }
    found = "no model_index.json and no unet/config.json; it holds " +
            (parts.empty() ? std::string("nothing") : parts);
  }
  throw InputError(folder.string() + ": not a diffusers folder of a known family: " + found +
                   " (known families: " + known_families() + "; --model_family names one)");
}

}  // namespace

std::string KohyaBlocks::describe() const {
  auto two = [](int i) { return (i < 10 ? "0" : "") + std::to_string(i); };
  return std::string(head > 0 ? "BASE, " : "") + "IN00-IN" + two(side - 1) +
         (mid == 1 ? ", MID" : ", MID00-MID" + two(mid - 1)) + ", OUT00-OUT" + two(side - 1) +
         (tail > 0 ? ", OUT" : "");
}

const ModelFamily& model_family(std::string_view name) {
  for (const ModelFamily& f : families()) {
    if (f.name == name) return f;
  }
  throw InputError("unknown model family '" + std::string(name) + "' (known: " +
                   known_families() + ")");
}

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const ModelFamily& f : families()) names.push_back(f.name);
  return names;
}

FamilyDetection detect_family(const fs::path& path, std::string_view override) {
  if (!override.empty()) {
    const ModelFamily& family = model_family(override);  // throws for an unknown name
    return {family.name, "--model_family"};
  }
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    try {
      return detect_folder(path);
    } catch (const nlohmann::json::exception& e) {  // a key of a config there of another type
      throw InputError(path.string() + ": a config of this folder is not as diffusers writes it (" +
                       e.what() + ")");
    }
  }
  if (!fs::exists(path, ec)) throw InputError(path.string() + ": no such file or folder");
  return detect_file(path);
}

bool is_objective_marker_key(std::string_view key) {
  return key == "v_pred" || key == "ztsnr" || key == "edm_mean" || key == "edm_std" ||
         key.rfind("edm_vpred.", 0) == 0;
}

void read_declared_objective(const fs::path& path, ModelFamily& family) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path file = path / "scheduler" / "scheduler_config.json";
    if (!fs::exists(file, ec)) return;
    std::ifstream in(file, std::ios::binary);
    const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      throw InputError(file.string() + ": not a JSON object");
    }
    const auto type = config.find("prediction_type");
    if (type == config.end() || *type != "v_prediction") return;
    const auto zero_snr = config.find("rescale_betas_zero_snr");
    family.prediction_type = "v_prediction";
    family.declares_zero_terminal_snr = zero_snr != config.end() && *zero_snr == true;
    family.declared_by = "its scheduler config: prediction_type v_prediction" +
                         std::string(family.declares_zero_terminal_snr
                                         ? ", rescale_betas_zero_snr true"
                                         : "");
    return;
  }
  bool v_pred = false, ztsnr = false;
  const SafetensorsFile file = SafetensorsFile::open(path);
  for (const TensorInfo& t : file.tensors()) {
    if (t.name.rfind("edm_", 0) == 0 && is_objective_marker_key(t.name)) {
      throw InputError(path.string() + ": its key " + t.name + " marks an EDM model " +
                       "(Playground v2.5, or an EDM v-prediction SDXL), whose noise schedule " +
                       "lorapipe does not train or render yet");
    }
    v_pred = v_pred || t.name == "v_pred";
    ztsnr = ztsnr || t.name == "ztsnr";
  }
  if (!v_pred) return;  // ComfyUI reads ztsnr only beside v_pred, and so does lorapipe
  family.prediction_type = "v_prediction";
  family.declared_by = ztsnr ? "its keys v_pred and ztsnr" : "its key v_pred";
  family.declares_zero_terminal_snr = ztsnr;
}

void check_declared_objective(const fs::path& path, bool v_parameterization,
                              std::optional<bool> zero_terminal_snr) {
  ModelFamily declared;
  read_declared_objective(path, declared);
  check_declared_objective(declared, path.string(), v_parameterization, zero_terminal_snr);
}

void check_declared_objective(const ModelFamily& family, const std::string& source,
                              bool v_parameterization, std::optional<bool> zero_terminal_snr) {
  if (family.declared_by.empty()) return;
  if (family.prediction_type == "v_prediction" && !v_parameterization) {
    const bool zsnr_too =
        family.declares_zero_terminal_snr && zero_terminal_snr && !*zero_terminal_snr;
    throw InputError(source + " declares itself a v-prediction model (" + family.declared_by +
                     "): pass --v_parameterization" + (zsnr_too ? " and --zero_terminal_snr" : "") +
                     ", as kohya needs for such a model");
  }
  if (family.declares_zero_terminal_snr && zero_terminal_snr && !*zero_terminal_snr) {
    throw InputError(source + " declares a zero-terminal-SNR schedule (" + family.declared_by +
                     "): pass --zero_terminal_snr, as kohya needs for such a model");
  }
}

}  // namespace lorapipe::models
