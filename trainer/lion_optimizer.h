#pragma once
// Lion (lion-pytorch's, as kohya's --optimizer_type=Lion loads it) behind trainer/optimizer.h's
// seam; reached through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// With lion-pytorch's defaults where not given: betas (0.9, 0.99), weight decay 0. Throws
// InputError for betas outside [0, 1].
std::unique_ptr<Optimizer> make_lion(const OptimizerOptions& options,
                                     std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
