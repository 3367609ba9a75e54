#include "models/lora_merge.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/log.h"
#include "models/block_swap.h"
#include "models/device.h"
#include "models/float8.h"
#include "models/flux_lora.h"
#include "models/linear.h"
#include "models/comfy_lora.h"
#include "models/peft_lora.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {

struct Module {
  at::Tensor down, up, alpha;
};

std::string shape(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
std::string shape(const at::Tensor& t) { return shape(t.sizes()); }

// A module's tensors as a LoRA holds them: down [rank, in(, k, k)] and up [out, rank(, 1, 1)] in
// a floating dtype, rank above 0, an alpha of one finite number, and no NaN or infinity (which
// would merge into the weights and render black). Throws InputError naming the file and module.
void check_module(const std::filesystem::path& file, const std::string& name, const Module& m) {
  auto refuse = [&](const std::string& what) {
    throw InputError(file.string() + ": module " + name + ": " + what);
  };
  for (const auto& [part, t] : {std::pair<const char*, const at::Tensor&>{"lora_down", m.down},
                                {"lora_up", m.up}}) {
    if (!at::isFloatingType(t.scalar_type())) {
      refuse(std::string(part) + " is " + c10::toString(t.scalar_type()) +
             ", not a floating-point tensor");
    }
    if (t.dim() != 2 && t.dim() != 4) {
      refuse(std::string(part) + " has shape " + shape(t) + ": a LoRA's is 2-D (linear) or 4-D (conv)");
    }
    if (t.size(0) == 0 || t.size(1) == 0) refuse(std::string(part) + " is empty (" + shape(t) + ")");
    if (!at::isfinite(t.to(torch::kFloat32)).all().item<bool>()) {
      refuse(std::string(part) + " holds NaN or infinity");
    }
  }
  if (m.alpha.defined()) {
    if (m.alpha.numel() != 1) refuse("alpha has shape " + shape(m.alpha) + ", not one number");
    const double alpha = m.alpha.to(torch::kFloat64).item<double>();
    if (!std::isfinite(alpha)) refuse("alpha is " + std::to_string(alpha));
  }
}

// Whether `up` [out, rank] is split_qkv's block-diagonal merge of parts `dims` (each part's rows
// read its own rank / parts columns alone, every other entry exactly 0).
bool split_up(const at::Tensor& up, const std::vector<int64_t>& dims, int64_t rank) {
  const auto parts = static_cast<int64_t>(dims.size());
  if (parts == 0 || rank % parts != 0) return false;
  const int64_t part_rank = rank / parts;
  at::Tensor off = up.abs();
  int64_t row = 0;
  for (int64_t j = 0; j < parts; ++j) {
    off.narrow(0, row, dims[static_cast<size_t>(j)]).narrow(1, j * part_rank, part_rank).zero_();
    row += dims[static_cast<size_t>(j)];
  }
  return row == up.size(0) && off.max().item<double>() == 0;
}

}  // namespace

