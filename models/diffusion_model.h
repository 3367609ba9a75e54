#pragma once
// The one interface the stages call on a loaded model, whatever its family (stable-diffusion.cpp's
// DiffusionModel + Conditioner, in one): text into a conditioning, the denoiser's prediction, the
// layers a LoRA adapts with kohya's names for them, and the modules to move, freeze or
// fingerprint. SD1.x/2.x implement it in StableDiffusion (pipeline.h); SDXL and Flux arrive as
// new implementations, and the trainer does not change.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "models/family.h"
#include "models/sd15_lora.h"

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// The VAE's latent distribution of a batch of images (what the cache stores), in the VAE's dtype.
struct ImageLatents {
  at::Tensor mean;  // [B, latent_channels, H / f, W / f]
  at::Tensor std;
};

// What the denoiser is conditioned on: the token states it attends to and, for the families that
// use it (SDXL, Flux), a pooled text embedding.
struct Conditioning {
  at::Tensor hidden_states;  // [B, tokens, width]
  at::Tensor pooled;         // [B, width'], may be undefined where the family has none
};

class DiffusionModel {
 public:
  virtual ~DiffusionModel() = default;

  virtual const ModelFamily& model_family() const = 0;
  // False when no tokenizer was loaded (single files carry none): tokenize() would throw.
  virtual bool has_tokenizer() const = 0;
  // Token ids of each caption, padded to the family's length: [B, tokens] int64 on the CPU.
  // `max_token_length` is kohya's: 75 (one chunk, the default), 150 or 225 (kohya's chunked
  // long-prompt ids, [B, k * chunk]); 0 picks the smallest of those that holds the longest
  // caption (longer ones are cut at 225, as kohya cuts them). Throws InputError when the model
  // has no tokenizer.
  virtual at::Tensor tokenize(const std::vector<std::string>& captions,
                              int max_token_length = 75) const = 0;
  // The conditioning for token ids (one chunk, or kohya's long-prompt chunks), through any LoRA
  // in the text encoder's slots. `clip_skip` counts layers from the end, as kohya and A1111 do
  // (1: the last).
  virtual Conditioning encode_text(const at::Tensor& input_ids, int clip_skip) = 0;
  // kohya's --weighted_captions: tokenize()'s layout, each caption's A1111 attention syntax read
  // (models/prompt_attention.h) and its pieces tokenized on their own; `weights` receives each
  // id's weight, [B, tokens] fp32 (1 at BOS, EOS and padding). `max_token_length` 75, 150 or 225.
  virtual at::Tensor tokenize_weighted(const std::vector<std::string>& captions,
                                       int max_token_length, at::Tensor& weights) const = 0;
  // encode_text(), then every hidden state times its token's weight (`token_weights` from
  // tokenize_weighted), as kohya's encode_tokens_with_weights; unlike sample prompts
  // (encode_prompts), the states are not rescaled to their mean afterwards.
  virtual Conditioning encode_weighted_text(const at::Tensor& input_ids,
                                            const at::Tensor& token_weights, int clip_skip) = 0;
  // kohya's conditioning for sample images (library/lpw_stable_diffusion.py,
  // get_weighted_text_embeddings as train_util.sample_images calls it): each prompt's attention
  // syntax read (models/prompt_attention.h) and its pieces tokenized on their own, at most 225
  // tokens; every prompt at the chunk count of the longest (1 to 3 chunks of 75 ids), each chunk
  // encoded as BOS + 75 ids + EOS and kept whole, [B, 77 * chunks, width]; then every state
  // times its token's weight, and each prompt rescaled to the mean it had before weighting. For
  // prompts of at most 75 tokens without weights this is encode_text(tokenize(prompts)).
  virtual Conditioning encode_prompts(const std::vector<std::string>& prompts, int clip_skip) = 0;
  // A conditioning read from the cache (hidden states and pooled output as stored).
  virtual Conditioning cached_conditioning(const at::Tensor& hidden_states,
                                           const at::Tensor& pooled) const {
    return {hidden_states, pooled};
  }
  // The VAE's latent distribution of `images`, [B, 3, H, W] in [-1, 1] (any dtype and device;
  // moved to the VAE's).
  virtual ImageLatents encode_images(const at::Tensor& images) = 0;
  // Images [B, 3, H, W] in [-1, 1] (the VAE's dtype) from denoised latents (the family's
  // scaling undone first).
  virtual at::Tensor decode_latents(const at::Tensor& latents) = 0;
  // What, beside the text encoder's weights, decides its output for a caption (clip skip, the
  // tokenizer, kohya's max_token_length): the cache's text keys and the trainer's check of cached
  // text hash this.
  virtual std::string text_encoder_settings(int clip_skip, int max_token_length = 75) const = 0;
  // The denoiser's output (noise, or v for v-prediction models) for noised latents at integer
  // timesteps, in the denoiser's dtype.
  virtual at::Tensor denoise(const at::Tensor& noisy_latents, const at::Tensor& timesteps,
                             const Conditioning& conditioning) = 0;
  // The layers kohya's LoRA adapts: the denoiser's, and the text encoder's with `text_encoder`;
  // with `conv_kxk` also the kxk convolutions (LoCon).
  virtual std::vector<LoraTarget> lora_targets(bool text_encoder, bool conv_kxk) const = 0;
  // Recompute the denoiser's blocks in backward (see models/checkpoint.h).
  virtual void set_gradient_checkpointing(bool enabled) = 0;
  virtual torch::nn::Module& denoiser_module() = 0;
  virtual torch::nn::Module& text_encoder_module() = 0;
  virtual torch::nn::Module& vae_module() = 0;
};

}  // namespace lorapipe::models
