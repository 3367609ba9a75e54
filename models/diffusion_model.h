#pragma once
// The one interface the stages call on a loaded model, whatever its family (stable-diffusion.cpp's
// Conditioner + DiffusionModel, in one): prompts into a conditioning, the denoiser's prediction,
// the latent scale, the layers a LoRA adapts with kohya's names for them, and the components to
// place, freeze or fingerprint. The cacher, trainer and sampler hold a
// std::unique_ptr<DiffusionModel> from models::load_model (models/registry.h) and never ask which
// family it is: SD1.x implements it in StableDiffusion (pipeline.h); SDXL and Flux arrive as new
// implementations with their own modules, key maps and rules.
//
// The family's training objective and sampling schedules come from its ModelFamily
// (model_family()): the DDPM schedule of models/ddpm.h for the DDPM families.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "models/family.h"
#include "models/lora_target.h"

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

class BlockSwap;

// The VAE's latent distribution of a batch of images (what the cache stores), in the VAE's dtype.
struct ImageLatents {
  at::Tensor mean;  // [B, latent_channels, H / f, W / f]
  at::Tensor std;
};

// Token ids for each of the family's text encoders (SD1.x: one, CLIP-L; SDXL: two tokenizers
// that pad differently; Flux: CLIP-L and T5), each [B, tokens] int64 on the CPU. With kohya's
// --weighted_captions, `weights` holds each id's weight per encoder, [B, tokens] fp32 (1 at BOS,
// EOS and padding); otherwise it is empty.
struct TokenBatch {
  std::vector<at::Tensor> ids;
  std::vector<at::Tensor> weights;

  bool empty() const { return ids.empty(); }
  int64_t batch() const { return ids.empty() ? 0 : ids.front().size(0); }
};

// What the denoiser is conditioned on. Families fill what they use; the rest stays undefined.
struct Conditioning {
  at::Tensor hidden_states;  // [B, tokens, width]: the token states the denoiser attends to
  at::Tensor pooled;         // [B, width']: a pooled text embedding (SDXL, Flux)
  at::Tensor mask;           // [B, tokens]: 1 where a token is attended, 0 for padding (T5)
  at::Tensor added;          // [B, n]: the family's added conditions (SDXL's six time ids)
};

// Where a sample came from, for the families that condition on it (SDXL's time ids: original
// size, crop top-left, target size), in pixels. The cache stores each sample's.
struct SampleGeometry {
  int64_t original_height = 0, original_width = 0;
  int64_t crop_top = 0, crop_left = 0;
  int64_t target_height = 0, target_width = 0;
};

// One call of the denoiser.
struct DenoiseInput {
  at::Tensor latents;  // noisy latents as the VAE lays them out, [B, C, h, w]: any packing
                       // (Flux's 2x2 patches) is the family's business, inside denoise()
  // The model time: int64 DDPM timesteps, or fp32 (the K-samplers' fractional timesteps; the
  // continuous times of flow matching), [B] or a 0-dim scalar for the whole batch.
  at::Tensor time;
  const Conditioning* conditioning = nullptr;
  std::vector<SampleGeometry> geometry;  // per sample; empty: the latents' own size, no crop
  std::optional<double> guidance;        // distilled guidance (Flux dev); unused by SD
};

class DiffusionModel {
 public:
  virtual ~DiffusionModel() = default;