MergedLora::MergedLora(DiffusionModel& model, const std::filesystem::path& file,
                       double multiplier, Application application) {
  const bool keep_originals = application != Application::kMergedForGood;
  std::map<std::string, at::Tensor> tensors;
  bool split_qkv = false;
  try {
    const SafetensorsFile opened = SafetensorsFile::open(file);
    tensors = read_tensors(opened);
    // kohya's split_qkv (networks.lora_flux) trains q, k, v (and linear1's MLP) as LoRAs of their
    // own, each at alpha / its rank, and saves them merged at n times the rank with alpha
    // unchanged (so loaders that read the merged rank apply them at 1/n: sd-scripts #2204).
    // A preview shows the LoRA as it was trained, as kohya's previews during training do (its
    // live network); merged into the base for good (--base_weights), it acts as kohya's merge.
    const auto meta = opened.metadata();
    if (is_comfy_lora(tensors)) {  // ComfyUI's naming: the same layers, under their paths
      tensors = kohya_lora_from_comfy(
          tensors, model.lora_targets(/*text_encoder=*/true, /*conv_kxk=*/true), file.string());
    }
    const bool peft = is_peft_lora(tensors);
    if (peft) {  // diffusers' naming: read into kohya's, every part's scale folded in
      const auto adapter = meta.find("lora_adapter_metadata");
      tensors = kohya_lora_from_peft(tensors, adapter == meta.end() ? "" : adapter->second,
                                     model.lora_targets(/*text_encoder=*/true, /*conv_kxk=*/true),
                                     file.string());
    }
    // A file converted to diffusers' naming may keep kohya's metadata: its split_qkv says
    // nothing of the modules read above.
    if (const auto args = meta.find("ss_network_args"); args != meta.end() && !peft) {
      const nlohmann::json parsed =
          nlohmann::json::parse(args->second, /*cb=*/nullptr, /*allow_exceptions=*/false);
      split_qkv = parsed.is_object() && parsed.contains("split_qkv") &&
                  parsed["split_qkv"] == "True" && application != Application::kMergedForGood;
    }
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {
    if (is_out_of_memory(e)) throw;  // the device's state, not the file's
    throw InputError(file.string() + ": not a readable safetensors file: " + e.what());
  }
  std::map<std::string, Module> modules;
  for (const auto& [key, tensor] : tensors) {
    const size_t dot = key.find('.');
    const std::string name = key.substr(0, dot);
    const std::string part = dot == std::string::npos ? "" : key.substr(dot + 1);
    Module& m = modules[name];
    if (part == "lora_down.weight") {
      m.down = tensor;
    } else if (part == "lora_up.weight") {
      m.up = tensor;
    } else if (part == "alpha") {
      m.alpha = tensor;
    } else if (key.ends_with("lora_down.weight") || key.ends_with("lora_up.weight") ||
               key.ends_with("lora.down.weight") || key.ends_with("lora.up.weight")) {
      // A plain LoRA in module paths with dots of no naming read above (older diffusers'
      // "unet....to_q_lora.down.weight"): not an unknown kind.
      throw InputError(file.string() + ": key '" + key +
                       "' names its layer by a dotted module path lorapipe does not read (older "
                       "diffusers' attention-processor naming?): give a LoRA in kohya's, "
                       "diffusers' PEFT or ComfyUI's naming");
    } else {
      throw InputError(file.string() + ": key '" + key +
                       "' is not plain LoRA or LoCon (lora_down / lora_up / alpha); other kinds "
                       "(LoHa, LoKr, DoRA) are not supported yet");
    }
  }
  std::map<std::string, LoraTarget> targets;  // by name, and by alias (another trainer's name)
  for (LoraTarget& t : model.lora_targets(/*text_encoder=*/true, /*conv_kxk=*/true)) {
    if (!t.alias.empty()) targets.emplace(t.alias, t);
    targets.emplace(t.name, std::move(t));
  }
  std::set<std::string> denoiser_targets;
  for (const LoraTarget& t : model.lora_targets(/*text_encoder=*/false, /*conv_kxk=*/true)) {
    denoiser_targets.insert(t.name);
    if (!t.alias.empty()) denoiser_targets.insert(t.alias);
  }
  std::vector<std::string> unknown;
  for (const auto& [name, m] : modules) {
    if (!targets.count(name)) unknown.push_back(name);
    if (!denoiser_targets.count(name)) changes_text_encoder_ = true;
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(unknown.size(), 5); ++i) list += "\n  " + unknown[i];
    if (unknown.size() > 5) list += "\n  ... " + std::to_string(unknown.size() - 5) + " more";
    throw InputError(
        file.string() + ": " + std::to_string(unknown.size()) + " of " +
        std::to_string(modules.size()) +
        " modules fit no layer of this model (a LoRA for another base model?):" + list);
  }
  // Every delta first, so a bad module leaves the weights as they were.
  std::vector<std::pair<at::Tensor, at::Tensor>> deltas;
  std::vector<std::pair<const LoraTarget*, std::shared_ptr<LoraAdapter>>> adapters;
  for (const auto& [name, m] : modules) {
    const LoraTarget& target = targets.at(name);
    const size_t parts = split_qkv ? flux_split_qkv_dims(target).size() : 0;
    if (!m.down.defined() || !m.up.defined()) {
      throw InputError(file.string() + ": module " + name + " lacks its " +
                       (m.down.defined() ? "lora_up" : "lora_down") + " weight");
    }
    check_module(file, name, m);
    const at::Tensor& weight = target.weight();
    // The weight's shape from its layer's options: the weight of a block --blocks_to_swap keeps
    // in host memory is an empty tensor while the block is off the device.
    std::vector<int64_t> sizes{target.out_features(), target.in_features()};
    if (target.conv) {
      const auto& o = target.conv->options;
      sizes[1] /= o.groups();
      sizes.push_back((*o.kernel_size())[0]);
      sizes.push_back((*o.kernel_size())[1]);
    }
    const int64_t rank = m.down.size(0);
    const at::Tensor down = m.down.to(torch::kFloat32).flatten(1);
    const at::Tensor up = m.up.to(torch::kFloat32).flatten(1);
    const int64_t in_size = c10::multiply_integers(sizes.begin() + 1, sizes.end());
    if (up.size(1) != rank || up.size(0) != sizes[0] || down.size(1) != in_size) {
      throw InputError(file.string() + ": module " + name + " has lora_down " + shape(m.down) +
                       " and lora_up " + shape(m.up) + ", which do not fit its layer's weight " +
                       shape(sizes));
    }
    // The rank the module trained at: a split_qkv part's (see above) where the up still is
    // block-diagonal over the parts, else the file's (a file resized after training, by kohya's
    // resize_lora, keeps the metadata but holds one plain module).
    const int64_t parts_rank = parts > 0 && split_up(up, flux_split_qkv_dims(target), rank)
                                   ? rank / static_cast<int64_t>(parts)
                                   : rank;
    // No alpha, or alpha 0, means the rank (scale 1), as kohya's LoRAModule reads it.
    const double stored = m.alpha.defined() ? m.alpha.to(torch::kFloat64).item<double>() : 0.0;
    const double alpha = stored != 0 ? stored : static_cast<double>(parts_rank);
    if (is_float8(weight) || application == Application::kInSlots) {
      // Beside the weight, kept in fp32 (the layer computes it in its own dtype), with
      // the scale folded into down so that a stack joins by concatenation alone.
      auto adapter = std::make_shared<LoraAdapter>();
      const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(weight.device());
      adapter->down = (down * (multiplier * alpha / parts_rank)).to(fp32);
      adapter->up = up.to(fp32);
      if (target.conv) {
        adapter->down = adapter->down.view({rank, sizes[1], sizes[2], sizes[3]});
        adapter->up = adapter->up.view({sizes[0], rank, 1, 1});
        const auto& o = target.conv->options;
        adapter->stride = {(*o.stride())[0], (*o.stride())[1]};
        const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
        if (padding == nullptr) throw Error(name + ": string padding is not supported");
        adapter->padding = {(**padding)[0], (**padding)[1]};
      }
      adapters.emplace_back(&target, std::move(adapter));
      continue;
    }
    // A swapped weight is empty off the device, or a view into a slot that the next load
    // overwrites: only its host copy holds its values.
    if (const BlockSwap* swap = model.block_swap(); swap != nullptr && swap->host_copy(weight).defined()) {
      throw InputError(file.string() + ": module " + name + " would merge into a weight "
                       "--blocks_to_swap keeps in host memory: apply it beside the weights "
                       "(the sampler without --merge_lora)");
    }
    // kohya's merge: up @ down (for a kxk conv, the 1x1 up composed with the kxk down).
    const at::Tensor delta =
        (up.matmul(down) * (multiplier * alpha / parts_rank)).view(weight.sizes());
    deltas.emplace_back(weight, delta);
  }
  torch::NoGradGuard no_grad;
  // Never half merged: whatever fails from here (the device out of memory) first puts back what
  // was changed. The lists have their room before any weight changes.
  if (keep_originals) {
    saved_.reserve(deltas.size());
    slotted_.reserve(adapters.size());
  }
  try {
    apply(deltas, adapters, keep_originals);
  } catch (...) {
    restore();
    throw;
  }
}

