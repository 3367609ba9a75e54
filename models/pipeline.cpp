#include "models/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"
#include "models/block_swap.h"
#include "models/fingerprint.h"
#include "models/loading.h"
#include "models/long_prompt.h"
#include "models/prompt_attention.h"
#include "models/safetensors.h"
#include "models/sd15_keys.h"
#include "models/sd15_lora.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kLog = "models";
constexpr const char* kUnetConfigKey = "lorapipe.unet_config";
constexpr const char* kVaeConfigKey = "lorapipe.vae_config";
constexpr const char* kTextConfigKey = "lorapipe.text_encoder_config";

// Builds the three modules on the CPU, each in its storage dtype from the start.
void build(StableDiffusion& sd, const UNetConfig& unet, const VaeConfig& vae,
           const ClipTextConfig& text, const LoadOptions& options) {
  const c10::ScalarType dtype = storage_dtype(options.dtype, "dtype");
  if (options.load_denoiser) sd.unet = build_in(dtype, [&] { return UNet(unet); });
  sd.vae = build_in(storage_dtype(options.vae_dtype.value_or(dtype), "vae_dtype"),
                    [&] { return AutoencoderKL(vae); });
  sd.text_encoder =
      build_in(storage_dtype(options.text_encoder_dtype.value_or(dtype), "text_encoder_dtype"),
               [&] { return ClipTextModel(text); });
}

void attach_tokenizer(StableDiffusion& sd, const fs::path& path) {
  sd.tokenizer = clip_tokenizer_for(path, sd.text_encoder->config().vocab_size, sd.source_path,
                                    &sd.builtin_tokenizer);
  sd.tokenizer_path = path;
}

StableDiffusion load_single_file(const fs::path& path, const LoadOptions& options) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  StableDiffusion sd;
  sd.family = model_family("sd15");  // the family this loader reads
  sd.source_path = path.string();
  read_declared_objective(path, sd.family);
  const auto& meta = file.metadata();
  auto config_from = [&](const char* key) -> const std::string* {
    auto it = meta.find(key);
    return it == meta.end() ? nullptr : &it->second;
  };
  const UNetConfig unet_config =
      config_from(kUnetConfigKey) ? UNetConfig::from_json(*config_from(kUnetConfigKey), sd.source_path)
                                  : UNetConfig::sd15();
  const VaeConfig vae_config = config_from(kVaeConfigKey)
                                   ? VaeConfig::from_json(*config_from(kVaeConfigKey), sd.source_path)
                                   : VaeConfig::sd15();
  const ClipTextConfig text_config =
      config_from(kTextConfigKey)
          ? ClipTextConfig::from_json(*config_from(kTextConfigKey), sd.source_path)
          : ClipTextConfig::sd15();
  build(sd, unet_config, vae_config, text_config, options);

  const KeyMap unet_map = sd15_unet_key_map(layout_of(unet_config));
  const KeyMap vae_map = sd15_vae_key_map(layout_of(vae_config));
  const KeyMap text_map = sd15_text_key_map();
  // Each component's diffusers names mapped to the file's tensors; nothing is read until every
  // key is known to belong somewhere, and then one tensor at a time (load_into).
  std::map<std::string, const TensorInfo*> unet, vae, text;
  std::vector<std::string> unknown;
  for (const TensorInfo& info : file.tensors()) {
    const std::string& key = info.name;
    if (is_objective_marker_key(key)) continue;  // read by read_declared_objective
    std::optional<std::string> name;
    std::map<std::string, const TensorInfo*>* target = nullptr;
    if (key.rfind(kLdmUnetPrefix, 0) == 0) {
      name = unet_map.to_diffusers(key), target = &unet;
    } else if (key.rfind(kLdmVaePrefix, 0) == 0) {
      name = vae_map.to_diffusers(key), target = &vae;
    } else if (key.rfind(kLdmTextPrefix, 0) == 0) {
      name = text_map.to_diffusers(key), target = &text;
    }
    if (is_known_optional_ldm_key(key)) {
      ++sd.skipped_keys;
      continue;
    }
    if (target == &unet && !options.load_denoiser) continue;
    if (!name) {
      unknown.push_back(key);
      continue;
    }
    (*target)[*name] = &info;
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < unknown.size() && i < 8; ++i) list += (i ? ", " : "") + unknown[i];
    throw InputError(sd.source_path + ": " + std::to_string(unknown.size()) +
                     " keys belong to no known component of an SD1.x checkpoint: " + list);
  }
  if (sd.skipped_keys > 0) {
    LP_LOG(kWarning, kLog) << sd.source_path << ": skipped " << sd.skipped_keys
                           << " entries that carry no weights we use (EMA copies, noise "
                              "schedule, position_ids)";
  }
  if (options.load_denoiser) load_into(*sd.unet, file, unet, sd.source_path + " (unet)");
  load_into(*sd.vae, file, vae, sd.source_path + " (vae)", vae_attention_from_ldm());
  load_into(*sd.text_encoder, file, text, sd.source_path + " (text encoder)");
  attach_tokenizer(sd, options.tokenizer);
  return sd;
}