  virtual const ModelFamily& model_family() const = 0;
  // Where the model was loaded from (a file or a folder), for messages.
  virtual const std::string& source() const = 0;
  // False when no tokenizer was loaded (single files carry none): tokenize() would throw.
  virtual bool has_tokenizer() const = 0;
  // Token ids of each caption for every text encoder. `max_token_length` is kohya's: 75 (one
  // chunk, the default), 150 or 225 (kohya's chunked long-prompt ids, [B, k * chunk]); 0 picks
  // the smallest of those that holds the longest caption (longer ones are cut at 225, as kohya
  // cuts them). With `weighted` (kohya's --weighted_captions) each caption's A1111 attention
  // syntax is read (models/prompt_attention.h), its pieces tokenized on their own, and the
  // weights filled. Throws InputError when the model has no tokenizer.
  virtual TokenBatch tokenize(const std::vector<std::string>& captions, int max_token_length = 75,
                              bool weighted = false) const = 0;
  // The conditioning for token ids (one chunk, or kohya's long-prompt chunks), through any LoRA
  // in the text encoders' slots. `clip_skip` counts layers from the end, as kohya and A1111 do
  // (1: the last). With weights, every hidden state is multiplied by its token's weight, as
  // kohya's encode_tokens_with_weights (unlike sample prompts, encode_prompts, the states are
  // not rescaled to their mean afterwards).
  virtual Conditioning encode_text(const TokenBatch& tokens, int clip_skip) = 0;
  // kohya's conditioning for sample images (library/lpw_stable_diffusion.py,
  // get_weighted_text_embeddings as train_util.sample_images calls it): each prompt's attention
  // syntax read and its pieces tokenized on their own, at most 225 tokens; every prompt at the
  // chunk count of the longest, each chunk encoded whole; then every state times its token's
  // weight, and each prompt rescaled to the mean it had before weighting. For short prompts
  // without weights this is encode_text(tokenize(prompts)).
  virtual Conditioning encode_prompts(const std::vector<std::string>& prompts, int clip_skip) = 0;
  // True when the denoiser never attends to the hidden states where the conditioning's mask is 0
  // (FLUX.1 with kohya's --apply_t5_attn_mask): those states need not be stored, and a cached
  // conditioning may hold only the masked-in ones, zeros standing in for the rest.
  virtual bool padding_is_masked() const { return false; }
  // A conditioning read from the cache (the states, pooled output and mask as stored).
  virtual Conditioning cached_conditioning(const at::Tensor& hidden_states,
                                           const at::Tensor& pooled,
                                           const at::Tensor& mask = {}) const {
    return {hidden_states, pooled, mask, {}};
  }
  // kohya's partial text caching (ModelFamily::text.untrained_encoders): `cached`, a conditioning
  // read from the cache, with the parts the encoders a text-encoder LoRA adapts give encoded anew
  // from `tokens`, through their LoRA (FLUX.1: CLIP-L's pooled output beside T5's cached states).
  // The default throws Error: the family's text-encoder LoRA adapts every encoder it has.
  virtual Conditioning encode_trained_text(const TokenBatch& tokens, int clip_skip,
                                           const Conditioning& cached);
  // With partial caching: drops the encoders no text-encoder LoRA adapts (FLUX.1's T5, 4.8 B
  // parameters), their output coming from the cache; text_encoder_module() holds the others. The
  // default throws Error, as encode_trained_text.
  virtual void release_untrained_text_encoders();
  // The VAE's latent distribution of `images`, [B, 3, H, W] in [-1, 1] (any dtype and device;
  // moved to the VAE's).
  virtual ImageLatents encode_images(const at::Tensor& images) = 0;
  // The denoiser's latents from the VAE's: (latents - shift) * scale, the family's factors.
  at::Tensor model_latents(const at::Tensor& vae_latents) const {
    const ModelFamily& f = model_family();
    return f.vae_shift_factor == 0 ? vae_latents * f.vae_scaling_factor
                                   : (vae_latents - f.vae_shift_factor) * f.vae_scaling_factor;
  }
  // Images [B, 3, H, W] in [-1, 1] (the VAE's dtype) from the denoiser's latents (the family's
  // scale and shift undone first).
  virtual at::Tensor decode_latents(const at::Tensor& latents) = 0;
  // What, beside the text encoders' weights, decides their output for a caption (clip skip, the
  // tokenizers, kohya's max_token_length): the cache's text keys and the trainer's check of
  // cached text hash this.
  virtual std::string text_encoder_settings(int clip_skip, int max_token_length = 75) const = 0;
  // The denoiser's output (the family's parametrisation: noise, v, or a flow's velocity) for one
  // call, in the denoiser's dtype.
  virtual at::Tensor denoise(const DenoiseInput& input) = 0;
  // The same, for the common call: latents at a model time under a conditioning.
  at::Tensor denoise(const at::Tensor& noisy_latents, const at::Tensor& time,
                     const Conditioning& conditioning) {
    DenoiseInput input;
    input.latents = noisy_latents;
    input.time = time;
    input.conditioning = &conditioning;
    return denoise(input);
  }
  // The layers kohya's LoRA adapts: the denoiser's, and the text encoders' with `text_encoder`;
  // with `conv_kxk` also the kxk convolutions (LoCon).
  virtual std::vector<LoraTarget> lora_targets(bool text_encoder, bool conv_kxk) const = 0;
  // Recompute the denoiser's blocks in backward (see models/checkpoint.h).
  virtual void set_gradient_checkpointing(bool enabled) = 0;
  // kohya's --cpu_offload_checkpointing: the checkpointed blocks' inputs wait for backward in
  // host memory. The default refuses it (InputError naming the family), as kohya offers it for
  // its transformers (FLUX.1, SD3) alone.
  virtual void set_cpu_offload_checkpointing(bool enabled);
  // Block swap (kohya's --blocks_to_swap, models/block_swap.h): the frozen weights of `blocks` of
  // the denoiser's blocks (the family says which) go to host memory now, to travel to `device`
  // through a ring of `slots` slots. Called on the CPU, before the denoiser moves to `device`
  // (models/placement.h does). Returns what it set up, for the log. The default: InputError
  // naming the family, which has no block swap yet.
  struct BlockSwapReport {
    std::string blocks;  // "the last 8 of 19 double blocks and 16 of 38 single blocks"
    int64_t host_bytes = 0, slot_bytes = 0;
    int slots = 0;
  };
  virtual BlockSwapReport enable_block_swap(int blocks, c10::Device device, int slots);
  // The denoiser's block swap once enabled, else null: its host copies are the only copies of
  // the swapped weights (a look at the denoiser's own tensors sees them empty).
  virtual const BlockSwap* block_swap() const { return nullptr; }

  // The model's parts, for placement (models/placement.h), freezing and fingerprints. A part
  // that was not loaded or was released is absent.
  enum class Role { kDenoiser, kTextEncoder, kVae };
  struct Component {
    Role role;
    std::string name;   // "unet", "text_encoder", "vae" (the diffusers folder's names)
    std::string label;  // for people: "U-Net", "text encoder", "VAE"
    torch::nn::Module* module;
  };
  virtual std::vector<Component> components() = 0;
  // Drops a part the stage no longer needs (the trainer's VAE once the latents are cached):
  // its memory goes back, and components() no longer lists it.
  virtual void release(Role role) = 0;
  virtual torch::nn::Module& denoiser_module() = 0;
  // Throws Error when the model has no such part (not loaded, or released).
  virtual torch::nn::Module& text_encoder_module() = 0;
  virtual torch::nn::Module& vae_module() = 0;
};

}  // namespace lorapipe::models
