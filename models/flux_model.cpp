#include "models/flux_model.h"

#include <ATen/ATen.h>

#include "common/error.h"
#include "models/block_swap.h"
#include "models/fingerprint.h"
#include "models/flux_lora.h"
#include "models/loading.h"
#include "models/safetensors.h"
#include "models/sd15_keys.h"
#include "models/sd15_lora.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace fs = std::filesystem;

ModelFamily flux_model_family(bool dev) { return model_family(dev ? "flux-dev" : "flux-schnell"); }

TokenBatch FluxModel::tokenize(const std::vector<std::string>& captions, int /*max_token_length*/,
                               bool weighted) const {
  if (!has_tokenizer()) {
    throw InputError(source_path +
                     ": no tokenizers (a diffusers folder's tokenizer/ and "
                     "tokenizer_2/spiece.model)");
  }
  if (weighted) throw InputError("Flux.1 takes no --weighted_captions (kohya's Flux has none)");
  TokenBatch batch = kohya_token_batch({&*clip_tokenizer}, captions, 75, false);
  const auto n = static_cast<int64_t>(captions.size());
  at::Tensor t5_ids = at::empty({n, t5_max_length}, at::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t> ids = t5_tokenizer->encode_padded(captions[i], t5_max_length);
    std::copy(ids.begin(), ids.end(), t5_ids[i].data_ptr<int64_t>());
  }
  batch.ids.push_back(t5_ids);
  return batch;
}

Conditioning FluxModel::encode_text(const TokenBatch& tokens, int /*clip_skip*/) {
  TORCH_CHECK(tokens.ids.size() == 2, "Flux.1 takes CLIP-L's and T5's token ids");
  if (!clip || !t5) {
    throw Error(source_path + ": " + (clip ? "T5 was released (its states come from the cache)"
                                           : "its text encoders were released"));
  }
  Conditioning c;
  const at::Tensor clip_weight = clip->parameters().front();
  c.pooled = clip->forward(tokens.ids[0].to(clip_weight.device())).pooled;
  const at::Tensor& t5_ids = tokens.ids[1];
  // With kohya's --apply_t5_attn_mask, the mask: 1 up to and including </s> (T5's padding id
  // is 0 and no caption token is). Without it T5 and the transformer attend to every position
  // and the mask is left out: nothing would read it.
  if (apply_t5_attn_mask) {
    c.mask = (t5_ids != (t5_tokenizer ? t5_tokenizer->pad_id() : 0)).to(at::kLong);
  }
  c.hidden_states = t5(t5_ids, c.mask);
  return c;
}

Conditioning FluxModel::encode_trained_text(const TokenBatch& tokens, int /*clip_skip*/,
                                            const Conditioning& cached) {
  TORCH_CHECK(!tokens.ids.empty(), "Flux.1's CLIP-L takes its token ids");
  if (!clip) throw Error(source_path + ": its text encoders were released");
  Conditioning c = cached;
  const at::Tensor clip_weight = clip->parameters().front();
  c.pooled = clip->forward(tokens.ids[0].to(clip_weight.device())).pooled;
  return c;
}

void FluxModel::release_untrained_text_encoders() {
  if (!text_encoders) throw Error(source_path + ": its text encoders were released");
  if (!t5) return;
  text_encoders->unregister_module("text_encoder_2");
  t5 = nullptr;
}

Conditioning FluxModel::encode_prompts(const std::vector<std::string>& prompts, int clip_skip) {
  return encode_text(tokenize(prompts), clip_skip);
}

ImageLatents FluxModel::encode_images(const at::Tensor& images) {
  const at::Tensor weight = vae->parameters().front();
  const LatentDistribution dist = vae->encode(images.to(weight.device(), weight.scalar_type()));
  return {dist.mean, dist.std()};
}

at::Tensor FluxModel::decode_latents(const at::Tensor& latents) {
  const at::Tensor weight = vae->parameters().front();
  return vae->decode(latents.to(weight.device(), weight.scalar_type()) / family.vae_scaling_factor +
                     family.vae_shift_factor);
}

