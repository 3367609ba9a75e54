#pragma once
// Tiny configurations of every SD1.5 module (the real architectures, a few MB in all) and a
// generator that writes a complete tiny checkpoint as a diffusers folder and as a single file in
// the original layout. Tests use them, and so does the embedded default run, which must work on
// a machine that can download no weights.

#include <cstdint>
#include <filesystem>

#include "models/clip_text.h"
#include "models/unet.h"
#include "models/vae.h"

namespace lorapipe::models {

UNetConfig tiny_unet_config();
VaeConfig tiny_vae_config();         // keeps SD's 8x downsampling (four levels)
ClipTextConfig tiny_text_config();   // vocabulary of the tiny tokenizer below

struct TinyCheckpoint {
  std::filesystem::path diffusers;    // folder: model_index.json, unet/, vae/, text_encoder/, tokenizer/
  std::filesystem::path single_file;  // tiny-sd15.safetensors, original (ldm) layout
  std::filesystem::path tokenizer;    // the tokenizer folder (vocab.json, merges.txt)
};

// Writes the tiny checkpoint under `dir` with weights drawn from `seed`. The tokenizer is CLIP's
// byte-level BPE with the 256 byte symbols and a few merges (no download needed).
// `unet_width` > 0 widens the U-Net's two levels to that width and twice it (512: about 260 M
// parameters, for tests of memory), keeping the VAE and text encoder the tiny one of `seed` has,
// so that latents and text cached with either model serve both.
TinyCheckpoint write_tiny_checkpoint(const std::filesystem::path& dir, uint64_t seed = 0,
                                     int unet_width = 0);

// Tiny SDXL (the real architectures at diffusers' SDXL test sizes): a U-Net with text_time added
// conditions (no attention in its first level, depth 1 and 2, linear projections, 8-wide time-id
// embeddings), SD's VAE layout at SDXL's scale, CLIP-L- and bigG-shaped encoders (gelu, projected)
// of width 32 each (cross-attention 64). diffusers' StableDiffusionXLPipeline loads the folder.
UNetConfig tiny_sdxl_unet_config();
ClipTextConfig tiny_sdxl_text_2_config();
TinyCheckpoint write_tiny_sdxl_checkpoint(const std::filesystem::path& dir, uint64_t seed = 0);

}  // namespace lorapipe::models
