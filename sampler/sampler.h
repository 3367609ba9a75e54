#pragma once
// lorapipe-sampler, the stage: keeps the base model loaded and renders the prompt set for a LoRA
// (one shot) or for each checkpoint a training run announces (following its PUB socket), into
// OUT/samples/: one PNG per prompt (NAME_<step>_<idx>.png, prompt and settings in A1111's
// `parameters` text chunk), a contact sheet per checkpoint (NAME_<step>_sheet.png), and
// index.html, a gallery that picks up new images as they arrive.
//
// Following a run: SUB to the trainer's CheckpointReady. Before each render every queued event is
// read and only the newest kept, so a slow sampler skips stale checkpoints instead of queuing
// them; the run's final checkpoint is always rendered, and then the sampler exits. A checkpoint
// that cannot be rendered (a half-written or corrupt file, a LoRA for another model, the device
// out of memory) is reported and skipped; the sampler keeps serving and the trainer never waits.

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "models/model_parts.h"
#include "sampler/prompts.h"

namespace lorapipe::sampler {

struct SamplerOptions {
  std::filesystem::path model;
  std::string model_family;  // --model_family: load as this family (empty: detect it)
  std::filesystem::path tokenizer;
  std::filesystem::path vae;  // kohya's --vae: decode with another VAE than the checkpoint's
  models::ModelParts model_parts;  // FLUX.1's --clip_l, --t5xxl, --ae and T5 settings
  std::filesystem::path sample_prompts;
  std::filesystem::path output_dir;
  std::string device = "auto";
  // kohya renders its samples in the training precision: --mixed_precision (no, fp16, bf16) is
  // the dtype of the U-Net and text encoder here too, and of the VAE but under fp16, where it
  // stays fp32 (kohya's --no_half_vae advice). The models are loaded and converted on the CPU,
  // then moved, so the device never holds their fp32 weights.
  std::string mixed_precision = "no";
  // kohya's --fp8_base / --fp8_base_unet, as the trainer's: the U-Net's (and text encoder's)
  // Linear and Conv2d weights stored in float8, each checkpoint's LoRA then computed beside
  // them rather than merged (models/lora_merge.h).
  bool fp8_base = false;
  bool fp8_base_unet = false;
  bool fp8_scaled = false;  // --fp8_scaled: the float8 weights scaled per 64 inputs
  bool fp8_fast = false;    // --fp8_fast: the denoiser's Linear layers multiply in float8
  // How a checkpoint's LoRA is applied (models/lora_merge.h): false (the default) computes it
  // beside the frozen weights, in the layers' slots, with no copy of any weight; true merges it
  // into them and keeps a copy of each weight it changes to put back (renders compute no extra
  // matmuls: measured 1.27x faster on the CPU at rank 16, for 1.39x the peak memory).
  bool merge_lora = false;
  // kohya's --blocks_to_swap, as the trainer's (models/block_swap.h): the frozen weights of this
  // many of the denoiser's blocks stay in host memory and travel to the device one block ahead
  // of compute, and the text encoders stay in host memory too, encoding each prompt there (once
  // per prompt set, and per LoRA that changes them). Previews then fit the card the training
  // fitted with it; a swap keeps the images bit for bit. Not with --merge_lora or
  // --shared_weights.
  int blocks_to_swap = 0;
  // --map_weights: base weights the file holds in their dtype are its mapped pages, shared with
  // the trainer beside it (models/mapped_weights.h); lorapipe run sets it when they share the CPU.
  bool map_weights = false;
  // --shared_weights=MANIFEST: the denoiser is the trainer's, published with its --share_weights
  // on the same device (models/shared_weights.h); LoRAs are applied beside it, never merged.
  std::filesystem::path shared_weights;
  std::string sampler = "ddim";  // for prompts without --ss
  bool v_prediction = false;
  int clip_skip = 1;
  int64_t first_seed = 1234;
  // The trainer's --base_weights (file, multiplier): merged into the base for good at load, so
  // previews are of the model the run trains on.
  std::vector<std::pair<std::filesystem::path, double>> base_weights;
  // One shot: these LoRAs (file, multiplier), merged together.
  std::vector<std::pair<std::filesystem::path, double>> loras;
  // Following: the trainer's PUB endpoint; and our own PUB for SampleReady.
  std::string sub_endpoint;
  // Render every LoRA saved in this folder (and its sample_only/) in step order, then exit: a
  // run's previews after its training (the launcher's --sample_after_training).
  std::filesystem::path replay_dir;
  std::string pub_endpoint;
  // Following: give up after this long without any checkpoint (0: wait forever).
  double idle_timeout_s = 0;
  // Tests: sleep this long after each image (a slow sampler).
  double delay_per_image_s = 0;
  // --device_share: the share of the device's time renders take; -1: 0.1 when rendering over a
  // trainer's shared weights on CUDA (the trainer keeps 90% of the GPU's time slices), else 1.
  // The final checkpoint's render takes the whole device: the training is over.
  double device_share = -1;
  int threads = 0;  // CPU threads for compute (0: one per core)
};

struct SamplerSummary {
  int checkpoints_rendered = 0;
  int checkpoints_skipped = 0;     // could not be rendered (reported)
  int checkpoints_superseded = 0;  // a newer one came first
  int images = 0;
  int prompt_encodings = 0;  // text encoder runs: once per prompt, and again per LoRA that has
                             // text encoder modules
  std::vector<uint64_t> steps_rendered;
};

// Throws InputError for a bad model, prompt file or flag before anything is rendered.
SamplerSummary run_sampler(const SamplerOptions& options);

// What run_sampler checks before it loads the model (the flags, the device, the sampler's name,
// the prompt file), without loading it: `lorapipe run` asks this of the sampler before any stage
// starts, so a sampler that starts after hours of training does not refuse its flags then.
// Throws InputError naming the flag or file. Returns the prompts it read (`lorapipe plan` weighs
// the largest preview beside the training).
PromptSet check_sampler_options(const SamplerOptions& options);

}  // namespace lorapipe::sampler
