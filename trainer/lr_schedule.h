#pragma once
// Learning-rate schedules by kohya's names, as diffusers.optimization.get_scheduler builds them
// (kohya's get_scheduler_fix passes num_cycles only to cosine_with_restarts and power only to
// polynomial). A schedule is a multiplier of each parameter group's initial learning rate,
// evaluated at the number of optimizer steps taken so far (LambdaLR's last_epoch).

#include <cstdint>
#include <string>

namespace lorapipe::trainer {

struct LrScheduleOptions {
  std::string name = "constant";  // constant, constant_with_warmup, linear, cosine,
                                  // cosine_with_restarts, polynomial
  int64_t warmup_steps = 0;
  int64_t training_steps = 1;
  int num_cycles = 1;   // cosine_with_restarts
  double power = 1.0;   // polynomial
  double lr_end = 1e-7; // polynomial: diffusers' default end, as a fraction of nothing: absolute
  double initial_lr = 1e-4;  // polynomial only (its end point is absolute)
};

// Throws InputError naming an unknown schedule.
void validate(const LrScheduleOptions& options);

// The multiplier at optimizer step `step` (0 for the first update).
double lr_multiplier(const LrScheduleOptions& options, int64_t step);

// kohya's --lr_warmup_steps: a value below 1 is a ratio of the training steps.
int64_t warmup_steps_from(double value, int64_t training_steps);

}  // namespace lorapipe::trainer
