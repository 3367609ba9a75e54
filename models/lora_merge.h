#pragma once
// A LoRA applied to a loaded model (the sampler's renders, the trainer's --base_weights), and
// taken out again, for every module of a kohya-format file (ours, kohya's, anyone's: lora_unet_*
// / lora_te_* with .lora_down.weight, .lora_up.weight and optionally .alpha, which when absent or
// 0 means the rank, as in kohya). Every module is checked and its update computed before the
// first layer changes (a file that does not fit leaves the model as it was).
//
// How it is applied (Application):
//  - kInSlots (the sampler's, by default): each module goes into its layer's LoRA slot and is
//    computed beside the frozen weight, base(x) + up(down(x)) * multiplier * alpha / rank, as
//    kohya computes its network when it samples during training (rank: a part's, for a FLUX.1
//    file trained with split_qkv whose fused layers still hold their parts). No weight changes
//    and none is copied, so a LoRA costs its own tensors and not a second copy of the weights it touches;
//    restore() empties the slots and the base is bit for bit what it was. A LoRA already in a
//    slot (a stack) is joined by concatenating the ranks.
//  - kMergedRestorable: W += multiplier * (alpha / rank) * up @ down, keeping a copy of each
//    weight it changes for restore(); renders compute no extra matmuls, at the cost of that copy.
//  - kMergedForGood (--base_weights): merged the same way, no copy, nothing to restore.
// A layer whose weight is stored in float8 (--fp8_base, models/float8.h) always takes the slot:
// float8 keeps 3 mantissa bits, and a LoRA's update, mostly far below a weight's rounding step,
// would be rounded away.

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
  enum class Application { kInSlots, kMergedRestorable, kMergedForGood };

  // Checks the whole file before touching a weight, and throws InputError naming the file and
  // what is wrong: unreadable or truncated, a LoRA kind other than plain LoRA/LoCon, keys that
  // fit no layer of this model (listed: a LoRA made for another base model), shapes that do not
  // fit their layer.
  MergedLora(DiffusionModel& model, const std::filesystem::path& file, double multiplier,
             Application application = Application::kInSlots);
  ~MergedLora() { restore(); }
  MergedLora(const MergedLora&) = delete;
  MergedLora& operator=(const MergedLora&) = delete;

  // Idempotent.
  void restore();
  size_t module_count() const { return saved_.size() + slotted_.size(); }
  size_t slotted_count() const { return slotted_.size(); }  // of them, those in a LoRA slot
  // Bytes of weights copied to be put back (kMergedRestorable only; 0 in slots).
  int64_t copied_bytes() const;
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

  // Applies `file` on top of what is applied (MergedLora's checks and errors).
  void add(DiffusionModel& model, const std::filesystem::path& file, double multiplier,
           MergedLora::Application application = MergedLora::Application::kInSlots);
  // Idempotent.
  void restore();
  size_t size() const { return merged_.size(); }
  bool changes_text_encoder() const;

 private:
  std::vector<std::unique_ptr<MergedLora>> merged_;
};

// kohya's --base_weights: each (file, multiplier) merged into `model` for good, in order, with
// MergedLora's checks. The trainer and the sampler call it on the model as loaded, before
// placement, so a merge adds to the weights as the file holds them (load them in fp32 to merge
// as kohya's merge_to does: in fp32, then narrowed to the compute dtype).
void merge_base_weights(DiffusionModel& model,
                        const std::vector<std::pair<std::filesystem::path, double>>& loras);

}  // namespace lorapipe::models