StableDiffusion load_diffusers_folder(const fs::path& folder, const LoadOptions& options) {
  StableDiffusion sd;
  sd.family = model_family("sd15");  // the family this loader reads
  sd.source_path = folder.string();
  read_declared_objective(folder, sd.family);
  for (const char* part : {"unet", "vae", "text_encoder"}) {
    if (!fs::is_directory(folder / part)) {
      throw InputError(folder.string() + ": not a diffusers folder: no " + part + "/");
    }
  }
  build(sd,
        UNetConfig::from_json(read_text(folder / "unet" / "config.json"),
                              (folder / "unet" / "config.json").string()),
        VaeConfig::from_json(read_text(folder / "vae" / "config.json"),
                             (folder / "vae" / "config.json").string()),
        ClipTextConfig::from_json(read_text(folder / "text_encoder" / "config.json"),
                                  (folder / "text_encoder" / "config.json").string()),
        options);
  if (options.load_denoiser) load_unet_diffusers(sd.unet, folder / "unet");
  load_vae(sd.vae, folder / "vae");
  load_clip_text(sd.text_encoder, folder / "text_encoder");
  attach_tokenizer(sd, !options.tokenizer.empty()               ? options.tokenizer
                      : fs::is_directory(folder / "tokenizer") ? folder / "tokenizer"
                                                               : fs::path());
  return sd;
}

}  // namespace

// ---- models/loading.h -------------------------------------------------------------------------

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw Error("cannot write " + path.string());
}

UNetLayout layout_of(const UNetConfig& c) {
  UNetLayout layout;
  layout.down_attention.clear();
  layout.up_attention.clear();
  for (const std::string& t : c.down_block_types) {
    layout.down_attention.push_back(t == "CrossAttnDownBlock2D");
  }
  for (const std::string& t : c.up_block_types) {
    layout.up_attention.push_back(t == "CrossAttnUpBlock2D");
  }
  for (int64_t layers : c.layers_per_block) {
    if (layers != c.layers_per_block[0]) {
      throw InputError("single-file layout: layers_per_block must be the same for every block");
    }
  }
  layout.layers_per_block = static_cast<int>(c.layers_per_block[0]);
  layout.text_time = c.addition_embed_type == "text_time";
  return layout;
}

VaeLayout layout_of(const VaeConfig& c) {
  return {static_cast<int>(c.block_out_channels.size()), static_cast<int>(c.layers_per_block)};
}

c10::ScalarType storage_dtype(c10::ScalarType dtype, const char* option) {
  if (dtype != c10::kFloat && dtype != c10::kHalf && dtype != c10::kBFloat16) {
    throw InputError(std::string("LoadOptions::") + option + ": " + c10::toString(dtype) +
                     " is no storage dtype to load into (fp32, fp16 or bf16; float8 is placed)");
  }
  return dtype;
}

AdaptTensor vae_attention_from_ldm() {
  return [](const TensorInfo& info, torch::Tensor tensor) {
    const bool conv_projection =
        info.name.find(".mid.attn_1.") != std::string::npos && tensor.dim() == 4;
    return conv_projection ? tensor.flatten(1) : tensor;
  };
}

std::optional<ClipTokenizer> clip_tokenizer_for(const fs::path& path, int64_t vocab_size,
                                                const std::string& source, bool* builtin) {
  *builtin = false;
  if (!path.empty()) return ClipTokenizer::from_file(path);
  if (ClipTokenizer::builtin_vocabulary().empty()) return std::nullopt;
  ClipTokenizer tokenizer = ClipTokenizer::builtin();
  if (static_cast<int64_t>(tokenizer.vocab_size()) != vocab_size) return std::nullopt;
  *builtin = true;
  LP_LOG(kInfo, kLog) << source << ": no tokenizer given, using CLIP's vocabulary (built in)";
  return tokenizer;
}

