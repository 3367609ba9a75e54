#pragma once
// Adafactor (transformers', as kohya's --optimizer_type=Adafactor loads it) behind
// trainer/optimizer.h's seam; reached through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

std::unique_ptr<Optimizer> make_adafactor(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups);

}  // namespace lorapipe::trainer
