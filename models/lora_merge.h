#pragma once
// A LoRA merged into a loaded model (the sampler's renders, the trainer's --base_weights), and
// taken out again: W += multiplier * (alpha / rank) * up @ down for every module of a
// kohya-format file (ours, kohya's, anyone's: lora_unet_* / lora_te_* with .lora_down.weight,
// .lora_up.weight and optionally .alpha, which when absent or 0 means the rank, as in kohya),
// then restore() puts back a copy of each original weight, so the base is bit-identical to
// before. Every module's update is computed before the first weight changes (a file that does
// not fit leaves the model as it was), so a merge briefly holds those updates beside the model.
//
// A layer whose weight is stored in float8 (--fp8_base, models/float8.h) is not merged into:
// float8 keeps 3 mantissa bits, and a LoRA's update, mostly far below a weight's rounding step,
// would be rounded away. The module goes into the layer's LoRA slot instead, computed beside
// the weight as kohya computes its network during training (a LoRA already there from a stack
// is joined by concatenating the ranks); restore() puts back what the slot held.

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/diffusion_model.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {

class MergedLora {
 public:
  // Checks the whole file before touching a weight, and throws InputError naming the file and
  // what is wrong: unreadable or truncated, a LoRA kind other than plain LoRA/LoCon, keys that
  // fit no layer of this model (listed: a LoRA made for another base model), shapes that do not
  // fit their layer.
  // With keep_originals false the merge is for good (the trainer's and sampler's --base_weights):
  // no copy of a weight is made, and restore() has nothing to put back.
  MergedLora(DiffusionModel& model, const std::filesystem::path& file, double multiplier,
             bool keep_originals = true);
  ~MergedLora() { restore(); }
  MergedLora(const MergedLora&) = delete;
  MergedLora& operator=(const MergedLora&) = delete;

  // Idempotent.
  void restore();
  size_t module_count() const { return saved_.size() + slotted_.size(); }
  size_t slotted_count() const { return slotted_.size(); }  // of them, those in a LoRA slot
  // Whether a module of the file is the text encoder's: then prompts encode otherwise.
  bool changes_text_encoder() const { return changes_text_encoder_; }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // the live weight, its original
  // A float8 layer's slot and what it held before.
  std::vector<std::pair<LoraTarget, std::shared_ptr<LoraAdapter>>> slotted_;
  bool changes_text_encoder_ = false;
  // Adds each delta to its weight and fills each float8 layer's slot, keeping what restore()
  // puts back.
  void apply(std::vector<std::pair<at::Tensor, at::Tensor>>& deltas,
             std::vector<std::pair<const LoraTarget*, std::shared_ptr<LoraAdapter>>>& adapters,
             bool keep_originals);
};

// Several LoRAs merged on top of one another, taken out newest first: each put back the weights
// it found, so only the reverse order gives back the base bit for bit.
class MergedLoras {
 public:
  MergedLoras() = default;
  ~MergedLoras() { restore(); }
  MergedLoras(const MergedLoras&) = delete;
  MergedLoras& operator=(const MergedLoras&) = delete;

  // Merges `file` on top of what is merged (MergedLora's checks and errors).
  void add(DiffusionModel& model, const std::filesystem::path& file, double multiplier);
  // Idempotent.
  void restore();
  size_t size() const { return merged_.size(); }
  bool changes_text_encoder() const;

 private:
  std::vector<std::unique_ptr<MergedLora>> merged_;
};

}  // namespace lorapipe::models
