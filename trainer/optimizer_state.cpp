#include "trainer/optimizer_state.h"

#include <torch/torch.h>

#include <sstream>

#include "common/error.h"
#include "common/file.h"

namespace lorapipe::trainer {

void save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& file) {
  std::ostringstream memory;
  archive.save_to(memory);
  // Not synced here: write_folder syncs every file of a state before it swaps the state in.
  write_file(file, std::move(memory).str(), /*sync=*/false);
}

std::string state_key(size_t group, size_t index, const std::string& name) {
  return "g" + std::to_string(group) + "_" + std::to_string(index) + "_" + name;
}

void check_d_adaptation(const OptimizerOptions& options, const std::vector<ParamGroup>& groups,
                        const std::string& optimizer) {
  if (!(options.prodigy.d0 > 0)) {
    throw InputError("--optimizer_args d0=" + std::to_string(options.prodigy.d0) + ": " +
                     optimizer + "'s must be > 0");
  }
  if (!(options.eps > 0)) {
    throw InputError("--optimizer_args eps=" + std::to_string(options.eps) + ": " + optimizer +
                     "'s must be > 0");
  }
  if (!(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1)) {
    throw InputError("--optimizer_args betas=" + std::to_string(options.beta1) + "," +
                     std::to_string(options.beta2) + ": " + optimizer + "'s must lie in [0, 1)");
  }
  double top = 0;
  for (const ParamGroup& g : groups) top = std::max(top, g.lr);
  if (!(top > 0)) {
    throw InputError(optimizer + " needs a learning rate > 0 (1.0 is its usual one)");
  }
  for (const ParamGroup& g : groups) {
    // The packages refuse groups whose rates differ (other than 0) at their first step: refused
    // here, before any compute.
    if (g.lr != top && g.lr != 0) {
      throw InputError(optimizer + " adapts one step size for every parameter group, so their "
                       "learning rates must be equal (or 0): the " + g.name + " group has " +
                       std::to_string(g.lr) + " beside " + std::to_string(top) +
                       " (set --learning_rate alone, drop --unet_lr/--text_encoder_lr or "
                       "loraplus_lr_ratio)");
    }
  }
}

void load_state_archive(const std::filesystem::path& file, const std::string& optimizer,
                        const std::function<void(torch::serialize::InputArchive&)>& read) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(file.string());
    read(archive);
  } catch (const c10::Error& e) {
    throw InputError(file.string() + ": not a " + optimizer + " optimizer state for this network: " +
                     e.what_without_backtrace());
  }
}

}  // namespace lorapipe::trainer
