#include "models/peft_lora.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/error.h"

namespace lorapipe::models {
namespace {

// diffusers' component prefixes, the longer of two that share a start first.
constexpr const char* kComponents[] = {"text_encoder_2", "text_encoder", "unet", "transformer"};

// The components a target's modules may sit under in a file.
std::vector<std::string> components_of(const LoraTarget& t) {
  if (!t.text_encoder) return {"unet", "transformer"};
  return {t.encoder == 0 ? "text_encoder" : "text_encoder_" + std::to_string(t.encoder + 1)};
}

struct PeftModule {
  std::string component, path;  // "transformer", "transformer_blocks.0.attn.to_q"
  at::Tensor a, b, alpha;
};

// Splits "<component>.<path>" (empty component: none of diffusers').
std::pair<std::string, std::string> split_component(const std::string& module) {
  for (const char* c : kComponents) {
    const std::string prefix = std::string(c) + ".";
    if (module.rfind(prefix, 0) == 0) return {c, module.substr(prefix.size())};
  }
  return {"", module};
}

// What diffusers' load_lora_weights takes as a module's alpha where the module has none of its
// own, per component (see the header).
struct ComponentAlphas {
  std::optional<double> most_common;  // of the component's ".alpha" tensors
  bool has_metadata = false;          // lora_adapter_metadata names the component
  double metadata = 8;                // its lora_alpha (peft's LoraConfig default: 8)
  nlohmann::json alpha_pattern = nlohmann::json::object();
  bool rslora = false;     // its use_rslora: peft scales by alpha / sqrt(rank)
  int64_t first_rank = 0;  // of the component's first lora_B in key order
};

// peft's pattern keys: a module path, or its last dotted parts; "^" anchors it at the start.
bool pattern_matches(const std::string& pattern, const std::string& path) {
  if (!pattern.empty() && pattern[0] == '^') return path == pattern.substr(1);
  return path == pattern ||
         (path.size() > pattern.size() && path.ends_with(pattern) &&
          path[path.size() - pattern.size() - 1] == '.');
}

double alpha_of(const PeftModule& m, const ComponentAlphas& c) {
  if (c.has_metadata) {
    for (const auto& [pattern, value] : c.alpha_pattern.items()) {
      if (value.is_number() && pattern_matches(pattern, m.path)) return value.get<double>();
    }
    return c.metadata;
  }
  if (m.alpha.defined()) return m.alpha.to(at::kDouble).item<double>();
  if (c.most_common) return *c.most_common;
  return static_cast<double>(c.first_rank);
}

// What the module's B(A(x)) is multiplied by: alpha / rank, or alpha / sqrt(rank) (rsLoRA).
double scale_of(const PeftModule& m, const ComponentAlphas& c) {
  const auto rank = static_cast<double>(m.a.size(0));
  return alpha_of(m, c) / (c.rslora ? std::sqrt(rank) : rank);
}

}  // namespace

bool is_peft_lora(const std::map<std::string, at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const auto& kv) {
    return kv.first.find(".lora_A.") != std::string::npos ||
           kv.first.find(".lora_B.") != std::string::npos;
  });
}