std::string FluxModel::text_encoder_settings(int /*clip_skip*/, int /*max_token_length*/) const {
  // The tokenizers are part of what made a record: another spiece.model or CLIP vocabulary with
  // the same encoders gives other states, so it is another key.
  return "flux clip-l pooled + t5 max_length=" + std::to_string(t5_max_length) +
         " t5_attn_mask=" + (apply_t5_attn_mask ? "1" : "0") + ";tokenizers=" + tokenizer_print;
}

at::Tensor FluxModel::denoise(const DenoiseInput& input) {
  TORCH_CHECK(input.conditioning != nullptr, "denoise: no conditioning");
  if (!transformer) throw Error(source_path + ": loaded without its transformer");
  const Conditioning& c = *input.conditioning;
  const at::Tensor like = transformer->txt_in->bias;  // compute dtype and device (never float8)
  const at::Tensor& x = input.latents;
  const int64_t b = x.size(0), h = x.size(2), w = x.size(3);
  FluxInput in;
  in.img = pack_latents(x.to(like.device(), like.scalar_type()));
  in.img_ids = image_ids(h, w).to(like.device());
  in.txt = c.hidden_states.to(like.device(), like.scalar_type());
  in.txt_ids = at::zeros({in.txt.size(1), 3}, like.options().dtype(at::kFloat));
  in.timesteps = input.time.to(like.device(), at::kFloat).expand({b}).contiguous();
  in.y = c.pooled.to(like.device(), like.scalar_type());
  if (family.name == "flux-dev") {
    in.guidance =
        at::full({b}, input.guidance.value_or(default_guidance), like.options().dtype(at::kFloat));
  }
  if (apply_t5_attn_mask && c.mask.defined()) in.txt_mask = c.mask.to(like.device());
  return unpack_latents(transformer(in), h, w);
}

std::vector<LoraTarget> FluxModel::lora_targets(bool text_encoder, bool /*conv_kxk*/) const {
  std::vector<LoraTarget> targets =
      flux_lora_targets(transformer, "all", model_family().kohya.in_dims);
  if (text_encoder && clip) {
    for (LoraTarget& t : text_encoder_lora_targets(clip, "lora_te1", 0)) {
      targets.push_back(std::move(t));
    }
  }
  return targets;
}

DiffusionModel::BlockSwapReport FluxModel::enable_block_swap(int blocks, c10::Device device,
                                                            int slots) {
  if (!transformer) throw Error("block swap: the transformer was released");
  const size_t doubles = transformer->double_blocks->size();
  const size_t singles = transformer->single_blocks->size();
  const std::vector<size_t> swapped = flux_swapped_blocks(blocks, doubles, singles);
  transformer->block_swap = std::make_shared<BlockSwap>(transformer->blocks(), swapped,
                                                        make_swap_device(device), slots);
  const size_t d = static_cast<size_t>(blocks / 2);
  BlockSwapReport report;
  report.blocks = "the last " + std::to_string(d) + " of " + std::to_string(doubles) +
                  " double blocks and " + std::to_string(swapped.size() - d) + " of " +
                  std::to_string(singles) + " single blocks";
  report.host_bytes = transformer->block_swap->host_bytes();
  report.slot_bytes = transformer->block_swap->slot_bytes();
  report.slots = transformer->block_swap->slots();
  return report;
}

void FluxModel::set_cpu_offload_checkpointing(bool enabled) {
  if (transformer) transformer->cpu_offload_checkpointing = enabled;
}

void FluxModel::set_gradient_checkpointing(bool enabled) {
  if (transformer) transformer->gradient_checkpointing = enabled;
}

std::vector<DiffusionModel::Component> FluxModel::components() {
  std::vector<Component> out;
  if (transformer) {
    out.push_back({Role::kDenoiser, "transformer", "transformer", transformer.ptr().get()});
  }
  if (text_encoders) {
    out.push_back({Role::kTextEncoder, "text_encoders", "text encoders", text_encoders.get()});
  }
  if (vae) out.push_back({Role::kVae, "vae", "AE", vae.ptr().get()});
  return out;
}

