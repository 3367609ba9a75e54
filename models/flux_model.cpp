#include "models/flux_model.h"

#include <ATen/ATen.h>

#include "common/error.h"
#include "models/fingerprint.h"
#include "models/flux_lora.h"
#include "models/loading.h"
#include "models/safetensors.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {
namespace fs = std::filesystem;

ModelFamily flux_model_family(bool dev) {
  ModelFamily f;
  f.name = dev ? "flux-dev" : "flux-schnell";
  f.display_name = dev ? "FLUX.1 [dev]" : "FLUX.1 [schnell]";
  f.latent_channels = 16;
  f.vae_scaling_factor = 0.3611;  // the AE's (diffusers' vae/config.json)
  f.vae_shift_factor = 0.1159;
  f.vae_downsample = 8;
  f.prediction_type = "flow";
  f.default_resolution = 1024;
  f.bucket_reso_multiple = 32;  // kohya's flux_train_network: bucket_reso_steps % 32 == 0
  f.text = {"t5+clip-l", dev ? 512 : 256, 4096, /*uses_pooled=*/true, /*default_clip_skip=*/1};
  f.objective = ObjectiveKind::kFlowMatching;
  // FLUX.1's scheduler_config.json: dev shifts by resolution, schnell not at all.
  f.flow.dynamic_shifting = dev;
  f.flow.shift = dev ? 3.0 : 1.0;
  f.kohya.network_module = "networks.lora_flux";
  f.kohya.base_model_version = "flux1";
  f.kohya.modelspec_architecture = dev ? "flux-1-dev" : "flux-1-schnell";
  f.kohya.modelspec_implementation = "https://github.com/black-forest-labs/flux";
  return f;
}

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
  Conditioning c;
  const at::Tensor clip_weight = clip->parameters().front();
  c.pooled = clip->forward(tokens.ids[0].to(clip_weight.device())).pooled;
  const at::Tensor& t5_ids = tokens.ids[1];
  // 1 up to and including </s>: T5's padding id is 0 and no caption token is.
  c.mask = (t5_ids != (t5_tokenizer ? t5_tokenizer->pad_id() : 0)).to(at::kLong);
  c.hidden_states = t5(t5_ids, apply_t5_attn_mask ? c.mask : at::Tensor());
  return c;
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
  return "flux clip-l pooled + t5 max_length=" + std::to_string(t5_max_length) +
         " t5_attn_mask=" + (apply_t5_attn_mask ? "1" : "0");
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
  std::vector<LoraTarget> targets = flux_lora_targets(transformer);
  if (text_encoder && clip) {
    for (LoraTarget& t : text_encoder_lora_targets(clip, "lora_te1", 0)) {
      targets.push_back(std::move(t));
    }
  }
  return targets;
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

FluxModel load_flux_diffusers_folder(const fs::path& folder, const LoadOptions& options) {
  for (const char* part : {"transformer", "text_encoder", "text_encoder_2", "vae"}) {
    if (!fs::is_directory(folder / part)) {
      throw InputError(folder.string() + ": not a Flux.1 diffusers folder: no " + part + "/");
    }
  }
  FluxModel m;
  m.source_path = folder.string();
  const c10::ScalarType dtype = storage_dtype(options.dtype, "dtype");
  const c10::ScalarType text_dtype =
      storage_dtype(options.text_encoder_dtype.value_or(dtype), "text_encoder_dtype");
  const c10::ScalarType vae_dtype = storage_dtype(options.vae_dtype.value_or(dtype), "vae_dtype");
  auto config_of = [&](const char* part) {
    return std::make_pair(read_text(folder / part / "config.json"),
                          (folder / part / "config.json").string());
  };

  const auto [transformer_json, transformer_source] = config_of("transformer");
  const FluxConfig config = FluxConfig::from_diffusers_json(transformer_json, transformer_source);
  m.family = flux_model_family(config.guidance_embed);
  m.t5_max_length = m.family.text.max_length;
  if (options.load_denoiser) {
    at::NoGradGuard no_grad;
    m.transformer = FluxTransformer(config, at::TensorOptions().dtype(dtype));
    load_flux_diffusers(*m.transformer, folder / "transformer");
    m.transformer->eval();
  }

  const auto [clip_json, clip_source] = config_of("text_encoder");
  const ClipTextConfig clip_config = ClipTextConfig::from_json(clip_json, clip_source);
  m.clip = build_in(text_dtype, [&] { return ClipTextModel(clip_config); });
  load_clip_text(m.clip, folder / "text_encoder");
  const auto [t5_json, t5_source] = config_of("text_encoder_2");
  {
    at::NoGradGuard no_grad;
    m.t5 =
        T5Encoder(T5Config::from_json(t5_json, t5_source), at::TensorOptions().dtype(text_dtype));
  }
  const fs::path t5_file = folder / "text_encoder_2" / "model.safetensors";
  if (!fs::exists(t5_file)) {
    throw InputError(folder.string() + ": no text_encoder_2/model.safetensors (T5's weights)");
  }
  load_t5_encoder(*m.t5, SafetensorsFile::open(t5_file));
  m.t5->eval();
  m.text_encoders = std::make_shared<torch::nn::Module>();
  m.text_encoders->register_module("text_encoder", m.clip.ptr());
  m.text_encoders->register_module("text_encoder_2", m.t5.ptr());

  const auto [vae_json, vae_source] = config_of("vae");
  const VaeConfig vae_config = VaeConfig::from_json(vae_json, vae_source);
  m.vae = build_in(vae_dtype, [&] { return AutoencoderKL(vae_config); });
  load_vae(m.vae, folder / "vae");

  bool builtin = false;
  m.clip_tokenizer =
      clip_tokenizer_for(!options.tokenizer.empty()               ? options.tokenizer
                         : fs::is_directory(folder / "tokenizer") ? folder / "tokenizer"
                                                                  : fs::path(),
                         clip_config.vocab_size, m.source_path, &builtin);
  if (fs::exists(folder / "tokenizer_2" / "spiece.model")) {
    m.t5_tokenizer = T5Tokenizer::from_file(folder / "tokenizer_2" / "spiece.model");
  }
  return m;
}

}  // namespace lorapipe::models
