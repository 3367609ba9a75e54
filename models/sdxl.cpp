#include "models/sdxl.h"

#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"
#include "models/fingerprint.h"
#include "models/loading.h"
#include "models/open_clip_keys.h"
#include "models/prompt_attention.h"
#include "models/safetensors.h"
#include "models/sd15_keys.h"
#include "models/sd15_lora.h"
#include "models/sdxl_lora.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kLog = "models";
constexpr const char* kUnetConfigKey = "lorapipe.unet_config";
constexpr const char* kVaeConfigKey = "lorapipe.vae_config";
constexpr const char* kTextConfigKey = "lorapipe.text_encoder_config";
constexpr const char* kText2ConfigKey = "lorapipe.text_encoder_2_config";

// SDXL's VAE: SD's architecture, its own latent scale.
VaeConfig sdxl_vae_config() {
  VaeConfig c = VaeConfig::sd15();
  c.scaling_factor = 0.13025;
  return c;
}

// The container text_encoder_module() returns: both encoders under their diffusers names.
std::shared_ptr<torch::nn::Module> hold_text_encoders(const ClipTextModel& one,
                                                      const ClipTextModel& two) {
  auto holder = std::make_shared<torch::nn::Module>("SdxlTextEncoders");
  if (one) holder->register_module("text_encoder", one.ptr());
  if (two) holder->register_module("text_encoder_2", two.ptr());
  return holder;
}

void build(StableDiffusionXL& xl, const UNetConfig& unet, const VaeConfig& vae,
           const ClipTextConfig& text, const ClipTextConfig& text_2, const LoadOptions& options) {
  const c10::ScalarType dtype = storage_dtype(options.dtype, "dtype");
  const c10::ScalarType text_dtype =
      storage_dtype(options.text_encoder_dtype.value_or(dtype), "text_encoder_dtype");
  if (unet.addition_embed_type != "text_time") {
    throw InputError(xl.source_path + ": an SDXL U-Net has addition_embed_type text_time, not '" +
                     unet.addition_embed_type + "'");
  }
  if (!text_2.with_projection) {
    throw InputError(xl.source_path + ": SDXL's second text encoder is a "
                     "CLIPTextModelWithProjection (its pooled output is projected)");
  }
  if (options.load_denoiser) xl.unet = build_in(dtype, [&] { return UNet(unet); });
  xl.vae = build_in(storage_dtype(options.vae_dtype.value_or(dtype), "vae_dtype"),
                    [&] { return AutoencoderKL(vae); });
  xl.text_encoder = build_in(text_dtype, [&] { return ClipTextModel(text); });
  xl.text_encoder_2 = build_in(text_dtype, [&] { return ClipTextModel(text_2); });
  xl.text_encoders = hold_text_encoders(xl.text_encoder, xl.text_encoder_2);
}

// Both tokenizers from `path` (or CLIP's built-in vocabulary), the second padding with
// `pad_token_2`; `folder_2` (a diffusers folder's tokenizer_2/) may name another pad token.
void attach_tokenizer(StableDiffusionXL& xl, const fs::path& path, const fs::path& folder_2 = {}) {
  xl.tokenizer = clip_tokenizer_for(path, xl.text_encoder->config().vocab_size, xl.source_path,
                                    &xl.builtin_tokenizer);
  xl.tokenizer_path = path;
  if (!xl.tokenizer) return;
  bool builtin = false;
  xl.tokenizer_2 = clip_tokenizer_for(path, xl.text_encoder->config().vocab_size, xl.source_path,
                                      &builtin);
  const fs::path special = folder_2 / "special_tokens_map.json";
  if (!folder_2.empty() && fs::exists(special)) {
    // The pad token changes every caption's states: a file that says nothing readable about it
    // is refused, not passed over for the default.
    const json tokens = json::parse(read_text(special), nullptr, /*allow_exceptions=*/false);
    if (tokens.is_discarded() || !tokens.is_object()) {
      throw InputError(special.string() + ": not a JSON object");
    }
    if (tokens.contains("pad_token")) {
      const json& pad = tokens["pad_token"];
      const json* content = pad.is_object() && pad.contains("content") ? &pad["content"] : &pad;
      if (!content->is_string()) {
        throw InputError(special.string() + ": pad_token is " + pad.dump() +
                         ", not a token (a string, or an object with a string \"content\")");
      }
      xl.pad_token_2 = content->get<std::string>();
    }
  }
  xl.tokenizer_2->set_pad_token(xl.pad_token_2);
}