TokenBatch kohya_token_batch(const std::vector<const ClipTokenizer*>& tokenizers,
                             const std::vector<std::string>& captions, int max_token_length,
                             bool weighted) {
  const int per_chunk = ClipTokenizer::kModelMaxLength - 2;  // 75 tokens between BOS and EOS
  if (max_token_length == 0) {  // the smallest of kohya's lengths that holds every caption
    size_t longest = 0;
    for (const std::string& caption : captions) {
      longest = std::max(longest, tokenizers.front()->encode(caption).size());
    }
    max_token_length = per_chunk;
    while (max_token_length < 3 * per_chunk && longest > static_cast<size_t>(max_token_length)) {
      max_token_length += per_chunk;
    }
  }
  const int64_t batch = static_cast<int64_t>(captions.size());
  TokenBatch out;
  for (const ClipTokenizer* tokenizer : tokenizers) {
    std::vector<int64_t> ids;
    if (weighted) {
      std::vector<float> w;
      for (const std::string& caption : captions) {
        const WeightedIds t = kohya_weighted_long_prompt_ids(*tokenizer, caption, max_token_length);
        ids.insert(ids.end(), t.ids.begin(), t.ids.end());
        w.insert(w.end(), t.weights.begin(), t.weights.end());
      }
      out.weights.push_back(torch::tensor(w, torch::kFloat32).view({batch, -1}));
    } else {
      for (const std::string& caption : captions) {
        for (int32_t id : kohya_long_prompt_ids(*tokenizer, caption, max_token_length)) {
          ids.push_back(id);
        }
      }
    }
    out.ids.push_back(torch::tensor(ids, torch::kInt64).view({batch, -1}));
  }
  return out;
}

at::Tensor weigh_chunked_states(const at::Tensor& states, const at::Tensor& token_weights,
                                int64_t chunk) {
  // The weights laid out as encode_chunked lays out the states: the first chunk's BOS, each
  // chunk's 75 inner positions, the last position (BOS and EOS weigh 1, as kohya leaves them).
  const int64_t count = token_weights.size(1);
  at::Tensor w = token_weights;
  if (count > chunk) {
    std::vector<at::Tensor> parts{token_weights.narrow(1, 0, 1)};
    for (int64_t i = 1; i < count - 1; i += chunk) {
      parts.push_back(token_weights.narrow(1, i, chunk - 2));
    }
    parts.push_back(token_weights.narrow(1, count - 1, 1));
    w = torch::cat(parts, /*dim=*/1);
  }
  TORCH_CHECK(w.size(1) == states.size(1), "token weights for ", w.size(1),
              " positions, states for ", states.size(1));
  // In fp32 (kohya's weights are fp32 tensors), then back in the states' dtype, which the
  // denoiser casts to anyway (kohya keeps the promoted fp32 product; under autocast the same).
  return (states.to(torch::kFloat32) * w.to(states.device(), torch::kFloat32).unsqueeze(-1))
      .to(states.scalar_type());
}

StableDiffusion load_stable_diffusion(const fs::path& path, const LoadOptions& options) {
  std::error_code ec;
  StableDiffusion sd;
  if (fs::is_directory(path, ec)) {
    sd = load_diffusers_folder(path, options);
  } else if (!fs::exists(path, ec)) {
    throw InputError(path.string() + ": no such file or folder");
  } else {
    sd = load_single_file(path, options);
  }
  if (!options.vae.empty()) load_vae_override(sd, options.vae);
  return sd;
}

