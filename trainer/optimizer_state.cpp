#include "trainer/optimizer_state.h"

#include <torch/torch.h>

#include "common/error.h"

namespace lorapipe::trainer {

std::string state_key(size_t group, size_t index, const std::string& name) {
  return "g" + std::to_string(group) + "_" + std::to_string(index) + "_" + name;
}

at::Tensor read_state(torch::serialize::InputArchive& archive, const std::string& key,
                      const at::Tensor& param, bool same_shape) {
  at::Tensor t;
  archive.read(key, t);
  TORCH_CHECK(!same_shape || t.sizes() == param.sizes(), key, " is ", t.sizes(),
              ", its parameter ", param.sizes());
  return t.to(param.device());
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
