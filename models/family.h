#pragma once
// A model family: what differs between Stable Diffusion 1.5, SDXL and Flux.1 that the rest of
// lorapipe must know, so a new family adds modules and key maps, not new pipeline code.

#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::models {

struct TextConditioning {
  std::string encoder;         // "clip-l" (SD1.5), later "clip-l+clip-g" (SDXL), "t5+clip-l"
  int max_length = 77;         // tokens per chunk, BOS and EOS included
  int hidden_size = 768;       // width of the conditioning sequence the UNet attends to
  bool uses_pooled = false;    // SDXL and Flux also condition on a pooled embedding
  int default_clip_skip = 1;
};

struct ModelFamily {
  std::string name;                 // "sd15"
  std::string display_name;         // "Stable Diffusion 1.5"
  int latent_channels = 4;
  double vae_scaling_factor = 0.18215;
  int vae_downsample = 8;           // pixels per latent along each side
  std::string prediction_type;      // "epsilon" or "v_prediction"
  int default_resolution = 512;
  TextConditioning text;
  // Components and where they live in the original single file (their key prefixes).
  std::vector<std::pair<std::string, std::string>> single_file_components;
};

// The families lorapipe knows. Throws lorapipe::InputError listing them for an unknown name.
const ModelFamily& model_family(std::string_view name);
std::vector<std::string> model_family_names();

}  // namespace lorapipe::models