void load_vae_override(StableDiffusion& model, const fs::path& path) {
  std::error_code ec;
  const std::string source = path.string() + " (--vae)";
  if (fs::is_directory(path, ec)) {
    const fs::path folder = fs::is_directory(path / "vae") ? path / "vae" : path;
    if (!fs::exists(folder / "diffusion_pytorch_model.safetensors")) {
      throw InputError(source + ": no diffusion_pytorch_model.safetensors in " + folder.string());
    }
    load_vae(model.vae, folder);
    return;
  }
  if (!fs::exists(path, ec)) throw InputError(source + ": no such file or folder");
  if (path.extension() != ".safetensors") {
    throw InputError(source + ": only .safetensors VAEs are read (a .ckpt or .pt file is a "
                              "pickle, which can run code; convert it to safetensors first)");
  }
  const SafetensorsFile file = SafetensorsFile::open(path);
  bool ldm = false, diffusers = false, whole = false;
  for (const TensorInfo& info : file.tensors()) {
    whole |= info.name.rfind(kLdmVaePrefix, 0) == 0;
    diffusers |= info.name.find("down_blocks.") != std::string::npos ||
                 info.name.find("up_blocks.") != std::string::npos;
    ldm |= info.name.rfind("encoder.down.", 0) == 0 || info.name.rfind("decoder.up.", 0) == 0;
  }
  if (diffusers && !whole) {
    load_vae(model.vae, path);  // diffusers' names, old attention names too
    return;
  }
  if (!ldm && !whole) {
    throw InputError(source + ": holds no VAE weights (neither encoder.* / decoder.* nor "
                              "first_stage_model.*)");
  }
  const KeyMap vae_map = sd15_vae_key_map(layout_of(model.vae->config()));
  std::map<std::string, const TensorInfo*> names;
  std::vector<std::string> unknown;
  int skipped = 0;
  for (const TensorInfo& info : file.tensors()) {
    std::string key = info.name;
    if (whole) {
      if (key.rfind(kLdmVaePrefix, 0) != 0) continue;  // the checkpoint's other models
    } else {
      if (key.rfind("loss.", 0) == 0 || key.rfind("model_ema.", 0) == 0) {
        ++skipped;
        continue;
      }
      key = std::string(kLdmVaePrefix) + key;
    }
    const std::optional<std::string> name = vae_map.to_diffusers(key);
    if (!name) {
      unknown.push_back(info.name);
      continue;
    }
    names[*name] = &info;
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < unknown.size() && i < 8; ++i) list += (i ? ", " : "") + unknown[i];
    throw InputError(source + ": " + std::to_string(unknown.size()) +
                     " keys are no weight of an SD1.x VAE: " + list);
  }
  if (skipped > 0) {
    LP_LOG(kInfo, kLog) << source << ": skipped " << skipped
                        << " entries of its training run (loss.*, model_ema.*)";
  }
  load_into(*model.vae, file, names, source, vae_attention_from_ldm());
}

std::string to_config_json(const UNetConfig& c) {
  json j{{"_class_name", "UNet2DConditionModel"},
         {"in_channels", c.in_channels},
         {"out_channels", c.out_channels},
         {"block_out_channels", c.block_out_channels},
         {"layers_per_block", c.layers_per_block},
         {"down_block_types", c.down_block_types},
         {"mid_block_type", c.mid_block_type},
         {"up_block_types", c.up_block_types},
         {"cross_attention_dim", c.cross_attention_dim},
         {"attention_head_dim", c.attention_head_dim},
         {"transformer_layers_per_block", c.transformer_layers_per_block},
         {"norm_num_groups", c.norm_num_groups},
         {"norm_eps", c.norm_eps},
         {"use_linear_projection", c.use_linear_projection},
         {"flip_sin_to_cos", c.flip_sin_to_cos},
         {"freq_shift", c.freq_shift},
         {"act_fn", "silu"}};
  if (c.sample_size > 0) j["sample_size"] = c.sample_size;
  // One number where every block has the same, as diffusers' own configs write it (its LoRA and
  // single-file converters read an int).
  if (std::all_of(c.layers_per_block.begin(), c.layers_per_block.end(),
                  [&](int64_t n) { return n == c.layers_per_block.front(); })) {
    j["layers_per_block"] = c.layers_per_block.front();
  }
  if (!c.addition_embed_type.empty()) {
    j["addition_embed_type"] = c.addition_embed_type;
    j["addition_time_embed_dim"] = c.addition_time_embed_dim;
    j["projection_class_embeddings_input_dim"] = c.projection_class_embeddings_input_dim;
  }
  return j.dump(2);
}

std::string to_config_json(const VaeConfig& c) {
  const size_t levels = c.block_out_channels.size();
  json j{{"_class_name", "AutoencoderKL"},
              {"in_channels", c.in_channels},
              {"out_channels", c.out_channels},
              {"block_out_channels", c.block_out_channels},
              {"layers_per_block", c.layers_per_block},
              {"latent_channels", c.latent_channels},
              {"norm_num_groups", c.norm_num_groups},
              {"scaling_factor", c.scaling_factor},
              {"mid_block_add_attention", c.mid_block_add_attention},
              {"down_block_types", std::vector<std::string>(levels, "DownEncoderBlock2D")},
              {"up_block_types", std::vector<std::string>(levels, "UpDecoderBlock2D")},
              {"act_fn", "silu"},
              {"use_quant_conv", c.use_quant_conv},
              {"use_post_quant_conv", c.use_post_quant_conv}};
  if (c.shift_factor != 0) j["shift_factor"] = c.shift_factor;
  return j.dump(2);
}

