#pragma once
// Prodigy (prodigyopt's, as kohya's --optimizer_type=Prodigy loads it) behind trainer/optimizer.h's
// seam; reached through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// Throws InputError for arguments prodigyopt refuses (d0, eps <= 0; betas outside [0, 1)) and
// for groups whose learning rates differ other than by being 0 (prodigyopt adapts one step size
// for all of them and refuses that at its first step).
std::unique_ptr<Optimizer> make_prodigy(const OptimizerOptions& options,
                                        std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
