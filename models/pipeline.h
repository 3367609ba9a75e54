#pragma once
// Loading and saving a whole Stable Diffusion 1.x model: the UNet, the VAE, the CLIP text
// encoder and (when the checkpoint carries one) the tokenizer, from
//  - a single .safetensors file in the original (ldm) layout, mapped through sd15_keys; or
//  - a diffusers folder (unet/, vae/, text_encoder/, tokenizer/, each with its config).
// fp32, fp16 and bf16 files load, each component built in its storage dtype (LoadOptions) on the
// CPU; models::place (placement.h) then gives it its device. The stages reach it only through
// models::load_model (registry.h) and the DiffusionModel interface.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "models/clip_text.h"
#include "models/clip_tokenizer.h"
#include "models/diffusion_model.h"
#include "models/family.h"
#include "models/registry.h"
#include "models/unet.h"
#include "models/vae.h"

namespace lorapipe::models {

// A Stable Diffusion 1.x/2.x model as loaded, and the DiffusionModel the stages call on it.
struct StableDiffusion : DiffusionModel {
  ModelFamily family;
  UNet unet{nullptr};
  AutoencoderKL vae{nullptr};
  ClipTextModel text_encoder{nullptr};
  std::optional<ClipTokenizer> tokenizer;
  std::filesystem::path tokenizer_path;  // where the tokenizer came from
  bool builtin_tokenizer = false;        // CLIP's vocabulary built into lorapipe, no path
  std::string source_path;
  int skipped_keys = 0;  // known extras of a single file that were not loaded (EMA, schedule)

  const ModelFamily& model_family() const override { return family; }
  const std::string& source() const override { return source_path; }
  bool has_tokenizer() const override { return tokenizer.has_value(); }
  TokenBatch tokenize(const std::vector<std::string>& captions, int max_token_length = 75,
                      bool weighted = false) const override;
  Conditioning encode_text(const TokenBatch& tokens, int clip_skip) override;
  Conditioning encode_prompts(const std::vector<std::string>& prompts, int clip_skip) override;
  ImageLatents encode_images(const at::Tensor& images) override;
  at::Tensor decode_latents(const at::Tensor& latents) override;
  std::string text_encoder_settings(int clip_skip, int max_token_length = 75) const override;
  using DiffusionModel::denoise;
  at::Tensor denoise(const DenoiseInput& input) override;
  std::vector<LoraTarget> lora_targets(bool text_encoder, bool conv_kxk) const override;
  void set_gradient_checkpointing(bool enabled) override;
  // The U-Net families' reading of --blocks_to_swap N: the transformer blocks of the last N of
  // kohya's blocks that have any (each a Transformer2D: SD1.5's IN01-IN08, MID, OUT03-OUT11, 16
  // in all; SDXL's IN04-IN08, MID, OUT00-OUT05, 11), counted from the end as kohya counts FLUX.1's.
  // Their BasicTransformerBlocks' Linear weights swap; proj_in and proj_out stay.
  BlockSwapReport enable_block_swap(int blocks, c10::Device device, int slots) override;
  const BlockSwap* block_swap() const override { return unet ? unet->block_swap.get() : nullptr; }
  std::vector<Component> components() override;
  void release(Role role) override;
  torch::nn::Module& denoiser_module() override;
  torch::nn::Module& text_encoder_module() override;
  torch::nn::Module& vae_module() override;

 protected:
  void require_tokenizer() const;  // throws InputError asking for --tokenizer
};

// Throws lorapipe::InputError naming the file and listing missing or unexpected keys.
StableDiffusion load_stable_diffusion(const std::filesystem::path& path,
                                      const LoadOptions& options = {});

// Replaces the weights of `model`'s VAE with those of `path`, as kohya's --vae does: a VAE alone
// in the original layout ("encoder.*", "decoder.*", "quant_conv.*", as vae-ft-mse-840000 and
// most VAE downloads ship), a whole checkpoint in that layout (its first_stage_model.*), a
// diffusers VAE file (diffusion_pytorch_model.safetensors) or folder, or a diffusers model
// folder (its vae/). Every weight of the VAE must be found with its shape; a training run's
// discriminator ("loss.*") and EMA copies are skipped. Throws InputError naming the file.
void load_vae_override(StableDiffusion& model, const std::filesystem::path& path);

// Writes the models as one .safetensors in the original layout. The module configs travel in
// the file's metadata ("lorapipe.unet_config", ...) so non-standard sizes load back; files
// without them take the family's standard configs.
void save_single_file(const StableDiffusion& model, const std::filesystem::path& path,
                      c10::ScalarType dtype = c10::kFloat);

// Writes a diffusers folder (model_index.json, unet/, vae/, text_encoder/, and tokenizer/ when
// `tokenizer_folder` names one to copy) that diffusers and transformers load as written.
void save_diffusers(const StableDiffusion& model, const std::filesystem::path& folder,
                    const std::filesystem::path& tokenizer_folder = {});

// The configs as diffusers / transformers write them in config.json.
std::string to_config_json(const UNetConfig& config);
std::string to_config_json(const VaeConfig& config);
std::string to_config_json(const ClipTextConfig& config);

}  // namespace lorapipe::models