void MergedLora::apply(
    std::vector<std::pair<at::Tensor, at::Tensor>>& deltas,
    std::vector<std::pair<const LoraTarget*, std::shared_ptr<LoraAdapter>>>& adapters,
    bool keep_originals) {
  for (auto& [weight, delta] : deltas) {
    if (keep_originals) saved_.emplace_back(weight, weight.clone());
    weight.add_(delta.to(weight.device(), weight.scalar_type()));
  }
  for (auto& [target, adapter] : adapters) {
    std::shared_ptr<LoraAdapter>& slot = target->slot();
    const std::shared_ptr<LoraAdapter> before = slot;
    if (before) {  // a stack: both modules as one of the summed ranks
      const int64_t up_rank_dim = 1;
      auto joined = std::make_shared<LoraAdapter>(*before);
      joined->down =
          torch::cat({before->down * (before->multiplier * before->scale), adapter->down}, 0);
      joined->up = torch::cat({before->up, adapter->up}, up_rank_dim);
      joined->scale = 1.0;
      joined->multiplier = 1.0;
      adapter = std::move(joined);
    }
    slot = adapter;
    if (keep_originals) slotted_.emplace_back(*target, before);
  }
}

void MergedLora::restore() {
  torch::NoGradGuard no_grad;
  for (auto& [weight, original] : saved_) weight.copy_(original);
  saved_.clear();
  for (auto& [target, before] : slotted_) target.slot() = before;
  slotted_.clear();
}

void MergedLoras::add(DiffusionModel& model, const std::filesystem::path& file,
                      double multiplier, MergedLora::Application application) {
  merged_.push_back(std::make_unique<MergedLora>(model, file, multiplier, application));
}

int64_t MergedLora::copied_bytes() const {
  int64_t bytes = 0;
  for (const auto& [weight, original] : saved_) bytes += static_cast<int64_t>(original.nbytes());
  return bytes;
}

bool MergedLoras::changes_text_encoder() const {
  for (const auto& m : merged_) {
    if (m->changes_text_encoder()) return true;
  }
  return false;
}

void MergedLoras::restore() {
  while (!merged_.empty()) merged_.pop_back();  // newest first: each restores what it found
}

void merge_base_weights(DiffusionModel& model,
                        const std::vector<std::pair<std::filesystem::path, double>>& loras) {
  for (const auto& [file, multiplier] : loras) {
    const MergedLora merged(model, file, multiplier, MergedLora::Application::kMergedForGood);
    LP_LOG(kInfo, "models") << "--base_weights: merged " << file.string() << " x" << multiplier
                            << " into the base model (" << merged.module_count() << " modules)";
  }
}

}  // namespace lorapipe::models
