#pragma once
// CAME (came-pytorch's, as kohya loads it for --optimizer_type=came_pytorch.CAME) behind
// trainer/optimizer.h's seam; reached through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// With came-pytorch's defaults where not given: betas (0.9, 0.999, 0.9999), eps (1e-30, 1e-16),
// clip_threshold 1, weight decay 0. Throws InputError for betas outside [0, 1].
std::unique_ptr<Optimizer> make_came(const OptimizerOptions& options,
                                     std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
