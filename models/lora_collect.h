#pragma once
// kohya's create_modules (networks/lora.py, lora_flux.py), which every family's LoRA targets
// follow: inside every module of a target class, every Linear and Conv2d is adapted, once, named
// prefix + "." + module path + "." + child path with '.' -> '_'.

#include <functional>
#include <string>
#include <vector>

#include "models/lora_target.h"

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// The targets under `root` in named_modules order: below each module `is_target` picks, every
// models::Linear / models::Conv2d. `block_of` gives kohya's block index of a name (-1: none);
// LoraTarget::encoder is `encoder` for text-encoder targets.
std::vector<LoraTarget> collect_lora_targets(
    const torch::nn::Module& root, const std::string& prefix, bool text_encoder,
    const std::function<bool(const torch::nn::Module&)>& is_target,
    const std::function<int(const std::string&)>& block_of, int encoder = 0);

}  // namespace lorapipe::models