std::string to_config_json(const ClipTextConfig& c) {
  return json{{"architectures", {c.with_projection ? "CLIPTextModelWithProjection" : "CLIPTextModel"}},
              {"model_type", "clip_text_model"},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_hidden_layers},
              {"num_attention_heads", c.num_attention_heads},
              {"max_position_embeddings", c.max_position_embeddings},
              {"hidden_act", c.hidden_act},
              {"layer_norm_eps", c.layer_norm_eps},
              {"eos_token_id", c.eos_token_id},
              {"bos_token_id", 0},
              {"pad_token_id", 1},
              {"projection_dim", c.with_projection ? c.projection_dim : c.hidden_size}}
      .dump(2);
}

void save_single_file(const StableDiffusion& model, const fs::path& path, c10::ScalarType dtype) {
  std::vector<torch::Tensor> storage;
  std::vector<TensorToWrite> tensors;
  const UNetConfig& unet_config = model.unet->config();
  const VaeConfig& vae_config = model.vae->config();
  const KeyMap unet_map = sd15_unet_key_map(layout_of(unet_config));
  const KeyMap vae_map = sd15_vae_key_map(layout_of(vae_config));
  const KeyMap text_map = sd15_text_key_map();
  auto add = [&](const torch::nn::Module& module, const KeyMap& map) {
    for (const TensorToWrite& t : module_tensors(module, storage, "", dtype)) {
      const auto ldm = map.to_ldm(t.name);
      if (!ldm) throw Error("save_single_file: no ldm name for " + t.name);
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
  write_safetensors(path, tensors,
                    {{kUnetConfigKey, to_config_json(unet_config)},
                     {kVaeConfigKey, to_config_json(vae_config)},
                     {kTextConfigKey, to_config_json(model.text_encoder->config())},
                     {"lorapipe.family", model.family.name}});
}

void save_diffusers(const StableDiffusion& model, const fs::path& folder,
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
  json index{{"_class_name", "StableDiffusionPipeline"},
             {"unet", {"diffusers", "UNet2DConditionModel"}},
             {"vae", {"diffusers", "AutoencoderKL"}},
             {"text_encoder", {"transformers", "CLIPTextModel"}}};
  if (!tokenizer_folder.empty()) {
    fs::create_directories(folder / "tokenizer");
    for (const auto& entry : fs::directory_iterator(tokenizer_folder)) {
      fs::copy_file(entry.path(), folder / "tokenizer" / entry.path().filename(),
                    fs::copy_options::overwrite_existing);
    }
    index["tokenizer"] = {"transformers", "CLIPTokenizer"};
  }
  write_text(folder / "model_index.json", index.dump(2));
}

// ---- the DiffusionModel interface -------------------------------------------------------------

TokenBatch StableDiffusion::tokenize(const std::vector<std::string>& captions,
                                     int max_token_length, bool weighted) const {
  require_tokenizer();
  return kohya_token_batch({&*tokenizer}, captions, max_token_length, weighted);
}

void StableDiffusion::require_tokenizer() const {
  if (tokenizer) return;
  const std::string why = ClipTokenizer::builtin_vocabulary().empty()
                              ? "this build has no built-in CLIP vocabulary"
                              : "its text encoder is not CLIP's size, so the built-in CLIP "
                                "vocabulary does not fit";
  throw InputError(source_path + " has no tokenizer and " + why +
                   ": pass --tokenizer (a diffusers tokenizer/ folder, a merges.txt or "
                   "bpe_simple_vocab_16e6.txt.gz)");
}

Conditioning StableDiffusion::encode_prompts(const std::vector<std::string>& prompts,
                                             int clip_skip) {
  require_tokenizer();
  const int64_t chunk = family.text.max_length;  // 77
  const int64_t per_chunk = chunk - 2;            // 75 ids between BOS and EOS
  const size_t limit = 3 * per_chunk;
  const int64_t batch = static_cast<int64_t>(prompts.size());
  std::vector<std::vector<int32_t>> ids(prompts.size());
  std::vector<std::vector<float>> weights(prompts.size());
  int64_t longest = 0;
  bool weighted = false;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const WeightedText& piece : parse_prompt_attention(prompts[i])) {
      for (int32_t id : tokenizer->encode(piece.text)) {
        ids[i].push_back(id);
        weights[i].push_back(static_cast<float>(piece.weight));
      }
      if (ids[i].size() > limit) break;
    }
    if (ids[i].size() > limit) ids[i].resize(limit), weights[i].resize(limit);
    for (float w : weights[i]) weighted = weighted || w != 1.0f;
    longest = std::max(longest, static_cast<int64_t>(ids[i].size()));
  }
  const int64_t chunks = std::clamp<int64_t>((longest - 1) / per_chunk + 1, 1, 3);
  // Row i * chunks + c: BOS, ids 75c .. 75c + 74 (EOS past the end: SD1's pad), EOS.
  at::Tensor input = torch::full({batch * chunks, chunk}, tokenizer->eos(), torch::kInt64);
  at::Tensor token_weights = torch::ones({batch, chunks * chunk}, torch::kFloat32);
  auto in = input.accessor<int64_t, 2>();
  auto tw = token_weights.accessor<float, 2>();
  for (int64_t i = 0; i < batch; ++i) {
    for (int64_t c = 0; c < chunks; ++c) in[i * chunks + c][0] = tokenizer->bos();
    for (size_t k = 0; k < ids[i].size(); ++k) {
      const int64_t c = static_cast<int64_t>(k) / per_chunk, at = static_cast<int64_t>(k) % per_chunk;
      in[i * chunks + c][1 + at] = ids[i][k];
      tw[i][c * chunk + 1 + at] = weights[i][k];
    }
  }
  const at::Tensor weight = text_encoder->parameters().front();
  const ClipTextOutput out = text_encoder->forward(input.to(weight.device()));
  Conditioning c;
  c.pooled = out.pooled.view({batch, chunks, -1}).select(1, 0);
  at::Tensor states = text_encoder->conditioning(out, clip_skip).reshape({batch, chunks * chunk, -1});
  if (weighted) {  // all-1 weights would give back the very same states
    const auto dtype = states.scalar_type();
    const at::Tensor before = states.to(torch::kFloat32).mean({-2, -1}).to(dtype);
    states = states * token_weights.to(states.device(), dtype).unsqueeze(-1);
    const at::Tensor after = states.to(torch::kFloat32).mean({-2, -1}).to(dtype);
    states = states * (before / after).unsqueeze(-1).unsqueeze(-1);
  }
  c.hidden_states = states;
  return c;
}

