#pragma once
// Learning-rate schedules by kohya's names, as kohya's get_scheduler_fix builds them from
// transformers.optimization (diffusers' for piecewise_constant). A schedule is a multiplier of
// each parameter group's initial learning rate, evaluated at the number of optimizer steps taken
// so far (LambdaLR's last_epoch).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lorapipe::trainer {

struct LrScheduleOptions {
  // constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial,
  // cosine_with_min_lr, warmup_stable_decay, inverse_sqrt, piecewise_constant
  std::string name = "constant";
  int64_t warmup_steps = 0;
  int64_t training_steps = 1;
  int num_cycles = 1;    // --lr_scheduler_num_cycles: cosine_with_restarts' restarts; the
                         // half-cycles of cosine_with_min_lr and warmup_stable_decay's decay
  double power = 1.0;    // polynomial
  double lr_end = 1e-7;  // polynomial's absolute end (lr_scheduler_args lr_end=)
  double initial_lr = 1e-4;  // polynomial's and min_lr='s reference: --learning_rate
  // --lr_scheduler_min_lr_ratio: cosine_with_min_lr's floor (required there, or min_lr= in
  // lr_scheduler_args), warmup_stable_decay's start and end (0 unset).
  std::optional<double> min_lr_ratio;
  // --lr_decay_steps: warmup_stable_decay's decay, a count or below 1 a ratio of the steps.
  double decay_steps = 0;
  // --lr_scheduler_timescale: inverse_sqrt's (0: the warmup steps, or 10000 without warmup).
  int64_t timescale = 0;
  // lr_scheduler_args for warmup_stable_decay: linear, cosine or 1-sqrt.
  std::string warmup_type = "linear", decay_type = "cosine";
  // lr_scheduler_args step_rules for piecewise_constant, diffusers' form: "1:10,0.1:20,0.01" is
  // x1 before step 10, x0.1 before step 20, x0.01 after.
  std::string step_rules;
  // kohya's scheduler, wrapped by accelerate, steps once per process for each optimizer step,
  // over max_train_steps x processes (get_scheduler_fix's num_training_steps): training_steps,
  // warmup_steps and the other counts above are in those steps, as kohya's are; so a count of
  // warmup steps passes `processes` times faster on that many ranks, a ratio alike.
  int64_t processes = 1;
};

// Applies --lr_scheduler_args (kohya's key=value words) to `options`: lr_end (polynomial),
// min_lr (cosine_with_min_lr, absolute), warmup_type / decay_type (warmup_stable_decay),
// step_rules (piecewise_constant). Throws InputError naming a key the schedule does not take or
// a value it cannot read.
void apply_lr_scheduler_args(LrScheduleOptions& options, const std::vector<std::string>& args);

// Throws InputError naming an unknown schedule or what it misses.
void validate(const LrScheduleOptions& options);

// The multiplier at optimizer step `optimizer_step` (0 for the first update): the schedule's at
// optimizer_step x processes.
double lr_multiplier(const LrScheduleOptions& options, int64_t optimizer_step);

// kohya's --lr_warmup_steps and --lr_decay_steps: a value below 1 is a ratio of the training
// steps.
int64_t warmup_steps_from(double value, int64_t training_steps);

}  // namespace lorapipe::trainer
