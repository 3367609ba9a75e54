#include "models/family.h"

#include "common/error.h"
#include "models/sd15_keys.h"

namespace lorapipe::models {
namespace {

ModelFamily make_sd15() {
  ModelFamily f;
  f.name = "sd15";
  f.display_name = "Stable Diffusion 1.5";
  f.latent_channels = 4;
  f.vae_scaling_factor = 0.18215;
  f.vae_downsample = 8;
  f.prediction_type = "epsilon";
  f.default_resolution = 512;
  f.text = {"clip-l", 77, 768, /*uses_pooled=*/false, /*default_clip_skip=*/1};
  f.single_file_components = {{"unet", std::string(kLdmUnetPrefix)},
                              {"vae", std::string(kLdmVaePrefix)},
                              {"text_encoder", std::string(kLdmTextPrefix)}};
  return f;
}

const std::vector<ModelFamily>& families() {
  static const std::vector<ModelFamily> all{make_sd15()};
  return all;
}

}  // namespace

const ModelFamily& model_family(std::string_view name) {
  for (const ModelFamily& f : families()) {
    if (f.name == name) return f;
  }
  std::string known;
  for (const ModelFamily& f : families()) known += (known.empty() ? "" : ", ") + f.name;
  throw InputError("unknown model family '" + std::string(name) + "' (known: " + known + ")");
}

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const ModelFamily& f : families()) names.push_back(f.name);
  return names;
}

}  // namespace lorapipe::models
