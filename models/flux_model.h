#pragma once
// Flux.1 (dev and schnell) through the model seam (models/diffusion_model.h), as diffusers'
// FluxPipeline and kohya's flux_train_network build its pieces:
//  - the conditioning: CLIP-L's pooled output (its final-norm end-of-text state) and T5's last
//    hidden state over the caption padded to t5_max_length (512 for dev, 256 for schnell, kohya's
//    --t5xxl_max_token_length), with the T5 attention mask (1 up to and including </s>), which
//    T5 and the transformer apply only with apply_t5_attn_mask (kohya's --apply_t5_attn_mask);
//  - the denoiser: the latents packed 2x2 into tokens with their image ids, text ids zero, the
//    model time the flow's sigma in [0, 1], dev's distilled guidance (DenoiseInput::guidance,
//    kohya's --guidance_scale default 3.5), unpacked again;
//  - the AE: 16 channels, (latents - 0.1159) * 0.3611 for the denoiser.
//
// models::load_model (models/registry.h) loads it through load_flux below.

#include <c10/core/ScalarType.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "models/clip_text.h"
#include "models/clip_tokenizer.h"
#include "models/diffusion_model.h"
#include "models/flux.h"
#include "models/registry.h"
#include "models/t5.h"
#include "models/t5_tokenizer.h"
#include "models/vae.h"

namespace lorapipe::models {

// The Flux.1 families' rules (dev: guidance embedding, T5 at 512 tokens; schnell: neither):
// model_family("flux-dev") or ("flux-schnell").
ModelFamily flux_model_family(bool dev);

struct FluxModel : DiffusionModel {
  ModelFamily family;
  std::string source_path;
  FluxTransformer transformer{nullptr};
  ClipTextModel clip{nullptr};  // CLIP-L: the pooled output
  T5Encoder t5{nullptr};        // T5 v1.1 XXL: the token states
  AutoencoderKL vae{nullptr};
  std::optional<ClipTokenizer> clip_tokenizer;
  std::optional<T5Tokenizer> t5_tokenizer;
  std::string tokenizer_print;  // both tokenizers' fingerprints, part of the text cache's key
  // Both text encoders as "text_encoder" (CLIP-L) and "text_encoder_2" (T5), the stages' one
  // text-encoder module.
  std::shared_ptr<torch::nn::Module> text_encoders;
  int t5_max_length = 512;
  bool apply_t5_attn_mask = false;
  double default_guidance = 3.5;  // kohya's --guidance_scale default

  const ModelFamily& model_family() const override { return family; }
  const std::string& source() const override { return source_path; }
  bool has_tokenizer() const override { return clip_tokenizer && t5_tokenizer; }
  // With the mask, the transformer never attends to T5's padding: the cache keeps only the
  // states up to </s>.
  bool padding_is_masked() const override { return apply_t5_attn_mask; }
  // ids[0]: CLIP-L's [B, 77]; ids[1]: T5's [B, t5_max_length]. Flux has no long-prompt chunking
  // or weighted captions (kohya's Flux has neither); `max_token_length` is ignored.
  TokenBatch tokenize(const std::vector<std::string>& captions, int max_token_length = 75,
                      bool weighted = false) const override;
  Conditioning encode_text(const TokenBatch& tokens, int clip_skip) override;
  Conditioning encode_prompts(const std::vector<std::string>& prompts, int clip_skip) override;
  // CLIP-L's pooled output from tokens.ids[0] over `cached`'s T5 states and mask (kohya's
  // partial caching: its networks.lora_flux never trains T5).
  Conditioning encode_trained_text(const TokenBatch& tokens, int clip_skip,
                                   const Conditioning& cached) override;
  // T5 goes; text_encoder_module() then holds CLIP-L alone (as "text_encoder").
  void release_untrained_text_encoders() override;
  ImageLatents encode_images(const at::Tensor& images) override;
  at::Tensor decode_latents(const at::Tensor& latents) override;
  std::string text_encoder_settings(int clip_skip, int max_token_length = 75) const override;
  using DiffusionModel::denoise;
  at::Tensor denoise(const DenoiseInput& input) override;
  std::vector<LoraTarget> lora_targets(bool text_encoder, bool conv_kxk) const override;
  void set_gradient_checkpointing(bool enabled) override;
  void set_cpu_offload_checkpointing(bool enabled) override;
  // kohya's split: n / 2 double blocks and (n - n / 2) * 2 single blocks, the last of each list.
  BlockSwapReport enable_block_swap(int blocks, c10::Device device, int slots) override;
  const BlockSwap* block_swap() const override { return transformer ? transformer->block_swap.get() : nullptr; }
  std::vector<Component> components() override;
  void release(Role role) override;
  torch::nn::Module& denoiser_module() override;
  torch::nn::Module& text_encoder_module() override;
  torch::nn::Module& vae_module() override;
};

// FLUX.1 as users hold it, loaded as `family` (flux-dev or flux-schnell): a diffusers folder
// (transformer/, text_encoder/, text_encoder_2/, vae/, tokenizer/, tokenizer_2/spiece.model), or
// a single-file transformer (Black Forest Labs' names, with or without model.diffusion_model.)
// with kohya's separate parts: options.clip_l, t5xxl and ae (each may also replace a folder's
// own), or ComfyUI's all-in-one file (every part under its prefix: model.diffusion_model.,
// text_encoders.clip_l.transformer., text_encoders.t5xxl.transformer., vae.; a flag still
// replaces a part), and T5's spiece.model as options.t5_tokenizer. Throws InputError naming the file or
// folder and the part that is missing or malformed, or the flag that would give it.
FluxModel load_flux(const std::filesystem::path& path, const ModelFamily& family,
                    const LoadOptions& options);
// load_flux for a diffusers folder, its family detected.
FluxModel load_flux_diffusers_folder(const std::filesystem::path& folder,
                                     const LoadOptions& options = {});

}  // namespace lorapipe::models
