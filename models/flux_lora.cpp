#include "models/flux_lora.h"

#include <torch/nn/module.h>

#include <algorithm>

#include "common/error.h"
#include "models/lora_collect.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {

std::vector<LoraTarget> flux_lora_targets(const FluxTransformer& model,
                                          const std::string& train_blocks,
                                          const std::vector<std::string>& in_dims) {
  if (train_blocks != "all" && train_blocks != "single" && train_blocks != "double") {
    throw InputError("network_args train_blocks=" + train_blocks +
                     ": Flux.1 LoRA trains all, single or double blocks");
  }
  const bool doubles = train_blocks != "single", singles = train_blocks != "double";
  std::vector<LoraTarget> targets = collect_lora_targets(
      *model, kLoraUnetPrefix, /*text_encoder=*/false,
      [doubles, singles](const torch::nn::Module& m) {
        return (doubles && dynamic_cast<const FluxDoubleBlockImpl*>(&m) != nullptr) ||
               (singles && dynamic_cast<const FluxSingleBlockImpl*>(&m) != nullptr);
      },
      // kohya's Flux LoRA has no block table for block-wise learning rates.
      [](const std::string&) { return -1; });
  for (size_t group = 0; group < in_dims.size(); ++group) {
    const std::string filter = "_" + in_dims[group];
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      LoraTarget target;
      target.linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
      if (!target.linear) continue;
      target.module_path = item.key();
      target.comfy_path = "diffusion_model." + item.key();
      target.name = std::string(kLoraUnetPrefix) + "." + item.key();
      std::replace(target.name.begin(), target.name.end(), '.', '_');
      if (target.name.find(filter) == std::string::npos) continue;
      target.in_dims = static_cast<int>(group);
      targets.push_back(std::move(target));
    }
  }
  // diffusers' layers for each (FluxTransformer2DModel's split q, k, v and MLP input), from the
  // key map its folders load through.
  const auto recipes = flux_original_from_diffusers(model->config);
  for (LoraTarget& t : targets) {
    const auto recipe = recipes.find(t.module_path + ".weight");
    if (recipe == recipes.end() || recipe->second.swap_halves) continue;
    const std::vector<std::string>& sources = recipe->second.sources;
    std::vector<int64_t> rows = flux_split_qkv_dims(t);
    if (sources.size() == 1) rows = {t.out_features()};
    if (rows.size() != sources.size()) {
      throw Error("Flux LoRA: " + t.name + " has " + std::to_string(sources.size()) +
                  " diffusers layers but " + std::to_string(rows.size()) + " parts");
    }
    for (size_t i = 0; i < sources.size(); ++i) {
      const std::string& s = sources[i];
      t.reference_parts.emplace_back(s.substr(0, s.size() - std::string(".weight").size()),
                                     rows[i]);
    }
  }
  return targets;
}

std::vector<int64_t> flux_split_qkv_dims(const LoraTarget& target) {
  if (target.text_encoder || target.conv) return {};
  const int64_t in = target.in_features(), out = target.out_features();
  const std::string& n = target.name;
  if (n.find("double") != std::string::npos && n.find("qkv") != std::string::npos) {
    return {out / 3, out / 3, out / 3};
  }
  if (n.find("single") != std::string::npos && n.find("linear1") != std::string::npos) {
    return {in, in, in, out - 3 * in};
  }
  return {};
}

}  // namespace lorapipe::models
