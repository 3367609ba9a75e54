#include "models/registry.h"

#include "common/error.h"
#include "common/log.h"
#include "models/flux_model.h"
#include "models/pipeline.h"
#include "models/sdxl.h"

namespace lorapipe::models {

std::unique_ptr<DiffusionModel> load_model(const std::filesystem::path& path,
                                           const LoadOptions& options) {
  const FamilyDetection detected = detect_family(path, options.family);
  LP_LOG(kInfo, "models") << path.string() << ": " << model_family(detected.family).display_name
                          << " (told by " << detected.reason << ")";
  const ModelFamily& family = model_family(detected.family);
  if (family.objective == ObjectiveKind::kFlowMatching) {
    return std::make_unique<FluxModel>(load_flux(path, family, options));
  }
  if (const std::vector<std::string> given = options.parts.given(); !given.empty()) {
    std::string flags;
    for (const std::string& g : given) flags += (flags.empty() ? "" : ", ") + g;
    throw InputError(path.string() + " is " + family.display_name + ": " + flags +
                     (given.size() == 1 ? " is" : " are") + " FLUX.1's");
  }
  if (detected.family == "sd15") {
    return std::make_unique<StableDiffusion>(load_stable_diffusion(path, options));
  }
  if (detected.family == "sdxl") {
    return std::make_unique<StableDiffusionXL>(load_stable_diffusion_xl(path, options));
  }
  throw InputError(path.string() + ": no loader for family '" + detected.family + "'");
}

}  // namespace lorapipe::models
