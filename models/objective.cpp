#include "models/objective.h"

#include <string>

#include "common/error.h"
#include "models/ddpm.h"

namespace lorapipe::models {

void check_objective_options(const ObjectiveOptions& o) {
  if (o.min_snr_gamma < 0) throw InputError("--min_snr_gamma must not be negative");
  if (o.v_pred_like_loss < 0) throw InputError("--v_pred_like_loss must not be negative");
  if (o.min_timestep < 0 || o.max_timestep > 1000 || o.min_timestep >= o.max_timestep) {
    throw InputError("--min_timestep/--max_timestep: need 0 <= min < max <= 1000, got " +
                     std::to_string(o.min_timestep) + " and " + std::to_string(o.max_timestep));
  }
  if (o.huber_schedule != "constant" && o.huber_schedule != "exponential" &&
      o.huber_schedule != "snr") {
    throw InputError("--huber_schedule='" + o.huber_schedule +
                     "': use constant, exponential or snr");
  }
}

std::unique_ptr<TrainingObjective> make_training_objective(const ModelFamily& family,
                                                           const ObjectiveOptions& options) {
  switch (family.objective) {
    case ObjectiveKind::kDdpm:
      return make_ddpm_objective(family, options);
  }
  throw Error("model family " + family.name + " has no training objective");
}

}  // namespace lorapipe::models
