#include "models/flux_lora.h"

#include <torch/nn/module.h>

#include "common/error.h"
#include "models/lora_collect.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {

std::vector<LoraTarget> flux_lora_targets(const FluxTransformer& model,
                                          const std::string& train_blocks) {
  if (train_blocks != "all" && train_blocks != "single" && train_blocks != "double") {
    throw InputError("network_args train_blocks=" + train_blocks +
                     ": Flux.1 LoRA trains all, single or double blocks");
  }
  const bool doubles = train_blocks != "single", singles = train_blocks != "double";
  return collect_lora_targets(
      *model, kLoraUnetPrefix, /*text_encoder=*/false,
      [doubles, singles](const torch::nn::Module& m) {
        return (doubles && dynamic_cast<const FluxDoubleBlockImpl*>(&m) != nullptr) ||
               (singles && dynamic_cast<const FluxSingleBlockImpl*>(&m) != nullptr);
      },
      // kohya's Flux LoRA has no block table for block-wise learning rates.
      [](const std::string&) { return -1; });
}

}  // namespace lorapipe::models
