#include "models/comfy_lora.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace lorapipe::models {
namespace {

constexpr const char* kPrefixes[] = {"diffusion_model.", "text_encoders."};

bool comfy_key(const std::string& key) {
  return std::any_of(std::begin(kPrefixes), std::end(kPrefixes),
                     [&](const char* p) { return key.rfind(p, 0) == 0; });
}

struct Module {
  at::Tensor down, up, alpha;
};

}  // namespace

bool is_comfy_lora(const std::map<std::string, at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(),
                     [](const auto& kv) { return comfy_key(kv.first); });
}

std::map<std::string, at::Tensor> kohya_lora_from_comfy(
    const std::map<std::string, at::Tensor>& tensors, const std::vector<LoraTarget>& targets,
    const std::string& file) {
  std::map<std::string, at::Tensor> out;
  std::map<std::string, Module> modules;  // by ComfyUI path, in key order
  for (const auto& [key, tensor] : tensors) {
    if (!comfy_key(key)) {
      out[key] = tensor;
      continue;
    }
    std::string path;
    at::Tensor Module::*slot = nullptr;
    for (const auto& [suffix, member] :
         {std::pair{".lora_down.weight", &Module::down}, std::pair{".lora_A.weight", &Module::down},
          std::pair{".lora_up.weight", &Module::up}, std::pair{".lora_B.weight", &Module::up},
          std::pair{".alpha", &Module::alpha}}) {
      if (key.ends_with(suffix)) {
        path = key.substr(0, key.size() - std::string(suffix).size());
        slot = member;
        break;
      }
    }
    if (slot == nullptr) {
      throw InputError(file + ": key '" + key +
                       "' is not a plain LoRA weight of ComfyUI's naming (<layer>.lora_down / "
                       ".lora_up / .lora_A / .lora_B .weight, <layer>.alpha); other kinds (full "
                       "weight or bias differences, DoRA, LoHa, LoKr) are not applied yet");
    }
    Module& m = modules[path];
    if ((m.*slot).defined()) {  // lora_down beside lora_A for one layer
      throw InputError(file + ": key '" + key + "' gives layer " + path + " a second weight");
    }
    m.*slot = tensor;
  }
  std::map<std::string, const LoraTarget*> by_path;
  for (const LoraTarget& t : targets) {
    if (!t.comfy_path.empty()) by_path[t.comfy_path] = &t;
  }
  std::vector<std::string> unknown;
  for (const auto& [path, m] : modules) {
    const auto target = by_path.find(path);
    if (target == by_path.end()) {
      unknown.push_back(path);
      continue;
    }
    if (!m.down.defined() || !m.up.defined()) {
      throw InputError(file + ": layer " + path + " lacks its " +
                       (m.down.defined() ? "up (lora_up / lora_B)" : "down (lora_down / lora_A)") +
                       " weight");
    }
    const std::string& name = target->second->name;
    if (out.count(name + ".lora_down.weight")) {
      throw InputError(file + ": layer " + path + " is also in the file as " + name);
    }
    out[name + ".lora_down.weight"] = m.down;
    out[name + ".lora_up.weight"] = m.up;
    out[name + ".alpha"] =
        m.alpha.defined() ? m.alpha
                          : at::scalar_tensor(static_cast<double>(m.down.size(0)), at::kFloat);
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(unknown.size(), 5); ++i) list += "\n  " + unknown[i];
    if (unknown.size() > 5) list += "\n  ... " + std::to_string(unknown.size() - 5) + " more";
    throw InputError(file + ": " + std::to_string(unknown.size()) + " of " +
                     std::to_string(modules.size()) +
                     " layers (ComfyUI's naming) fit no layer of this model (a LoRA for another "
                     "base model?):" + list);
  }
  return out;
}

}  // namespace lorapipe::models