std::map<std::string, at::Tensor> kohya_lora_from_peft(
    const std::map<std::string, at::Tensor>& tensors, const std::string& adapter_metadata,
    const std::vector<LoraTarget>& targets, const std::string& file) {
  std::map<std::string, PeftModule> modules;  // by "<component>.<path>", in key order
  std::map<std::string, ComponentAlphas> components;
  std::map<std::string, std::vector<double>> alphas;  // per component, in key order
  for (const auto& [key, tensor] : tensors) {
    auto refuse = [&](const std::string& why) {
      throw InputError(file + ": key '" + key + "' " + why);
    };
    if (key.find("lora_magnitude_vector") != std::string::npos) {
      refuse("is DoRA's magnitude, which lorapipe does not apply yet: give a plain LoRA");
    }
    std::string module;
    at::Tensor PeftModule::*slot = nullptr;
    for (const auto& [suffix, member] :
         {std::pair{".lora_A.weight", &PeftModule::a}, std::pair{".lora_B.weight", &PeftModule::b},
          std::pair{".alpha", &PeftModule::alpha}}) {
      if (key.ends_with(suffix)) {
        module = key.substr(0, key.size() - std::string(suffix).size());
        slot = member;
      }
    }
    if (slot == nullptr) {
      refuse(key.ends_with(".lora_B.bias")
                 ? "is a LoRA bias (peft's lora_bias), which lorapipe does not apply yet"
                 : "is not a LoRA weight of diffusers' naming (<module>.lora_A.weight, "
                   "<module>.lora_B.weight, <module>.alpha)");
    }
    auto [component, path] = split_component(module);
    if (component.empty()) {
      refuse("names no component of diffusers' files (unet., transformer., text_encoder., "
             "text_encoder_2.)");
    }
    PeftModule& m = modules[module];
    m.component = component;
    m.path = path;
    m.*slot = tensor;
    ComponentAlphas& c = components[component];
    if (slot == &PeftModule::b && tensor.dim() > 1 && c.first_rank == 0) {
      c.first_rank = tensor.size(1);
    }
    if (slot == &PeftModule::alpha) alphas[component].push_back(tensor.to(at::kDouble).item<double>());
  }
  for (auto& [component, values] : alphas) {
    // Counter.most_common: the highest count, the first seen among equals.
    double best = values.front();
    int64_t best_count = 0;
    for (double v : values) {
      const auto count = std::count(values.begin(), values.end(), v);
      if (count > best_count) best = v, best_count = count;
    }
    components[component].most_common = best;
  }
  if (!adapter_metadata.empty()) {
    const nlohmann::json meta =
        nlohmann::json::parse(adapter_metadata, /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (!meta.is_object()) {
      throw InputError(file + ": its lora_adapter_metadata is not a JSON object");
    }
    for (auto& [component, c] : components) {
      const std::string prefix = component + ".";
      for (const auto& [key, value] : meta.items()) c.has_metadata |= key.rfind(prefix, 0) == 0;
      if (!c.has_metadata) continue;
      if (c.most_common) {  // as diffusers refuses network alphas beside metadata
        throw InputError(file + ": component " + component +
                         " has both .alpha tensors and lora_adapter_metadata; diffusers refuses "
                         "such a file too");
      }
      if (const auto a = meta.find(prefix + "lora_alpha"); a != meta.end() && a->is_number()) {
        c.metadata = a->get<double>();
      }
      if (const auto p = meta.find(prefix + "alpha_pattern"); p != meta.end() && p->is_object()) {
        c.alpha_pattern = *p;
      }
      if (const auto r = meta.find(prefix + "use_rslora"); r != meta.end() && r->is_boolean()) {
        c.rslora = r->get<bool>();
      }
    }
  }

  // Every part of every target, by the name a file gives it.
  struct Part {
    const LoraTarget* target;
    size_t index;
  };
  std::map<std::string, Part> parts;
  auto parts_of = [](const LoraTarget& t) {
    return t.reference_parts.empty()
               ? std::vector<std::pair<std::string, int64_t>>{{t.module_path, t.out_features()}}
               : t.reference_parts;
  };
  for (const LoraTarget& t : targets) {
    const auto ps = parts_of(t);
    for (const std::string& component : components_of(t)) {
      for (size_t j = 0; j < ps.size(); ++j) parts[component + "." + ps[j].first] = {&t, j};
    }
  }
  std::map<const LoraTarget*, std::vector<const PeftModule*>> found;
  std::vector<std::string> unknown;
  for (const auto& [name, m] : modules) {
    if (!m.a.defined() || !m.b.defined()) {
      throw InputError(file + ": module " + name + " lacks its " +
                       (m.a.defined() ? "lora_B" : "lora_A") + " weight");
    }
    const auto part = parts.find(name);
    if (part == parts.end()) {
      unknown.push_back(name);
      continue;
    }
    auto& slots = found[part->second.target];
    slots.resize(parts_of(*part->second.target).size(), nullptr);
    slots[part->second.index] = &m;
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(unknown.size(), 5); ++i) list += "\n  " + unknown[i];
    if (unknown.size() > 5) list += "\n  ... " + std::to_string(unknown.size() - 5) + " more";
    throw InputError(file + ": " + std::to_string(unknown.size()) + " of " +
                     std::to_string(modules.size()) +
                     " modules (diffusers' naming) fit no layer of this model (a LoRA for another "
                     "base model?):" + list);
  }

  std::map<std::string, at::Tensor> out;
  for (const auto& [target, slots] : found) {
    const auto ps = parts_of(*target);
    const std::string& name = target->name;
    if (ps.size() == 1) {
      const PeftModule& m = *slots[0];
      out[name + ".lora_down.weight"] = m.a.to(at::kFloat);
      out[name + ".lora_up.weight"] = m.b.to(at::kFloat);
      // kohya's alpha for the same scale: scale x rank.
      out[name + ".alpha"] = at::scalar_tensor(
          scale_of(m, components.at(m.component)) * static_cast<double>(m.a.size(0)), at::kFloat);
      continue;
    }
    // One module for the fused layer: [A_1; A_2; ...] and the ups on the diagonal, each part's
    // rows scaled by its own alpha / rank; scale 1 for the whole.
    std::vector<at::Tensor> downs;
    int64_t rank = 0;
    for (const PeftModule* m : slots) {
      if (m == nullptr) continue;
      if (m->a.dim() < 2 || m->a.size(1) != target->in_features()) {
        throw InputError(file + ": module " + m->component + "." + m->path + " has lora_A of " +
                         std::to_string(m->a.dim() < 2 ? 0 : m->a.size(1)) +
                         " inputs, where its layer has " + std::to_string(target->in_features()));
      }
      downs.push_back(m->a.to(at::kFloat));
      rank += m->a.size(0);
    }
    const at::Tensor down = at::cat(downs, 0);
    std::vector<int64_t> up_shape{target->out_features(), rank};
    const PeftModule* any = *std::find_if(slots.begin(), slots.end(),
                                          [](const PeftModule* m) { return m != nullptr; });
    for (int64_t d = 2; d < any->b.dim(); ++d) up_shape.push_back(any->b.size(d));
    at::Tensor up = at::zeros(up_shape, at::kFloat);
    int64_t row = 0, column = 0;
    for (size_t j = 0; j < ps.size(); ++j) {
      const int64_t rows = ps[j].second;
      if (const PeftModule* m = slots[j]; m != nullptr) {
        if (m->b.size(0) != rows || m->b.size(1) != m->a.size(0)) {
          throw InputError(file + ": module " + m->component + "." + m->path +
                           " has lora_B of " + std::to_string(m->b.size(0)) + " x " +
                           std::to_string(m->b.size(1)) + ", where its layer has " +
                           std::to_string(rows) + " rows and the module rank " +
                           std::to_string(m->a.size(0)));
        }
        const double scale = scale_of(*m, components.at(m->component));
        up.narrow(0, row, rows).narrow(1, column, m->a.size(0)).copy_(m->b.to(at::kFloat) * scale);
        column += m->a.size(0);
      }
      row += rows;
    }
    out[name + ".lora_down.weight"] = down;
    out[name + ".lora_up.weight"] = up;
    out[name + ".alpha"] = at::scalar_tensor(static_cast<double>(rank), at::kFloat);
  }
  return out;
}

}  // namespace lorapipe::models