std::string list_some(const std::vector<std::string>& keys) {
  std::string list;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) list += (i ? ", " : "") + keys[i];
  return list;
}

StableDiffusionXL load_single_file(const fs::path& path, const LoadOptions& options) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  StableDiffusionXL xl;
  xl.family = model_family("sdxl");
  xl.source_path = path.string();
  read_declared_objective(path, xl.family);
  const auto& meta = file.metadata();
  auto config = [&](const char* key) -> const std::string* {
    const auto it = meta.find(key);
    return it == meta.end() ? nullptr : &it->second;
  };
  const UNetConfig unet_config = config(kUnetConfigKey)
                                     ? UNetConfig::from_json(*config(kUnetConfigKey), xl.source_path)
                                     : UNetConfig::sdxl();
  const VaeConfig vae_config = config(kVaeConfigKey)
                                   ? VaeConfig::from_json(*config(kVaeConfigKey), xl.source_path)
                                   : sdxl_vae_config();
  const ClipTextConfig text_config =
      config(kTextConfigKey) ? ClipTextConfig::from_json(*config(kTextConfigKey), xl.source_path)
                             : ClipTextConfig::sd15();
  const ClipTextConfig text_2_config =
      config(kText2ConfigKey) ? ClipTextConfig::from_json(*config(kText2ConfigKey), xl.source_path)
                              : ClipTextConfig::sdxl_clip_g();
  build(xl, unet_config, vae_config, text_config, text_2_config, options);

  const KeyMap unet_map = sd15_unet_key_map(layout_of(unet_config));
  const KeyMap vae_map = sd15_vae_key_map(layout_of(vae_config));
  const KeyMap text_map = sd15_text_key_map(kSdxlClipLPrefix);
  std::map<std::string, const TensorInfo*> unet, vae, text;
  std::vector<std::string> unknown;
  int skipped = 0;
  for (const TensorInfo& info : file.tensors()) {
    const std::string& key = info.name;
    if (key.rfind(kSdxlOpenClipPrefix, 0) == 0) continue;  // converted as a whole below
    if (is_objective_marker_key(key)) continue;  // read by read_declared_objective
    if (is_known_optional_ldm_key(key)) {
      ++skipped;
      continue;
    }
    std::optional<std::string> name;
    std::map<std::string, const TensorInfo*>* target = nullptr;
    if (key.rfind(kLdmUnetPrefix, 0) == 0) {
      if (!options.load_denoiser) continue;
      name = unet_map.to_diffusers(key), target = &unet;
    } else if (key.rfind(kLdmVaePrefix, 0) == 0) {
      name = vae_map.to_diffusers(key), target = &vae;
    } else if (key.rfind(kSdxlClipLPrefix, 0) == 0) {
      name = text_map.to_diffusers(key), target = &text;
    }
    if (!name) {
      unknown.push_back(key);
      continue;
    }
    (*target)[*name] = &info;
  }
  if (!unknown.empty()) {
    throw InputError(xl.source_path + ": " + std::to_string(unknown.size()) +
                     " keys belong to no known component of an SDXL checkpoint: " +
                     list_some(unknown));
  }
  xl.skipped_keys = skipped;
  if (skipped > 0) {
    LP_LOG(kWarning, kLog) << xl.source_path << ": skipped " << skipped
                           << " entries that carry no weights we use (EMA copies, noise "
                              "schedule, position_ids)";
  }
  if (options.load_denoiser) load_into(*xl.unet, file, unet, xl.source_path + " (unet)");
  load_into(*xl.vae, file, vae, xl.source_path + " (vae)", vae_attention_from_ldm());
  load_into(*xl.text_encoder, file, text, xl.source_path + " (text encoder)");
  {
    // OpenCLIP's fused projections are split, so bigG goes through a map of its tensors (each
    // converted to the encoder's dtype as it is read, so the map holds one copy at that size).
    const c10::ScalarType dtype = xl.text_encoder_2->parameters().front().scalar_type();
    std::map<std::string, at::Tensor> open_clip;
    for (const TensorInfo& info : file.tensors()) {
      if (info.name.rfind(kSdxlOpenClipPrefix, 0) != 0) continue;
      const at::Tensor tensor = read_tensor(file, info);
      if (!tensor.is_floating_point()) {
        throw InputError(xl.source_path + ": " + info.name + " is " +
                         std::string(c10::toString(tensor.scalar_type())) +
                         ", not a floating-point tensor");
      }
      open_clip[info.name] = tensor.to(dtype);
    }
    if (open_clip.empty()) {
      throw InputError(xl.source_path + ": no OpenCLIP ViT-bigG text encoder under " +
                       std::string(kSdxlOpenClipPrefix) + "*");
    }
    load_into(*xl.text_encoder_2,
              open_clip_to_transformers(open_clip, kSdxlOpenClipPrefix, xl.source_path),
              xl.source_path + " (text encoder 2)",
              /*optional=*/{"text_model.embeddings.position_ids"});
  }
  attach_tokenizer(xl, options.tokenizer);
  return xl;
}