Conditioning StableDiffusion::encode_text(const TokenBatch& tokens, int clip_skip) {
  TORCH_CHECK(tokens.ids.size() == 1, "SD1.x has one text encoder; got token ids for ",
              tokens.ids.size());
  const at::Tensor& input_ids = tokens.ids.front();
  Conditioning c;
  c.hidden_states = text_encoder->encode_chunked(
      input_ids.to(text_encoder->parameters().front().device()), clip_skip, &c.pooled);
  if (!tokens.weights.empty()) {
    c.hidden_states =
        weigh_chunked_states(c.hidden_states, tokens.weights.front(), family.text.max_length);
  }
  return c;
}

ImageLatents StableDiffusion::encode_images(const at::Tensor& images) {
  const at::Tensor weight = vae->parameters().front();  // a copy: the vector is a temporary
  const LatentDistribution dist = vae->encode(images.to(weight.device(), weight.scalar_type()));
  return {dist.mean, dist.std()};
}

at::Tensor StableDiffusion::decode_latents(const at::Tensor& latents) {
  const at::Tensor weight = vae->parameters().front();
  // diffusers: vae.decode(latents / scaling_factor + shift_factor).
  at::Tensor x = latents.to(weight.device(), weight.scalar_type()) / family.vae_scaling_factor;
  if (family.vae_shift_factor != 0) x = x + family.vae_shift_factor;
  return vae->decode(x);
}

std::string StableDiffusion::text_encoder_settings(int clip_skip, int max_token_length) const {
  return models::text_encoder_settings(
      clip_skip,
      builtin_tokenizer
          ? tokenizer_fingerprint(ClipTokenizer::kBuiltinName, ClipTokenizer::builtin_vocabulary())
          : tokenizer_fingerprint(tokenizer_path),
      max_token_length);
}

