#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "common/error.h"

namespace lorapipe::trainer {

void validate(const LrScheduleOptions& o) {
  for (const char* name : {"constant", "constant_with_warmup", "linear", "cosine",
                           "cosine_with_restarts", "polynomial"}) {
    if (o.name == name) return;
  }
  throw InputError("--lr_scheduler='" + o.name +
                   "' is not a schedule: use constant, constant_with_warmup, linear, cosine, "
                   "cosine_with_restarts or polynomial");
}

double lr_multiplier(const LrScheduleOptions& o, int64_t step) {
  const double s = static_cast<double>(step);
  const double warmup = static_cast<double>(o.warmup_steps);
  const double total = static_cast<double>(o.training_steps);
  if (o.name == "constant") return 1.0;
  if (step < o.warmup_steps) return s / std::max(1.0, warmup);
  if (o.name == "constant_with_warmup") return 1.0;
  const double progress = (s - warmup) / std::max(1.0, total - warmup);
  if (o.name == "linear") return std::max(0.0, (total - s) / std::max(1.0, total - warmup));
  if (o.name == "cosine") {
    // diffusers' default num_cycles 0.5: half a cosine from 1 down to 0.
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress)));
  }
  if (o.name == "cosine_with_restarts") {
    if (progress >= 1.0) return 0.0;
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi *
                                               std::fmod(o.num_cycles * progress, 1.0))));
  }
  if (o.name == "polynomial") {
    if (s > total) return o.lr_end / o.initial_lr;
    const double range = o.initial_lr - o.lr_end;
    const double remaining = 1.0 - (s - warmup) / (total - warmup);
    return (range * std::pow(remaining, o.power) + o.lr_end) / o.initial_lr;
  }
  validate(o);
  return 1.0;
}

int64_t warmup_steps_from(double value, int64_t training_steps) {
  if (value < 0) throw InputError("--lr_warmup_steps must not be negative");
  if (value < 1.0 && value > 0.0) return static_cast<int64_t>(value * training_steps);
  return static_cast<int64_t>(value);
}

}  // namespace lorapipe::trainer