StableDiffusionXL load_diffusers_folder(const fs::path& folder, const LoadOptions& options) {
  StableDiffusionXL xl;
  xl.family = model_family("sdxl");
  xl.source_path = folder.string();
  for (const char* part : {"unet", "vae", "text_encoder", "text_encoder_2"}) {
    if (!fs::is_directory(folder / part)) {
      throw InputError(folder.string() + ": not an SDXL diffusers folder: no " + part + "/");
    }
  }
  auto config = [&](const char* part) {
    const fs::path file = folder / part / "config.json";
    return std::make_pair(read_text(file), file.string());
  };
  const auto [unet_json, unet_source] = config("unet");
  const auto [vae_json, vae_source] = config("vae");
  const auto [text_json, text_source] = config("text_encoder");
  const auto [text_2_json, text_2_source] = config("text_encoder_2");
  build(xl, UNetConfig::from_json(unet_json, unet_source), VaeConfig::from_json(vae_json, vae_source),
        ClipTextConfig::from_json(text_json, text_source),
        ClipTextConfig::from_json(text_2_json, text_2_source), options);
  read_declared_objective(folder, xl.family);
  if (options.load_denoiser) load_unet_diffusers(xl.unet, folder / "unet");
  load_vae(xl.vae, folder / "vae");
  load_clip_text(xl.text_encoder, folder / "text_encoder");
  load_clip_text(xl.text_encoder_2, folder / "text_encoder_2");
  attach_tokenizer(xl,
                   !options.tokenizer.empty()               ? options.tokenizer
                   : fs::is_directory(folder / "tokenizer") ? folder / "tokenizer"
                                                            : fs::path(),
                   fs::is_directory(folder / "tokenizer_2") ? folder / "tokenizer_2" : fs::path());
  return xl;
}

// A [B, C] tensor of module_tensors' entries by name (for the OpenCLIP conversion on save).
std::map<std::string, at::Tensor> named_tensors(const torch::nn::Module& module,
                                                std::optional<c10::ScalarType> dtype) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    out[p.key()] = (dtype ? p.value().to(*dtype) : p.value()).detach().cpu().contiguous();
  }
  return out;
}

}  // namespace

StableDiffusionXL load_stable_diffusion_xl(const fs::path& path, const LoadOptions& options) {
  std::error_code ec;
  StableDiffusionXL xl;
  if (fs::is_directory(path, ec)) {
    xl = load_diffusers_folder(path, options);
  } else if (!fs::exists(path, ec)) {
    throw InputError(path.string() + ": no such file or folder");
  } else {
    xl = load_single_file(path, options);
  }
  if (!options.vae.empty()) load_vae_override(xl, options.vae);
  return xl;
}