void FluxModel::release(Role role) {
  switch (role) {
    case Role::kDenoiser:
      transformer = nullptr;
      break;
    case Role::kTextEncoder:
      text_encoders = nullptr;
      clip = nullptr;
      t5 = nullptr;
      break;
    case Role::kVae:
      vae = nullptr;
      break;
  }
}

torch::nn::Module& FluxModel::denoiser_module() {
  if (!transformer) throw Error(source_path + ": loaded without its transformer");
  return *transformer;
}

torch::nn::Module& FluxModel::text_encoder_module() {
  if (!text_encoders) throw Error(source_path + ": its text encoders were released");
  return *text_encoders;
}

torch::nn::Module& FluxModel::vae_module() {
  if (!vae) throw Error(source_path + ": its AE was released");
  return *vae;
}

namespace {

constexpr const char* kConfigKey = "lorapipe.config";

// The config JSON a part file of lorapipe's carries (the tests' tiny ones); users' files carry
// none and are the full-size parts.
std::optional<std::string> file_config(const SafetensorsFile& file) {
  const auto it = file.metadata().find(kConfigKey);
  if (it == file.metadata().end()) return std::nullopt;
  return it->second;
}

bool has_key(const SafetensorsFile& file, const std::string& name) {
  for (const TensorInfo& t : file.tensors()) {
    if (t.name == name) return true;
  }
  return false;
}

// ComfyUI's all-in-one FLUX.1 checkpoint (its flux1-dev-fp8.safetensors and the like) holds
// every part under a prefix: the transformer under model.diffusion_model., CLIP-L and T5 in
// transformers' names under these, and the AE in Black Forest Labs' names under vae.
constexpr const char* kComfyClipL = "text_encoders.clip_l.transformer.";
constexpr const char* kComfyT5 = "text_encoders.t5xxl.transformer.";
constexpr const char* kComfyAe = "vae.";

// Where a part's tensors are: its own file or folder (no prefix), or the model's file under a
// prefix, with its config (lorapipe's tiny files only) under lorapipe.config.<name>.
struct Part {
  fs::path path;
  std::string prefix;
  std::string name;  // "clip_l", "t5xxl", "ae": the config's metadata key
  std::string source() const { return prefix.empty() ? path.string() : path.string() + " (" + prefix + "*)"; }
};

bool has_prefix(const SafetensorsFile& file, const std::string& prefix) {
  for (const TensorInfo& t : file.tensors()) {
    if (t.name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

std::optional<std::string> part_config(const SafetensorsFile& file, const Part& part) {
  if (part.prefix.empty()) return file_config(file);
  const auto it = file.metadata().find(std::string(kConfigKey) + "." + part.name);
  if (it == file.metadata().end()) return std::nullopt;
  return it->second;
}

// The file's tensors under `prefix`, by their names without it.
std::map<std::string, const TensorInfo*> under(const SafetensorsFile& file, const std::string& prefix) {
  std::map<std::string, const TensorInfo*> names;
  for (const TensorInfo& t : file.tensors()) {
    if (t.name.rfind(prefix, 0) == 0) names[t.name.substr(prefix.size())] = &t;
  }
  return names;
}

// The transformer of a single file, with or without the model.diffusion_model. prefix: its
// diffusers config from our metadata, else FLUX.1's full size (dev with guidance_in, schnell
// without).
FluxTransformer load_transformer_file(const fs::path& path, c10::ScalarType dtype) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  const std::string prefix =
      has_key(file, std::string(kLdmUnetPrefix) + "img_in.weight") ? std::string(kLdmUnetPrefix) : "";
  FluxConfig config;
  if (const auto json = file_config(file)) {
    config = FluxConfig::from_diffusers_json(*json, path.string());
  } else {
    config = has_key(file, prefix + "guidance_in.in_layer.weight") ? FluxConfig::dev()
                                                                    : FluxConfig::schnell();
  }
  at::NoGradGuard no_grad;
  FluxTransformer transformer(config, at::TensorOptions().dtype(dtype));
  load_flux_original(*transformer, file, prefix);
  return transformer;
}

// CLIP-L from a transformers folder or kohya's clip_l.safetensors (transformers' names; some
// files also hold the projection and logit scale, which the pooled output does not use).
ClipTextModel load_clip_l(const Part& part, c10::ScalarType dtype) {
  const fs::path& path = part.path;
  ClipTextConfig config;
  fs::path file = path;
  if (fs::is_directory(path)) {
    config = ClipTextConfig::from_json(read_text(path / "config.json"),
                                       (path / "config.json").string());
    file = path / "model.safetensors";
  }
  const SafetensorsFile weights = SafetensorsFile::open(file);
  if (!fs::is_directory(path)) {
    const auto json = part_config(weights, part);
    config = json ? ClipTextConfig::from_json(*json, part.source()) : ClipTextConfig::sd15();
  }
  ClipTextModel clip = build_in(dtype, [&] { return ClipTextModel(config); });
  const std::set<std::string> optional{"text_model.embeddings.position_ids",
                                       "text_projection.weight", "logit_scale"};
  if (part.prefix.empty()) {
    load_into(*clip, weights, file.string(), optional);
  } else {
    load_into(*clip, weights, under(weights, part.prefix), part.source(), nullptr, optional);
  }
  return clip;
}

// T5 from a transformers folder (config.json and model.safetensors or its shards) or kohya's
// t5xxl file (XXL, any of fp32, fp16, bf16 or float8 storage).
// T5's config for a part, from headers alone: its folder's config.json, lorapipe's metadata (the
// tests' tiny files), else T5 v1.1 XXL's.
T5Config t5_config_of(const Part& part) {
  const fs::path& path = part.path;
  if (fs::is_directory(path)) {
    return T5Config::from_json(read_text(path / "config.json"), (path / "config.json").string());
  }
  const auto json = part_config(SafetensorsFile::open(path), part);
  return json ? T5Config::from_json(*json, part.source()) : T5Config::xxl();
}

T5Encoder load_t5(const Part& part, c10::ScalarType dtype) {
  const fs::path& path = part.path;
  std::vector<SafetensorsFile> files;
  const T5Config config = t5_config_of(part);
  if (fs::is_directory(path)) {
    files = open_weight_files(path, "model");
  } else {
    files.push_back(SafetensorsFile::open(path));
  }
  at::NoGradGuard no_grad;
  T5Encoder t5(config, at::TensorOptions().dtype(dtype));
  std::vector<const SafetensorsFile*> parts;
  for (const SafetensorsFile& f : files) parts.push_back(&f);
  load_t5_encoder(*t5, parts, part.source(), part.prefix);
  return t5;
}

// FLUX.1's AE: 16 channels, no quant convs.
VaeConfig flux_ae_config() {
  VaeConfig c = VaeConfig::sd15();
  c.latent_channels = 16;
  c.scaling_factor = 0.3611;
  c.shift_factor = 0.1159;
  c.use_quant_conv = false;
  c.use_post_quant_conv = false;
  return c;
}

// The AE from a diffusers vae/ folder, or Black Forest Labs' ae.safetensors (ldm's VAE names
// without first_stage_model.: encoder.down.0.block.0.norm1.weight, ...).
// An AE of another family (SD's 4 channels) is refused here, naming the file, rather than at the
// first encode or decode.
void check_ae_channels(const VaeConfig& config, const fs::path& path) {
  if (config.latent_channels != flux_ae_config().latent_channels) {
    throw InputError(path.string() + ": an AE with " + std::to_string(config.latent_channels) +
                     " latent channels; FLUX.1's has " +
                     std::to_string(flux_ae_config().latent_channels) +
                     " (an SD or SDXL VAE? give FLUX.1's ae.safetensors as --ae)");
  }
}

AutoencoderKL load_ae(const Part& part, c10::ScalarType dtype) {
  const fs::path& path = part.path;
  if (fs::is_directory(path)) {
    const VaeConfig config = VaeConfig::from_json(read_text(path / "config.json"),
                                                  (path / "config.json").string());
    check_ae_channels(config, path);
    AutoencoderKL vae = build_in(dtype, [&] { return AutoencoderKL(config); });
    load_vae(vae, path);
    return vae;
  }
  const SafetensorsFile file = SafetensorsFile::open(path);
  const auto json = part_config(file, part);
  const VaeConfig config = json ? VaeConfig::from_json(*json, part.source()) : flux_ae_config();
  check_ae_channels(config, part.source());
  const KeyMap map = sd15_vae_key_map(layout_of(config));
  std::map<std::string, const TensorInfo*> names;
  std::vector<std::string> unknown;
  for (const auto& [key, t] : under(file, part.prefix)) {
    const auto name = map.to_diffusers(std::string(kLdmVaePrefix) + key);
    if (name) {
      names[*name] = t;
    } else {
      unknown.push_back(key);
    }
  }
  if (!unknown.empty()) {
    throw InputError(part.source() + ": " + std::to_string(unknown.size()) +
                     " keys are not those of an AE in Black Forest Labs' layout, e.g. " +
                     unknown.front());
  }
  AutoencoderKL vae = build_in(dtype, [&] { return AutoencoderKL(config); });
  load_into(*vae, file, names, part.source(), vae_attention_from_ldm());
  return vae;
}

// Where a part is: its flag's file or folder, the diffusers folder's component, or the model's
// own file under ComfyUI's prefix (`single`: the model's file when it is one).
Part part_path(const fs::path& option, const fs::path& folder, const char* part,
               const fs::path& model, const char* flag, const SafetensorsFile* single,
               const char* comfy_prefix, const char* name) {
  if (!option.empty()) return {option, "", name};
  if (!folder.empty()) return {folder / part, "", name};
  if (single != nullptr && has_prefix(*single, comfy_prefix)) return {model, comfy_prefix, name};
  throw InputError(model.string() + " is a FLUX.1 transformer alone: pass " + flag +
                   " (kohya's: the file of that part, e.g. " +
                   (std::string(flag) == "--clip_l"  ? "clip_l.safetensors"
                    : std::string(flag) == "--t5xxl" ? "t5xxl_fp16.safetensors"
                                                     : "ae.safetensors") +
                   ")");
}

}  // namespace

FluxModel load_flux(const fs::path& path, const ModelFamily& family, const LoadOptions& options) {
  const bool folder = fs::is_directory(path);
  if (folder) {
    for (const char* part : {"transformer", "text_encoder", "text_encoder_2", "vae"}) {
      if (!fs::is_directory(path / part)) {
        throw InputError(path.string() + ": not a FLUX.1 diffusers folder: no " + part + "/");
      }
    }
  }
  const fs::path parts_folder = folder ? path : fs::path();
  FluxModel m;
  m.source_path = path.string();
  m.family = family;
  const c10::ScalarType dtype = storage_dtype(options.dtype, "dtype");
  const c10::ScalarType text_dtype =
      storage_dtype(options.text_encoder_dtype.value_or(dtype), "text_encoder_dtype");
  const c10::ScalarType vae_dtype = storage_dtype(options.vae_dtype.value_or(dtype), "vae_dtype");
  if (options.parts.t5_max_length < 0) {
    throw InputError("--t5xxl_max_token_length must be positive, not " +
                     std::to_string(options.parts.t5_max_length));
  }
  m.t5_max_length = options.parts.t5_max_length > 0 ? options.parts.t5_max_length : family.text.max_length;
  m.family.text.max_length = m.t5_max_length;
  m.apply_t5_attn_mask = options.parts.apply_t5_attn_mask;

  // Everything that can be refused from headers comes before the weights load: which file holds
  // each part, and T5's tokenizer against the encoder's rows.
  std::optional<SafetensorsFile> single;
  if (!folder) single.emplace(SafetensorsFile::open(path));
  const SafetensorsFile* whole = single ? &*single : nullptr;
  const Part clip_path = part_path(options.parts.clip_l, parts_folder, "text_encoder", path,
                                   "--clip_l", whole, kComfyClipL, "clip_l");
  const Part t5_part = part_path(options.parts.t5xxl, parts_folder, "text_encoder_2", path,
                                 "--t5xxl", whole, kComfyT5, "t5xxl");
  const Part ae_path = part_path(!options.parts.ae.empty() ? options.parts.ae : options.vae,
                                 parts_folder, "vae", path, "--ae", whole, kComfyAe, "ae");
  single.reset();
  fs::path spiece = options.parts.t5_tokenizer;
  if (spiece.empty() && folder) spiece = path / "tokenizer_2";
  if (!spiece.empty() && fs::is_directory(spiece)) spiece /= "spiece.model";
  if (spiece.empty() || !fs::exists(spiece)) {
    throw InputError(
        path.string() + ": no T5 tokenizer" + (spiece.empty() ? "" : " at " + spiece.string()) +
        ": pass --t5_tokenizer, T5's spiece.model (a FLUX.1 diffusers folder's tokenizer_2/, or "
        "google/t5-v1_1-xxl's); kohya's files carry none");
  }
  m.t5_tokenizer = T5Tokenizer::from_file(spiece);
  // An id past the embedding's rows would only fail at the first encode, naming nothing; a
  // smaller vocabulary of another model would pass and condition on the wrong tokens.
  const int64_t t5_rows = t5_config_of(t5_part).vocab_size;
  if (m.t5_tokenizer->vocab_size() > t5_rows) {
    throw InputError(spiece.string() + ": a T5 tokenizer of " +
                     std::to_string(m.t5_tokenizer->vocab_size()) + " ids, but the T5 encoder (" +
                     t5_part.source() + ") embeds " + std::to_string(t5_rows) +
                     ": not this encoder's spiece.model (T5 v1.1's has 32000 pieces)");
  }

  if (options.load_denoiser) {
    if (folder) {
      const fs::path config = path / "transformer" / "config.json";
      const FluxConfig c = FluxConfig::from_diffusers_json(read_text(config), config.string());
      at::NoGradGuard no_grad;
      m.transformer = FluxTransformer(c, at::TensorOptions().dtype(dtype));
      load_flux_diffusers(*m.transformer, path / "transformer");
    } else {
      m.transformer = load_transformer_file(path, dtype);
    }
    if (m.transformer->config.guidance_embed != (family.name == "flux-dev")) {
      throw InputError(path.string() + ": loaded as " + family.display_name + ", but its " +
                       "transformer " + (m.transformer->config.guidance_embed ? "has" : "has no") +
                       " guidance embedding");
    }
    m.transformer->eval();
  }
  m.clip = load_clip_l(clip_path, text_dtype);
  m.clip->eval();
  m.t5 = load_t5(t5_part, text_dtype);
  m.t5->eval();
  m.text_encoders = std::make_shared<torch::nn::Module>();
  m.text_encoders->register_module("text_encoder", m.clip.ptr());
  m.text_encoders->register_module("text_encoder_2", m.t5.ptr());
  m.vae = load_ae(ae_path, vae_dtype);
  m.vae->eval();

  bool builtin = false;
  const fs::path clip_tokenizer_path = !options.tokenizer.empty() ? options.tokenizer
                                       : folder && fs::is_directory(path / "tokenizer")
                                           ? path / "tokenizer"
                                           : fs::path();
  m.clip_tokenizer =
      clip_tokenizer_for(clip_tokenizer_path, m.clip->config().vocab_size, m.source_path, &builtin);
  m.tokenizer_print =
      (builtin ? tokenizer_fingerprint(ClipTokenizer::kBuiltinName, ClipTokenizer::builtin_vocabulary())
               : tokenizer_fingerprint(clip_tokenizer_path)) +
      "," + tokenizer_fingerprint("spiece.model", read_text(spiece));
  return m;
}

FluxModel load_flux_diffusers_folder(const fs::path& folder, const LoadOptions& options) {
  return load_flux(folder, model_family(detect_family(folder, options.family).family), options);
}

}  // namespace lorapipe::models
