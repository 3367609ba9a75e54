#include "models/objective.h"

#include <initializer_list>
#include <string>
#include <utility>

#include "common/error.h"
#include "models/ddpm.h"
#include "models/flow_matching.h"

namespace lorapipe::models {

void check_objective_options(const ObjectiveOptions& o) {
  if (o.min_snr_gamma < 0) throw InputError("--min_snr_gamma must not be negative");
  if (o.v_pred_like_loss < 0) throw InputError("--v_pred_like_loss must not be negative");
  // kohya's bounds: min == max trains at that one timestep (get_timesteps' torch.full), which
  // must be one of the schedule's 1000.
  if (o.min_timestep < 0 || o.max_timestep > 1000 || o.min_timestep > o.max_timestep ||
      o.min_timestep >= 1000) {
    throw InputError("--min_timestep/--max_timestep: need 0 <= min <= max <= 1000 and min < "
                     "1000, got " + std::to_string(o.min_timestep) + " and " +
                     std::to_string(o.max_timestep));
  }
  if (o.huber_schedule != "constant" && o.huber_schedule != "exponential" &&
      o.huber_schedule != "snr") {
    throw InputError("--huber_schedule='" + o.huber_schedule +
                     "': use constant, exponential or snr");
  }
  auto one_of = [](const std::string& flag, const std::string& value,
                   std::initializer_list<const char*> names) {
    std::string list;
    for (const char* n : names) {
      if (value == n) return;
      list += (list.empty() ? "" : ", ") + std::string(n);
    }
    throw InputError(flag + "='" + value + "': use one of " + list);
  };
  one_of("--timestep_sampling", o.timestep_sampling,
         {"sigma", "uniform", "sigmoid", "shift", "flux_shift"});
  one_of("--weighting_scheme", o.weighting_scheme,
         {"uniform", "none", "sigma_sqrt", "logit_normal", "mode", "cosmap"});
  one_of("--model_prediction_type", o.model_prediction_type, {"raw", "additive", "sigma_scaled"});
  if (!(o.discrete_flow_shift > 0)) throw InputError("--discrete_flow_shift must be positive");
  if (!(o.sigmoid_scale > 0)) throw InputError("--sigmoid_scale must be positive");
  if (!(o.logit_std > 0)) throw InputError("--logit_std must be positive");
  if (!(o.guidance_scale >= 0)) throw InputError("--guidance_scale must not be negative");
}

std::unique_ptr<TrainingObjective> make_training_objective(const ModelFamily& family,
                                                           const ObjectiveOptions& options) {
  switch (family.objective) {
    case ObjectiveKind::kDdpm: {
      // The flow-matching options, refused for a DDPM family by name.
      const ObjectiveOptions d;
      const std::pair<bool, const char*> flow[] = {
          {options.timestep_sampling != d.timestep_sampling, "--timestep_sampling"},
          {options.discrete_flow_shift != d.discrete_flow_shift, "--discrete_flow_shift"},
          {options.sigmoid_scale != d.sigmoid_scale, "--sigmoid_scale"},
          // kohya's "uniform" (its current default, the trainer's) is "none" by another name.
          {options.weighting_scheme != d.weighting_scheme && options.weighting_scheme != "uniform",
           "--weighting_scheme"},
          {options.logit_mean != d.logit_mean, "--logit_mean"},
          {options.logit_std != d.logit_std, "--logit_std"},
          {options.mode_scale != d.mode_scale, "--mode_scale"},
          {options.model_prediction_type != d.model_prediction_type, "--model_prediction_type"},
          {options.guidance_scale != d.guidance_scale, "--guidance_scale"}};
      for (const auto& [set, flag] : flow) {
        if (set) {
          throw InputError(std::string(flag) + " is a flow-matching option (Flux.1); " +
                           family.display_name + " trains on DDPM timesteps");
        }
      }
      return make_ddpm_objective(family, options);
    }
    case ObjectiveKind::kFlowMatching:
      return make_flow_matching_objective(family, options);
  }
  throw Error("model family " + family.name + " has no training objective");
}

}  // namespace lorapipe::models
