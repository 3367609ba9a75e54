#pragma once
// One placement call for every stage and every family: the compute dtype, float8 storage per
// component (kohya's --fp8_base, --fp8_base_unet), the device, which components go there, and
// frozen base weights. The cacher, trainer and sampler build the model on the CPU (models/
// registry.h, load_model) and then place it with this; none of them moves a module itself.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "models/diffusion_model.h"

namespace lorapipe::models {

struct Placement {
  c10::Device device = c10::Device(c10::kCPU);
  // The compute dtype of the denoiser and the text encoders (--mixed_precision).
  c10::ScalarType dtype = c10::kFloat;
  // The VAE's dtype; unset: `dtype`, except that fp16 keeps the VAE as loaded (SD's VAE
  // overflows in fp16, kohya's --no_half_vae is what users set for it).
  std::optional<c10::ScalarType> vae_dtype;
  // Float8 e4m3 storage of the denoiser's and the text encoders' Linear and Conv2d weights
  // (models/float8.h): --fp8_base stores both, --fp8_base_unet the denoiser only.
  bool fp8_denoiser = false;
  bool fp8_text_encoders = false;
  // --fp8_scaled: those float8 weights with a scale per block of 64 inputs (models/float8.h).
  bool fp8_scaled = false;
  // --fp8_fast (with fp8_scaled and a float8 denoiser): the denoiser's Linear layers multiply in
  // float8 (models/float8.h). place() refuses it on a device without float8 matrix units.
  bool fp8_fast = false;
  // False keeps the text encoders on the CPU, as kohya does when their outputs come from the
  // cache and they are not trained: they are then used only to check cached text against.
  bool text_encoders_on_device = true;
  // Why, for the log, where text_encoders_on_device is false.
  std::string text_encoders_off_device_because =
      "its outputs come from the cache and it is not trained";
  // Base weights take no gradient (a LoRA trains through its own tensors).
  bool freeze = true;
  // Block swap (kohya's --blocks_to_swap, models/block_swap.h): the frozen weights of this many
  // of the denoiser's blocks (the family's reading of the count) in host memory (pinned for
  // CUDA), copied into a ring of `swap_slots` device slots one block ahead of compute. A family
  // without block swap refuses it (InputError).
  int blocks_to_swap = 0;
  int swap_slots = 2;
  // Set: called with the denoiser once its dtype and float8 are done, instead of moving it to
  // the device; true when it made the module's tensors another process's placed weights on the
  // device (models/shared_weights.h, the sampler beside a trainer), false to move it as usual.
  std::function<bool(torch::nn::Module& denoiser)> attach_denoiser;
};

struct PlacementReport {
  int64_t float8_tensors = 0;      // weights converted to float8
  int64_t float8_bytes_before = 0, float8_bytes_after = 0;
  int64_t float8_saturated = 0;    // of them, those with values beyond +-448 (clamped)
  int64_t swap_host_bytes = 0;     // block swap: the swapped weights, in host memory
  int64_t swap_slot_bytes = 0;     // and the device slots they travel through
};

// Converts and moves every component of `model` as `placement` says, in this order: dtype on the
// CPU, float8 on the CPU, then a device-only move (a dtype move would widen float8 weights
// again), so the device never holds a wider copy than the one it keeps. Logs what it did.
// Throws InputError for a placement that cannot be done (block swap for a family without it).
PlacementReport place(DiffusionModel& model, const Placement& placement);

// The dtype a stage computing in `dtype` runs its VAE in: fp32 with `no_half_vae` (kohya's
// --no_half_vae), and where fp16 is asked of a family whose VAE overflows in it
// (ModelFamily::vae_overflows_in_fp16: SDXL, FLUX.1) and the user gave no other VAE (`vae_given`: --vae,
// the fixed fp16 VAE, which is trusted); else `dtype`.
c10::ScalarType vae_compute_dtype(const ModelFamily& family, c10::ScalarType dtype,
                                  bool vae_given, bool no_half_vae);

// --mixed_precision / --save_precision / --dtype values: "no", "float", "fp32", "fp16", "bf16".
// Throws InputError naming `flag` and the value.
c10::ScalarType parse_precision(std::string_view name, std::string_view flag);

}  // namespace lorapipe::models