void save_sdxl_single_file(const StableDiffusionXL& model, const fs::path& path,
                           c10::ScalarType dtype) {
  std::vector<torch::Tensor> storage;
  std::vector<TensorToWrite> tensors;
  const KeyMap unet_map = sd15_unet_key_map(layout_of(model.unet->config()));
  const KeyMap vae_map = sd15_vae_key_map(layout_of(model.vae->config()));
  const KeyMap text_map = sd15_text_key_map(kSdxlClipLPrefix);
  auto add = [&](const torch::nn::Module& module, const KeyMap& map) {
    for (const TensorToWrite& t : module_tensors(module, storage, "", dtype)) {
      const auto ldm = map.to_ldm(t.name);
      if (!ldm) throw Error("save_sdxl_single_file: no ldm name for " + t.name);
      tensors.push_back({*ldm, t.dtype, t.shape, t.bytes});
    }
  };
  add(*model.unet, unet_map);
  add(*model.vae, vae_map);
  add(*model.text_encoder, text_map);
  for (TensorToWrite& t : tensors) {
    if (t.name.find(".mid.attn_1.") != std::string::npos && t.shape.size() == 2) {
      t.shape.push_back(1);  // ldm keeps these as 1x1 convolutions
      t.shape.push_back(1);
    }
  }
  for (auto& [name, tensor] : transformers_to_open_clip(
           named_tensors(*model.text_encoder_2, dtype), kSdxlOpenClipPrefix)) {
    storage.push_back(tensor.contiguous());
    const torch::Tensor& kept = storage.back();
    tensors.push_back({name, to_safetensors_dtype(kept.scalar_type()),
                       std::vector<int64_t>(kept.sizes().begin(), kept.sizes().end()),
                       std::string_view(static_cast<const char*>(kept.data_ptr()),
                                        kept.numel() * kept.element_size())});
  }
  write_safetensors(path, tensors,
                    {{kUnetConfigKey, to_config_json(model.unet->config())},
                     {kVaeConfigKey, to_config_json(model.vae->config())},
                     {kTextConfigKey, to_config_json(model.text_encoder->config())},
                     {kText2ConfigKey, to_config_json(model.text_encoder_2->config())},
                     {"lorapipe.family", model.family.name}});
}

void save_sdxl_diffusers(const StableDiffusionXL& model, const fs::path& folder,
                         const fs::path& tokenizer_folder) {
  fs::create_directories(folder);
  auto save = [&](const torch::nn::Module& module, const std::string& part,
                  const std::string& weights, const std::string& config) {
    fs::create_directories(folder / part);
    std::vector<torch::Tensor> storage;
    write_safetensors(folder / part / weights, module_tensors(module, storage), {{"format", "pt"}});
    write_text(folder / part / "config.json", config);
  };
  save(*model.unet, "unet", "diffusion_pytorch_model.safetensors",
       to_config_json(model.unet->config()));
  save(*model.vae, "vae", "diffusion_pytorch_model.safetensors",
       to_config_json(model.vae->config()));
  save(*model.text_encoder, "text_encoder", "model.safetensors",
       to_config_json(model.text_encoder->config()));
  save(*model.text_encoder_2, "text_encoder_2", "model.safetensors",
       to_config_json(model.text_encoder_2->config()));
  json index{{"_class_name", "StableDiffusionXLPipeline"},
             {"unet", {"diffusers", "UNet2DConditionModel"}},
             {"vae", {"diffusers", "AutoencoderKL"}},
             {"text_encoder", {"transformers", "CLIPTextModel"}},
             {"text_encoder_2", {"transformers", "CLIPTextModelWithProjection"}},
             {"force_zeros_for_empty_prompt", true}};
  if (!tokenizer_folder.empty()) {
    for (const char* part : {"tokenizer", "tokenizer_2"}) {
      fs::create_directories(folder / part);
      for (const auto& entry : fs::directory_iterator(tokenizer_folder)) {
        fs::copy_file(entry.path(), folder / part / entry.path().filename(),
                      fs::copy_options::overwrite_existing);
      }
      index[part] = {"transformers", "CLIPTokenizer"};
    }
    // tokenizer_2 pads with "!" (id 0), as stabilityai's does.
    const fs::path special = folder / "tokenizer_2" / "special_tokens_map.json";
    json tokens = fs::exists(special) ? json::parse(read_text(special)) : json::object();
    tokens["pad_token"] = "!";
    write_text(special, tokens.dump(2));
    const fs::path config = folder / "tokenizer_2" / "tokenizer_config.json";
    json settings = fs::exists(config) ? json::parse(read_text(config)) : json::object();
    settings["pad_token"] = "!";
    write_text(config, settings.dump(2));
  }
  write_text(folder / "model_index.json", index.dump(2));
}

// ---- the DiffusionModel interface -------------------------------------------------------------

TokenBatch StableDiffusionXL::tokenize(const std::vector<std::string>& captions,
                                       int max_token_length, bool weighted) const {
  if (!tokenizer || !tokenizer_2) {
    return StableDiffusion::tokenize(captions, max_token_length, weighted);  // throws
  }
  return kohya_token_batch({&*tokenizer, &*tokenizer_2}, captions, max_token_length, weighted);
}