at::Tensor StableDiffusion::denoise(const DenoiseInput& input) {
  TORCH_CHECK(input.conditioning != nullptr, "denoise: no conditioning");
  if (!unet) throw Error(source_path + ": loaded without its U-Net (load_denoiser off)");
  // The compute dtype: a norm's, as norms never take float8 storage (models/float8.h). SD1.x
  // conditions on the text states alone: no pooled output, geometry or guidance.
  const at::Tensor& like = unet->conv_norm_out->weight;
  return unet->forward(input.latents.to(like.device(), like.scalar_type()), input.time,
                       input.conditioning->hidden_states.to(like.device(), like.scalar_type()));
}

std::vector<LoraTarget> StableDiffusion::lora_targets(bool with_text_encoder, bool conv_kxk) const {
  std::vector<LoraTarget> targets = unet_lora_targets(unet, conv_kxk);
  if (with_text_encoder && text_encoder) {  // a model loaded without one has none of its targets
    for (LoraTarget& t : text_encoder_lora_targets(text_encoder)) targets.push_back(std::move(t));
  }
  return targets;
}

DiffusionModel::BlockSwapReport StableDiffusion::enable_block_swap(int blocks, c10::Device device,
                                                                   int slots) {
  if (!unet) throw Error("block swap: the U-Net was released");
  std::vector<unet_blocks::Transformer2D> transformers = unet->transformers();
  const auto n = static_cast<size_t>(std::max(blocks, 0));
  if (blocks < 0 || n > transformers.size()) {
    throw InputError("--blocks_to_swap=" + std::to_string(blocks) + ": " + family.display_name +
                     " has " + std::to_string(transformers.size()) +
                     " of kohya's blocks with transformer blocks; it swaps the last N of them, "
                     "at most " +
                     std::to_string(transformers.size()));
  }
  std::vector<torch::nn::Module*> list;
  std::vector<size_t> swapped;
  for (size_t t = 0; t < transformers.size(); ++t) {
    transformers[t]->swap_first = list.size();
    for (auto& block : transformers[t]->blocks) {
      if (t + n >= transformers.size()) swapped.push_back(list.size());
      list.push_back(block.get());
    }
  }
  unet->block_swap = std::make_shared<BlockSwap>(list, swapped, make_swap_device(device), slots);
  for (auto& t : transformers) t->swap = unet->block_swap;
  BlockSwapReport report;
  report.blocks = "the transformer blocks of the last " + std::to_string(n) + " of " +
                  std::to_string(transformers.size()) + " kohya blocks with any (" +
                  std::to_string(swapped.size()) + " of " + std::to_string(list.size()) + ")";
  report.host_bytes = unet->block_swap->host_bytes();
  report.slot_bytes = unet->block_swap->slot_bytes();
  report.slots = unet->block_swap->slots();
  return report;
}

void StableDiffusion::set_gradient_checkpointing(bool enabled) {
  if (unet) unet->gradient_checkpointing = enabled;
  if (text_encoder) text_encoder->gradient_checkpointing = enabled;
}

std::vector<DiffusionModel::Component> StableDiffusion::components() {
  std::vector<Component> out;
  if (unet) out.push_back({Role::kDenoiser, "unet", "U-Net", unet.ptr().get()});
  if (text_encoder) {
    out.push_back({Role::kTextEncoder, "text_encoder", "text encoder", text_encoder.ptr().get()});
  }
  if (vae) out.push_back({Role::kVae, "vae", "VAE", vae.ptr().get()});
  return out;
}

void StableDiffusion::release(Role role) {
  switch (role) {
    case Role::kDenoiser: unet = nullptr; break;
    case Role::kTextEncoder: text_encoder = nullptr; break;
    case Role::kVae: vae = nullptr; break;
  }
}

torch::nn::Module& StableDiffusion::denoiser_module() {
  if (!unet) throw Error(source_path + ": loaded without its U-Net");
  return *unet;
}

torch::nn::Module& StableDiffusion::text_encoder_module() {
  if (!text_encoder) throw Error(source_path + ": its text encoder was released");
  return *text_encoder;
}

torch::nn::Module& StableDiffusion::vae_module() {
  if (!vae) throw Error(source_path + ": its VAE was released");
  return *vae;
}

}  // namespace lorapipe::models
