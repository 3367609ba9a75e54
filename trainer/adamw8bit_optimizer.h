#pragma once
// AdamW8bit / PagedAdamW8bit (kernels/adamw8bit.h) behind trainer/optimizer.h's seam; reached
// through make_optimizer.

#include <memory>
#include <vector>

#include "trainer/optimizer.h"

namespace lorapipe::trainer {

// `paged`: the state in CUDA managed memory, prefetched to the device before each step.
// Parameters may live on the CPU or on one CUDA device, fp32, bf16 or fp16.
std::unique_ptr<Optimizer> make_adamw8bit(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups, bool paged);

}  // namespace lorapipe::trainer