void StableDiffusionXL::warn_clip_skip(int clip_skip) {
  if (clip_skip == 1 || warned_clip_skip_) return;
  warned_clip_skip_ = true;
  LP_LOG(kWarning, kLog) << source_path << ": --clip_skip " << clip_skip
                         << " is ignored: SDXL conditions on its encoders' penultimate layers, "
                            "as kohya's SDXL training does";
}

Conditioning StableDiffusionXL::encode_text(const TokenBatch& tokens, int clip_skip) {
  TORCH_CHECK(tokens.ids.size() == 2, "SDXL has two text encoders; got token ids for ",
              tokens.ids.size());
  if (!text_encoder || !text_encoder_2) throw Error(source_path + ": its text encoders were released");
  warn_clip_skip(clip_skip);
  const at::Device device = text_encoder->parameters().front().device();
  Conditioning c;
  at::Tensor one = text_encoder->encode_chunked_penultimate(tokens.ids[0].to(device));
  at::Tensor two = text_encoder_2->encode_chunked_penultimate(
      tokens.ids[1].to(text_encoder_2->parameters().front().device()), &c.pooled);
  if (!tokens.weights.empty()) {
    TORCH_CHECK(tokens.weights.size() == 2, "token weights for ", tokens.weights.size(),
                " encoders, SDXL has two");
    one = weigh_chunked_states(one, tokens.weights[0], family.text.max_length);
    two = weigh_chunked_states(two, tokens.weights[1], family.text.max_length);
  }
  c.hidden_states = torch::cat({one, two.to(one.device(), one.scalar_type())}, /*dim=*/-1);
  return c;
}

Conditioning StableDiffusionXL::encode_prompts(const std::vector<std::string>& prompts,
                                               int clip_skip) {
  require_tokenizer();
  // Sample prompts as kohya reads them: attention syntax, up to 225 tokens, every prompt at the
  // chunk count of the longest; each state times its token's weight, then each prompt rescaled
  // to the mean it had before weighting. Short prompts without weights: encode_prompt's states.
  const TokenBatch tokens = tokenize(prompts, /*max_token_length=*/0, /*weighted=*/true);
  bool weighted = false;
  for (const at::Tensor& w : tokens.weights) weighted = weighted || !torch::all(w == 1).item<bool>();
  if (!weighted) {
    TokenBatch plain;
    plain.ids = tokens.ids;
    return encode_text(plain, clip_skip);
  }
  TokenBatch plain;
  plain.ids = tokens.ids;
  const Conditioning unweighted = encode_text(plain, clip_skip);
  Conditioning c = encode_text(tokens, clip_skip);
  const auto dtype = c.hidden_states.scalar_type();
  const at::Tensor before = unweighted.hidden_states.to(torch::kFloat32).mean({-2, -1});
  const at::Tensor after = c.hidden_states.to(torch::kFloat32).mean({-2, -1});
  c.hidden_states =
      c.hidden_states * (before / after).to(dtype).unsqueeze(-1).unsqueeze(-1);
  return c;
}

std::string StableDiffusionXL::text_encoder_settings(int clip_skip, int max_token_length) const {
  (void)clip_skip;  // SDXL has no clip skip: the same states whatever it says
  const std::string tokenizer_print =
      builtin_tokenizer
          ? tokenizer_fingerprint(ClipTokenizer::kBuiltinName, ClipTokenizer::builtin_vocabulary())
          : tokenizer_fingerprint(tokenizer_path);
  return models::text_encoder_settings(/*clip_skip=*/1,
                                       tokenizer_print + ";sdxl:penultimate;pad2=" + pad_token_2 + ";pad2-in-text-bpe",
                                       max_token_length);
}

