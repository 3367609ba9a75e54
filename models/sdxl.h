#pragma once
// Stable Diffusion XL through the model seam (models/diffusion_model.h): the SDXL U-Net
// (UNetConfig::sdxl: text_time added conditions), SD's VAE at scale 0.13025, and two text
// encoders, CLIP ViT-L and OpenCLIP ViT-bigG (CLIPTextModelWithProjection), loaded from
//  - a single .safetensors file as users have it: model.diffusion_model.* and first_stage_model.*
//    in the ldm layout (models/sd15_keys.h), CLIP-L under conditioner.embedders.0.transformer.*
//    and bigG in OpenCLIP's own layout under conditioner.embedders.1.model.*
//    (models/open_clip_keys.h); or
//  - a diffusers folder (unet/, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/).
//
// What SDXL conditions on, as kohya (sdxl_train_util, get_hidden_states_sdxl) and diffusers
// (StableDiffusionXLPipeline.encode_prompt) build it: each encoder's penultimate layer output
// without its final layer norm, joined along the width (768 + 1280 = 2048); the pooled
// embedding is bigG's text_projection of its final-norm state at the first end-of-text token;
// and six time ids per sample: original height and width, crop top and left, target height and
// width (DenoiseInput::geometry; without geometry, the latents' own size and no crop, as kohya and
// diffusers sample). The second tokenizer pads with id 0 ("!"), the first with its EOS; kohya's
// long prompts chunk each as models/long_prompt.h lays it out. kohya's SDXL has no clip skip: a
// --clip_skip other than 1 is ignored with a warning, as kohya ignores it.
//
// The VAE: SDXL's overflows in fp16 (activations past 65504 in the decoder's mid block); the
// stages keep it in fp32 unless told otherwise (kohya's --no_half_vae), or take the fixed fp16
// VAE by --vae.

#include <c10/core/ScalarType.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "models/pipeline.h"

namespace lorapipe::models {

struct StableDiffusionXL : StableDiffusion {
  ClipTextModel text_encoder_2{nullptr};  // OpenCLIP ViT-bigG, with text_projection
  // Holds both text encoders as "text_encoder" and "text_encoder_2", so that the stages'
  // one text-encoder module (fingerprints, dtype moves) covers both.
  std::shared_ptr<torch::nn::Module> text_encoders;
  // The second encoder's tokenizer: the first's vocabulary, padding with tokenizer_2's pad token
  // ("!", id 0, as SDXL's tokenizer_2/special_tokens_map.json sets it).
  std::optional<ClipTokenizer> tokenizer_2;
  std::string pad_token_2 = "!";

  TokenBatch tokenize(const std::vector<std::string>& captions, int max_token_length = 75,
                      bool weighted = false) const override;
  Conditioning encode_text(const TokenBatch& tokens, int clip_skip) override;
  Conditioning encode_prompts(const std::vector<std::string>& prompts, int clip_skip) override;
  std::string text_encoder_settings(int clip_skip, int max_token_length = 75) const override;
  using DiffusionModel::denoise;
  at::Tensor denoise(const DenoiseInput& input) override;
  std::vector<LoraTarget> lora_targets(bool text_encoder, bool conv_kxk) const override;
  void set_gradient_checkpointing(bool enabled) override;
  std::vector<Component> components() override;
  void release(Role role) override;
  torch::nn::Module& text_encoder_module() override;

  // The six time ids of each sample, [B, 6] fp32: diffusers' add_time_ids (original_size +
  // crops_coords_top_left + target_size, each (height, width) / (top, left)). Empty `geometry`:
  // every sample at `latents`' size in pixels, no crop.
  at::Tensor time_ids(const std::vector<SampleGeometry>& geometry, const at::Tensor& latents) const;

 private:
  void warn_clip_skip(int clip_skip);
  bool warned_clip_skip_ = false;
};

// Throws lorapipe::InputError naming the file and listing missing or unexpected keys.
StableDiffusionXL load_stable_diffusion_xl(const std::filesystem::path& path,
                                           const LoadOptions& options = {});

// Writes the model as one .safetensors in the single-file layout users have (bigG in OpenCLIP's
// layout: fused in_proj, text_projection stored transposed), the module configs in its
// metadata as save_single_file does.
void save_sdxl_single_file(const StableDiffusionXL& model, const std::filesystem::path& path,
                           c10::ScalarType dtype = c10::kFloat);

// Writes a diffusers folder that diffusers' StableDiffusionXLPipeline loads as written
// (tokenizer/ and tokenizer_2/ copied from `tokenizer_folder` when given; tokenizer_2 pads "!").
void save_sdxl_diffusers(const StableDiffusionXL& model, const std::filesystem::path& folder,
                         const std::filesystem::path& tokenizer_folder = {});

}  // namespace lorapipe::models
