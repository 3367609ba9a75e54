#pragma once
// Schedule-free AdamW (schedulefree's AdamWScheduleFree, as kohya loads it for
// --optimizer_type=AdamWScheduleFree) behind trainer/optimizer.h's seam; reached through
// make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// With schedulefree's defaults where not given: betas (0.9, 0.999), eps 1e-8, weight decay 0,
// warmup_steps 0, r 0, weight_lr_power 2. Throws InputError for betas outside [0, 1).
std::unique_ptr<Optimizer> make_adamw_schedulefree(const OptimizerOptions& options,
                                                   std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