at::Tensor StableDiffusionXL::time_ids(const std::vector<SampleGeometry>& geometry,
                                       const at::Tensor& latents) const {
  const int64_t batch = latents.size(0);
  std::vector<float> ids;
  if (geometry.empty()) {
    const float h = static_cast<float>(latents.size(2) * family.vae_downsample);
    const float w = static_cast<float>(latents.size(3) * family.vae_downsample);
    for (int64_t i = 0; i < batch; ++i) ids.insert(ids.end(), {h, w, 0.0f, 0.0f, h, w});
  } else {
    TORCH_CHECK(static_cast<int64_t>(geometry.size()) == batch, "geometry for ",
                geometry.size(), " samples, latents for ", batch);
    for (const SampleGeometry& g : geometry) {
      ids.insert(ids.end(),
                 {static_cast<float>(g.original_height), static_cast<float>(g.original_width),
                  static_cast<float>(g.crop_top), static_cast<float>(g.crop_left),
                  static_cast<float>(g.target_height), static_cast<float>(g.target_width)});
    }
  }
  return torch::tensor(ids, torch::kFloat32).view({batch, 6});
}

at::Tensor StableDiffusionXL::denoise(const DenoiseInput& input) {
  TORCH_CHECK(input.conditioning != nullptr, "denoise: no conditioning");
  if (!unet) throw Error(source_path + ": loaded without its U-Net (load_denoiser off)");
  const Conditioning& c = *input.conditioning;
  if (!c.pooled.defined()) {
    throw Error(source_path + ": SDXL's U-Net needs the pooled text embedding; the conditioning "
                              "has none (text cached by another family?)");
  }
  const at::Tensor& like = unet->conv_norm_out->weight;  // the compute dtype (never float8)
  const int64_t batch = input.latents.size(0);
  // The conditioning may be one row for the whole batch (a sampler's prompt): repeat it.
  auto rows = [&](const at::Tensor& t, c10::ScalarType dtype) {
    at::Tensor x = t.to(like.device(), dtype);
    return x.size(0) == batch || x.size(0) != 1 ? x : x.expand({batch, -1}).contiguous();
  };
  // The time ids stay fp32, as kohya embeds them (bf16 would round an original width of 1023
  // to 1024); the U-Net's sinusoidal embedding of them is fp32 too.
  const at::Tensor ids =
      (c.added.defined() ? c.added : time_ids(input.geometry, input.latents));
  return unet->forward(input.latents.to(like.device(), like.scalar_type()), input.time,
                       c.hidden_states.to(like.device(), like.scalar_type()),
                       rows(c.pooled, like.scalar_type()), rows(ids, torch::kFloat32));
}

std::vector<LoraTarget> StableDiffusionXL::lora_targets(bool with_text_encoder,
                                                        bool conv_kxk) const {
  std::vector<LoraTarget> targets = sdxl_unet_lora_targets(unet, conv_kxk);
  if (with_text_encoder) {
    if (text_encoder) {
      for (LoraTarget& t : text_encoder_lora_targets(text_encoder, kLoraTextEncoder1Prefix, 0)) {
        targets.push_back(std::move(t));
      }
    }
    if (text_encoder_2) {
      for (LoraTarget& t : text_encoder_lora_targets(text_encoder_2, kLoraTextEncoder2Prefix, 1)) {
        targets.push_back(std::move(t));
      }
    }
  }
  return targets;
}

void StableDiffusionXL::set_gradient_checkpointing(bool enabled) {
  StableDiffusion::set_gradient_checkpointing(enabled);
  if (text_encoder_2) text_encoder_2->gradient_checkpointing = enabled;
}

std::vector<DiffusionModel::Component> StableDiffusionXL::components() {
  std::vector<Component> out;
  if (unet) out.push_back({Role::kDenoiser, "unet", "U-Net", unet.ptr().get()});
  if (text_encoder) {
    out.push_back({Role::kTextEncoder, "text_encoder", "text encoder (CLIP-L)",
                   text_encoder.ptr().get()});
  }
  if (text_encoder_2) {
    out.push_back({Role::kTextEncoder, "text_encoder_2", "text encoder 2 (OpenCLIP bigG)",
                   text_encoder_2.ptr().get()});
  }
  if (vae) out.push_back({Role::kVae, "vae", "VAE", vae.ptr().get()});
  return out;
}

void StableDiffusionXL::release(Role role) {
  if (role == Role::kTextEncoder) {
    text_encoder_2 = nullptr;
    text_encoders = nullptr;
  }
  StableDiffusion::release(role);
}

torch::nn::Module& StableDiffusionXL::text_encoder_module() {
  if (!text_encoders) throw Error(source_path + ": its text encoders were released");
  return *text_encoders;
}

}  // namespace lorapipe::models
