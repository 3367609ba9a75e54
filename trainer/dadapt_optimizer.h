#pragma once
// DAdaptAdam (dadaptation's, as kohya's --optimizer_type=DAdaptAdam loads it)
// behind trainer/optimizer.h's seam; reached through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// Throws InputError for arguments dadaptation refuses (d0, eps <= 0; betas outside [0, 1)) and for
// groups whose learning rates differ other than by being 0.
std::unique_ptr<Optimizer> make_dadapt_adam(const OptimizerOptions& options,
                                            std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
